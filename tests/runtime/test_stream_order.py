"""The GPU tiers' stream protocol checked as CUDA orders work (store/happens_before.py), on
the CPU's stand-in: each pair of accesses to one cache row where one writes is ordered by the
streams' waits, events and the host's synchronizations, or it is a race, whatever the host's
timing. Why: the stand-in computes on the host as a kernel is called, so a slot rewritten
while its readers are only queued (issue 43's write-after-read race) gives the right bits
there; this check sees it. Issue 43, item 4."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_quantized import FORMATS, _generate, quantizable  # noqa: E402

from staggered_requests import submit_staggered  # noqa: E402
from stmoe.runtime.accelerator import GPU_TIERS, stand_in  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.slot_events import SlotEvents  # noqa: E402
from stmoe.runtime.store import pack  # noqa: E402
from stmoe.runtime.store.bounce import BouncePool  # noqa: E402
from stmoe.runtime.store.checked_ops import (  # noqa: E402
    CheckedOps,
    clock_of,
    watch_bounce,
    watching,
)
from stmoe.runtime.store.device_ops import CopySpan  # noqa: E402
from stmoe.runtime.store.happens_before import OrderingCheck  # noqa: E402
from stmoe.runtime.store.index import slot_bytes  # noqa: E402
from stmoe.runtime.store.stand_in import HostThreadOps  # noqa: E402
from tiny_moe import FAMILIES, packed_with_tables, tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # more experts than a top-k cache holds: rows move
NEW = 16
UNTABLED = ("ondemand", "random", "oracle", "gate-lookahead")  # predictors without tables
ONE_MOE_LAYER = {"num_hidden_layers": 2, "mlp_only_layers": [1]}  # qwen2_moe's


def _check(rows: int = 3) -> tuple[OrderingCheck, object, torch.Tensor]:
    check = OrderingCheck()
    slab = torch.zeros(rows, 16)
    check.track("slab", slab)
    return check, CheckedOps(check, HostThreadOps()), slab


def test_a_copy_read_by_the_compute_stream_without_a_wait_is_a_race():
    check, ops, slab = _check()
    ops.copy_async(slab[1], torch.ones(16), "copy stream")
    with watching(check):
        slab[1].sum()
    assert check.race_count == 1 and "slab row 1" in str(check.races[0])
    ops.close()


def test_a_wait_on_the_copys_event_or_the_host_having_seen_it_orders_the_read():
    check, ops, slab = _check()
    event = ops.copy_async(slab[0], torch.ones(16), "copy stream")
    ops.wait(None, event)  # the compute stream waits (the device, not the host)
    with watching(check):
        slab[0].sum()
    later = ops.copy_async(slab[2], torch.ones(16), "copy stream")
    later.synchronize()  # the host saw it land: what is queued after follows it
    with watching(check):
        slab[2].sum()
    assert check.race_count == 0 and check.reads == 2 and check.writes == 2
    ops.close()


def test_a_rewrite_waits_for_the_readers_free_event_or_it_races():
    check, ops, slab = _check()
    ops.copy_async(slab[0], torch.ones(16), None)  # (on the compute stream: ordered)
    with watching(check):
        slab[0].sum()
    free = ops.record(None)
    ops.wait("loader", free)
    ops.wait(None, ops.copy_async(slab[0], torch.zeros(16), "loader"))
    assert check.race_count == 0
    with watching(check):
        slab[0].sum()
    ops.copy_async(slab[0], torch.ones(16), "another loader")  # no wait for the readers
    assert check.race_count >= 1
    assert "writing: a copy" in check.races[0].second
    ops.close()


def test_rows_picked_by_an_index_are_the_rows_read():
    """An index reads its rows only: a copy into another row of the slab does not race."""
    check, ops, slab = _check()
    first = ops.copy_async(slab[0], torch.ones(16), "copy stream")
    ops.wait(None, first)
    with watching(check):
        slab[torch.tensor([0, 0])].sum()
        torch.index_select(slab, 0, torch.tensor([0])).sum()
    ops.copy_async(slab[1], torch.ones(16), "copy stream")
    assert check.race_count == 0
    with watching(check):
        slab.sum()  # the whole slab: row 1 too
    assert check.race_count == 1
    ops.close()


def test_a_span_is_waited_on_by_its_end_and_an_unknown_event_is_refused():
    _, ops, slab = _check()
    start = ops.record("s")
    ops.copy_async(slab[0], torch.ones(16), "s")
    span = CopySpan(start, ops.record("s"), 64)
    assert clock_of(span) == clock_of(span.end)
    with pytest.raises(TypeError, match="did not make"):
        clock_of(object())
    ops.close()


class InlineOps(HostThreadOps):
    """As CUDA's: a copy and a launched work are torch calls on the calling thread."""

    def copy_async(self, dst, src, stream):
        dst.copy_(src)
        return self.record(stream)

    def launch(self, stream, work):
        work()


