"""Step batching keeps every request's bits: each request's logits, at every token, equal
its solo run on the resident model, in every family, at capacities where the step's
union overflows the cache, with requests of different lengths joining and leaving at
different steps. Also: replayed routings (and the oracle) in a batch, a cancelled
request leaving without touching the others, the bounded queue, the late lookahead
refused."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staggered_requests import LENGTHS, PROMPTS, LogitLog, submit_staggered  # noqa: E402
from staggered_requests import solo as _solo  # noqa: E402
from stmoe.errors import OffloadError  # noqa: E402
from stmoe.hf.capture_generate import capture_generation  # noqa: E402
from stmoe.predictors import profile, save_tables  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.batcher import QueueFull, Request, StepBatcher, replay_request  # noqa: E402
from stmoe.runtime.forced_routing import plan_routing  # noqa: E402
from tiny_moe import FAMILIES, tiny_model  # noqa: E402


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_request_has_its_solo_bits_whatever_runs_beside_it(name, tmp_path):
    resident = tiny_model(name)[0]
    log = LogitLog(resident)
    want = []
    for p, n in zip(PROMPTS, LENGTHS, strict=True):
        want.append((_solo(resident, p, n), log.take()))
    routing = capture_generation(tiny_model(name)[0], [[40, 41, 42], [50, 51]], max_new_tokens=6)
    tables = save_tables(profile(routing), tmp_path / "tables.npz")
    for capacity, predictor in ((2, "stmoe"), (5, "stmoe-plus")):
        model = tiny_model(name)[0]
        logs = LogitLog(model)
        with offload(model, capacity=capacity, predictor=predictor, tables=tables) as om:
            batcher = StepBatcher(om, max_batch=3)
            try:
                reqs, got = submit_staggered(batcher)
            finally:
                batcher.close()
            for i, (r, (tokens, logits)) in enumerate(zip(reqs, want, strict=True)):
                where = f"{name}, capacity {capacity}, request {i}"
                assert got[i] == tokens, where
                mine = logs.take(r.thread_name)
                assert len(mine) == len(logits), where
                assert all(torch.equal(a, b) for a, b in zip(mine, logits, strict=True)), where
                assert r.usage.needed > 0 and 0 <= r.usage.hits <= r.usage.needed, where


def _tiny_offloaded(tmp_path, predictor: str = "stmoe", **kw):
    model = tiny_model("qwen3_moe")[0]
    routing = capture_generation(tiny_model("qwen3_moe")[0], [[40, 41, 42, 43], [50, 51, 52]],
                                 max_new_tokens=10)
    tables = save_tables(profile(routing), tmp_path / "tables.npz")
    tables = None if predictor == "oracle" else tables
    return offload(model, capacity=4, predictor=predictor, tables=tables, **kw), routing


@pytest.mark.parametrize("predictor", ["stmoe-plus", "oracle"])
def test_replayed_routings_batch_and_match_their_solo_replays(predictor, tmp_path):
    om, routing = _tiny_offloaded(tmp_path, predictor)
    with om:
        c = om.config
        plans = [plan_routing(routing, s, c["num_layers"], c["num_experts"], c["top_k"], 96)
                 for s in range(2)]
        solo = [om.force_routing(p, 8) for p in plans]
        batcher = StepBatcher(om, max_batch=2)
        try:
            reqs = [batcher.submit(replay_request(p, 8)) for p in plans]
            got = [r.wait(120) for r in reqs]
        finally:
            batcher.close()
    assert got == [s.tokens for s in solo]
    decode = om.engine.run.stats.phases["decode"].summary()
    if predictor == "oracle":  # it names only experts the step routes, and nearly all of them
        # (not all: after a prompt's step, which foresees that prompt's part alone, the first
        # decode step's other requests are not foreseen; here 67 of 69, every run). Its hit
        # rate is no test: 69 of 69 in runs here (the two not foreseen found cached), 67 of
        # 69 once under CI's load (those two not in the cache then): the cache's contents
        # after the prompts' steps depend on when their prefetches land
        assert decode["prefetch_precision"] == 1.0, decode
        assert decode["prefetch_recall"] >= 0.95, decode


def test_a_cancelled_request_leaves_and_the_others_keep_their_bits(tmp_path):
    resident = tiny_model("qwen3_moe")[0]
    want = _solo(resident, PROMPTS[0], 12)
    om, _ = _tiny_offloaded(tmp_path)
    with om:
        batcher = StepBatcher(om, max_batch=2)
        try:
            keep = batcher.submit(Request(torch.tensor([PROMPTS[0]]), 12))
            gone = batcher.submit(Request(torch.tensor([PROMPTS[1]]), 100))
            while len(gone.output) < 2:
                time.sleep(0.005)
            gone.cancel()
            with pytest.raises(Exception, match="cancelled"):
                gone.wait(60)
            assert keep.wait(60) == want
            assert len(gone.output) < 100
            assert batcher.queue_depth() == (0, 0)
            again = batcher.submit(Request(torch.tensor([PROMPTS[0]]), 12))  # still serving
            assert again.wait(60) == want
        finally:
            batcher.close()
        om.engine.check()


def test_the_queue_is_bounded_and_a_closed_batcher_refuses(tmp_path):
    om, _ = _tiny_offloaded(tmp_path)
    with om:
        batcher = StepBatcher(om, max_batch=1, max_queue=1)
        try:
            first = batcher.submit(Request(torch.tensor([PROMPTS[0]]), 60))
            while not first.output:
                time.sleep(0.005)
            batcher.submit(Request(torch.tensor([PROMPTS[1]]), 2))  # waits for the place
            with pytest.raises(QueueFull, match="retry later"):
                batcher.submit(Request(torch.tensor([PROMPTS[2]]), 2))
            first.cancel()
        finally:
            batcher.close()
        with pytest.raises(OffloadError, match="closed"):
            batcher.submit(Request(torch.tensor([PROMPTS[2]]), 2))
        # the engine is free again: a plain generate runs
        assert om.generate(PROMPTS[0], 3).tokens == _solo(tiny_model("qwen3_moe")[0],
                                                          PROMPTS[0], 3)


def test_the_batcher_refuses_the_late_lookahead(tmp_path):
    model = tiny_model("qwen3_moe")[0]
    with offload(model, capacity=4, predictor="gate-lookahead", lookahead="late") as om:
        if om.engine.planner.late is None:
            pytest.skip("the late point was not resolved for this family")
        with pytest.raises(OffloadError, match="--lookahead early"):
            StepBatcher(om)


class _FailingReads:
    """Wraps a tier: every read fails while ``armed`` (a damaged disk, on cue)."""

    name, emulated, reads_in_place = "failing", False, False

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, False
        self.on_failure = lambda: None

    def read_into(self, block, parts, between=None):
        return False

    def fetch(self, block, buf, between=None):
        if self.armed:
            self.on_failure()
            raise OSError(5, "Input/output error (injected)")
        return self.inner.fetch(block, buf)

    def close(self) -> None:
        self.inner.close()


def test_a_failed_read_fails_its_step_and_the_batcher_keeps_serving(tmp_path):
    want = _solo(tiny_model("qwen3_moe")[0], PROMPTS[0], 6)
    om, _ = _tiny_offloaded(tmp_path)
    with om:
        om.engine.tier = tier = _FailingReads(om.engine.tier)
        batcher = StepBatcher(om, max_batch=2)
        try:
            tier.armed = True
            failed = [batcher.submit(Request(torch.tensor([p]), 6)) for p in PROMPTS[:2]]
            for r in failed:
                with pytest.raises(Exception, match="Input/output error"):
                    r.wait(60)
            tier.armed = False
            assert batcher.submit(Request(torch.tensor([PROMPTS[0]]), 6)).wait(60) == want
            assert batcher.queue_depth() == (0, 0)
        finally:
            batcher.close()
        om.engine.check()



def test_a_failed_steps_prefetches_are_not_the_next_requests_error(tmp_path):
    """A step that fails at a layer leaves the prefetches it queued for the next ones: read
    after it, while the disk still fails, their error was the next request's, on a disk
    that works again (seen under load). They end with their step: the next request gets its
    solo output."""
    want = _solo(tiny_model("qwen3_moe")[0], PROMPTS[0], 6)
    om, _ = _tiny_offloaded(tmp_path)
    with om:
        engine = om.engine
        engine.tier = tier = _FailingReads(engine.tier)
        queued: list[int] = []  # prefetches queued as each armed read failed
        tier.on_failure = lambda: queued.append(len(engine.prefetcher.queue))
        batcher = StepBatcher(om, max_batch=1)
        try:
            tier.armed = True
            with pytest.raises(OSError, match="injected"):
                batcher.submit(Request(torch.tensor([PROMPTS[0]]), 6)).wait(60)
            with engine.cv:  # what the workers would still read, they read failing
                while engine.prefetcher.queue:
                    engine.cv.wait(0.05)
                engine.prefetcher.drain()
            tier.armed = False
            assert queued and queued[0] > 0  # the step's failing read left prefetches queued
            assert batcher.submit(Request(torch.tensor([PROMPTS[0]]), 6)).wait(60) == want
        finally:
            batcher.close()
        engine.check()