def test_the_ops_own_torch_calls_are_theirs_not_the_compute_streams():
    """Where the device ops call torch on the watched thread (CUDA's copy, a conversion
    launched on a copy stream), those calls are the copy stream's work: a later copy that
    waits for them alone does not race with a compute that never touched the row."""
    check = OrderingCheck()
    slab = torch.zeros(2, 16)
    check.track("slab", slab)
    ops = CheckedOps(check, InlineOps())
    with watching(check):
        first = ops.copy_async(slab[0], torch.ones(16), "s")
        ops.launch("s", lambda: slab[0].mul_(2))  # (a conversion in place, on "s")
        ops.wait("t", ops.record("s"))
        ops.copy_async(slab[0], torch.ones(16), "t")
    assert check.writes == 3 and check.race_count == 0, check.summary()
    assert clock_of(first)[1] == 1  # the copy was stream "s"'s first work
    ops.close()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(family, config changes) -> its store and tables, made once for the module."""
    made: dict = {}

    def get(family: str, changes: dict) -> tuple:
        key = (family, repr(sorted(changes.items())))
        if key not in made:
            made[key] = packed_with_tables(family, tmp_path_factory.mktemp(family),
                                           **changes)[1:]
        return made[key]
    return get


def _run(family: str, tier: str, changes: dict | None = None, packed=None,
         predictor: str = "stmoe", delay: float = 0.001, **options) -> OrderingCheck:
    """A generation at capacity top-k on the stand-in, two loaders, every row tracked;
    each copy ``delay`` seconds late."""
    store, tables = packed(family, changes or {})
    options = {"capacity": 2, "workers": 2, **options}
    check = OrderingCheck()
    with stand_in(ops=CheckedOps(check, HostThreadOps(delay=delay))), offload(
            tiny_model(family, **(changes or {}))[0], store, predictor=predictor,
            tables=None if predictor in UNTABLED else tables, tier=tier,
            **options) as om, _tracked(check, om):
        om.generate(PROMPT, max_new_tokens=NEW)
        om.generate(PROMPT[:2], max_new_tokens=4)  # a second sequence, its own prompt
    return check


@contextmanager
def _tracked(check: OrderingCheck, om) -> Iterator[None]:
    """Every cache row of ``om`` tracked (and gpu-disk's bounce buffers); the calling
    thread's torch calls watched."""
    for i, cache in enumerate(om.engine.state.caches):
        for name, slab in cache.rows.items():
            check.track(f"layer {i} {name}", slab)
    watch_bounce(check, om.engine.tier)
    with watching(check):
        yield


@pytest.mark.parametrize("tier", GPU_TIERS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_familys_run_on_a_gpu_tier_is_ordered(family, tier, packed):
    """Capacity top-k, two loaders, a prompt that moves rows and reads extra experts."""
    check = _run(family, tier, packed=packed, predictor="stmoe-plus")
    assert check.writes > 0 and check.reads > 0 and check.compared > 0  # it saw the slots
    assert check.race_count == 0, check.summary()


@pytest.mark.parametrize("capacity", [2, 5])
@pytest.mark.parametrize("predictor", ["ondemand", "stmoe", "random", "oracle", "stmoe-plus",
                                       "hybrid", "gate-lookahead"])
def test_every_predictors_run_is_ordered(predictor, capacity, packed):
    """Three loaders; the gate lookahead's early and late points, the oracle's two passes."""
    check = _run("mixtral", "gpu-disk", packed=packed, predictor=predictor,
                 capacity=capacity, workers=3)
    assert check.writes > 0 and check.race_count == 0, check.summary()


def test_score_eviction_is_ordered(packed):
    check = _run("qwen2_moe", "gpu", packed=packed, predictor="stmoe-plus", capacity=3,
                 policy="score")
    assert check.writes > 0 and check.race_count == 0, check.summary()


def test_one_moe_layer_reuses_a_slot_right_after_its_readers(packed):
    """One MoE layer: the next token's prefetch rewrites the slots its kernels were just
    queued to read, with no router copy to the host between: only the free event orders
    them. Without ``after_read`` (the issue's race) the check finds it."""
    assert _run("qwen2_moe", "gpu", ONE_MOE_LAYER, packed).race_count == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SlotEvents, "after_read", lambda self, slots: None)
        broken = _run("qwen2_moe", "gpu", ONE_MOE_LAYER, packed)
    assert broken.race_count > 0
    assert any("reading: aten" in r.first and "writing: a copy" in r.second
               for r in broken.races), broken.summary()


def test_without_the_ready_wait_a_read_races_with_its_copy(packed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SlotEvents, "before_read", lambda self, slots: None)
        broken = _run("qwen2_moe", "gpu", ONE_MOE_LAYER, packed)
    assert any("writing: a copy" in r.first and "reading: aten" in r.second
               for r in broken.races), broken.summary()


def test_a_runs_bounce_buffers_are_checked_too(packed):
    """gpu-disk reads each block into a pinned bounce buffer on the host and copies it out
    on a stream: a run's reads into the buffers and copies out of them are checked (every
    gpu-disk run here tracks them), and ordered."""
    check = _run("mixtral", "gpu-disk", packed=packed, workers=3)
    bounced = sum(n for label, n in check.by_slab.items() if label.startswith("bounce"))
    assert bounced > 0 and check.race_count == 0, (check.by_slab, check.summary())


@pytest.mark.parametrize("drained", [True, False])
def test_a_bounce_buffer_refilled_before_its_copy_ran_is_a_race(packed, drained):
    """One buffer, two loads back to back, copies 50 ms late: the second read waits for the
    first copy's event (``BouncePool._drain``), or it is the host's write racing a copy
    still queued to read the buffer."""
    from stmoe.runtime.store import ExpertStore
    from stmoe.runtime.store.reading import open_disk_to_device
    from stmoe.runtime.store.stand_in import NoPinning

    store = ExpertStore(packed("mixtral", {})[0])
    check, inner = OrderingCheck(), HostThreadOps(delay=0.05)
    tier = open_disk_to_device(store, CheckedOps(check, inner), NoPinning(), buffers=1)
    try:
        watch_bounce(check, tier)
        with pytest.MonkeyPatch.context() as mp:
            if not drained:
                mp.setattr(BouncePool, "_drain", lambda self, b: setattr(b, "pending", None))
            for block in list(store.blocks.values())[:2]:
                slot = [torch.empty(slot_bytes(t), dtype=torch.uint8) for t in block.tensors]
                tier.load(block, slot, stream="loader")
    finally:
        tier.close()
        inner.close()
    assert check.by_slab["bounce buffer 0"] >= 4  # two reads into it, two copies out
    if drained:
        assert check.race_count == 0, check.summary()
    else:
        assert any("a copy" in r.first and "a read from disk on the host" in r.second
                   for r in check.races), check.summary()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_quantized_stores_run_is_ordered(fmt, tmp_path):
    """int8 and int4 experts (their kernels read a slot's rows), a batch of two prompts."""
    store = pack(quantizable("qwen3_moe"), tmp_path / "store", weights=FORMATS[fmt])
    check = OrderingCheck()
    with stand_in(ops=CheckedOps(check, HostThreadOps(delay=0.001))), offload(
            quantizable("qwen3_moe"), store, capacity=2, predictor="ondemand",
            tier="gpu-disk", workers=2) as om, _tracked(check, om):
        _generate(om.model)
    assert check.writes > 0 and check.reads > 0
    assert check.race_count == 0, check.summary()


@pytest.mark.parametrize("fmt", ["native", "int4"])
def test_a_servers_steps_are_ordered(fmt, tmp_path, monkeypatch):
    """Three requests through the step batcher (int4: one batched forward per step), its
    thread, each request's and the two threads computing a step's segments watched."""
    from stmoe.runtime.batcher import StepBatcher
    from stmoe.runtime.batcher import batcher as module

    check = OrderingCheck()

    def watched(run):
        def on_a_watched_thread(self, *args):
            with watching(check):
                return run(self, *args)
        return on_a_watched_thread

    for name in ("_main", "_member"):
        monkeypatch.setattr(module.StepBatcher, name, watched(getattr(module.StepBatcher, name)))

    class WatchedPool(module.ThreadPoolExecutor):  # the threads computing a step's segments
        def submit(self, fn, /, *args, **kwargs):  # (``map`` submits)
            def on_a_watched_thread():
                with watching(check):
                    return fn(*args, **kwargs)
            return super().submit(on_a_watched_thread)

    monkeypatch.setattr(module, "ThreadPoolExecutor", WatchedPool)
    store = pack(quantizable("qwen3_moe"), tmp_path / "store", weights=FORMATS.get(fmt))
    resident = {"quantize_resident": "int4"} if fmt == "int4" else {}
    with stand_in(ops=CheckedOps(check, HostThreadOps(delay=0.001))), offload(
            quantizable("qwen3_moe"), store, capacity=3, predictor="ondemand", tier="gpu",
            workers=2, **resident) as om, _tracked(check, om):
        batcher = StepBatcher(om, max_batch=3, compute_threads=2)
        try:
            submit_staggered(batcher)
        finally:
            batcher.close()
        assert batcher.batched == (fmt == "int4")
    assert check.writes > 0 and check.reads > 0
    assert check.race_count == 0, check.summary()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CI has none")
@pytest.mark.parametrize("tier", GPU_TIERS)
@pytest.mark.parametrize("fmt", ["native", "int4"])
def test_on_cuda_the_streams_order_every_access(fmt, tier, tmp_path, monkeypatch):
    """CUDA's own ops (streams, events, an int4 slot's conversion launched on its copy
    stream), checked: what the stand-in's branches leave out."""
    import stmoe.runtime.accelerator as accelerator

    check, real = OrderingCheck(), accelerator.CudaOps
    monkeypatch.setattr(accelerator, "CudaOps", lambda device: CheckedOps(check, real(device)))
    store = pack(quantizable("qwen3_moe"), tmp_path / "store", weights=FORMATS.get(fmt))
    with offload(quantizable("qwen3_moe"), store, capacity=2, predictor="ondemand",
                 tier=tier, workers=2) as om:
        assert isinstance(om.engine.tier.ops, CheckedOps)
        with _tracked(check, om):
            om.generate(PROMPT, max_new_tokens=NEW)
    assert check.writes > 0 and check.reads > 0
    assert check.race_count == 0, check.summary()
