"""The offloading runtime under threads and failures: never a wrong token, never a hang.

Calls on one offloaded model from several threads are serialised (``generate``,
``measure``) or refused with one clear line (a direct forward while another
thread's runs); a prefetch worker's failure, wherever it happens, or a predictor
naming an expert the model lacks, is a clear ``OffloadError`` on the caller within
seconds, the caches stay consistent, and the next call works. Every call that
could hang runs under ``_bounded``, so a regression fails instead of hanging CI.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.hf.layout import experts_modules  # noqa: E402
from stmoe.predictors.base import ModelShape  # noqa: E402
from stmoe.predictors.baselines import RandomPredictor  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.cache import LOADING  # noqa: E402
from stmoe.runtime.store import StoreError, pack  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

PROMPTS = [[5, 6, 7], [12, 13, 14, 15, 16], [40, 41], [70, 3, 9, 27]]
NEW_TOKENS = 5
LIMIT_S = 20.0  # a bounded call returns well within this on a loaded 2-core machine


def _in_threads(target, args_list) -> None:
    """Run ``target(*args)`` for every args on its own thread, all at once; wait for all."""
    threads = [threading.Thread(target=target, args=args) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _bounded(fn, seconds: float = LIMIT_S):
    """``fn()``'s result (or its exception), failing the test if it has not returned
    within ``seconds``: a hang becomes a failure."""
    box: dict = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # handed to the test thread
            box["exc"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: a hang"
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def _resident_tokens(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """What ``OffloadedModel.generate`` must return: the resident model's greedy tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral's store and its resident tokens for every prompt."""
    model, _ = tiny_model("mixtral")
    expected = {tuple(p): _resident_tokens(model, p) for p in PROMPTS}
    store = pack(model, tmp_path_factory.mktemp("concurrency") / "store")
    return store, expected


def _offloaded(store, **kwargs):
    options = {"capacity": 3, "predictor": "random", "tier": "emulated", "bandwidth": 1e10,
               "workers": 2, **kwargs}
    return offload(tiny_model("mixtral")[0], store, **options)


# ---- item 3: several threads, one offloaded model -----------------------------------------
def test_threads_sharing_one_offloaded_model_get_the_resident_tokens(mixtral):
    store, expected = mixtral
    results: list[tuple[list[int], list[int]]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def client(k: int) -> None:
        try:
            start.wait()
            for i in range(3):
                prompt = PROMPTS[(k + i) % len(PROMPTS)]
                results.append((prompt, om.generate(prompt, max_new_tokens=NEW_TOKENS).tokens))
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    with _offloaded(store) as om:
        _bounded(lambda: _in_threads(client, [(k,) for k in range(4)]), 60.0)
        om.engine.check()
    assert not errors, errors
    assert len(results) == 12
    for prompt, tokens in results:
        assert tokens == expected[tuple(prompt)], prompt


def test_a_direct_forward_while_another_thread_runs_is_refused_in_one_line(mixtral):
    store, expected = mixtral
    with _offloaded(store) as om:
        inside, release = threading.Event(), threading.Event()
        planner = om.engine.planner
        base = planner.after_routing

        def held(*args, **kwargs):  # keeps the first caller inside its run, mid-forward
            inside.set()
            release.wait(LIMIT_S)
            return base(*args, **kwargs)

        planner.after_routing = held
        first: dict = {}
        thread = threading.Thread(
            target=lambda: first.update(out=om.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)),
            name="first-caller",
        )
        thread.start()
        assert inside.wait(LIMIT_S)
        ids = torch.tensor([PROMPTS[1]])
        busy = r"busy: thread 'first-caller' is running a measured"
        with pytest.raises(OffloadError, match=busy):
            _bounded(lambda: om.model(input_ids=ids))
        with pytest.raises(OffloadError, match="one offloaded model serves one call at a time"):
            _bounded(lambda: om.model.generate(ids, max_new_tokens=2, do_sample=False,
                                               pad_token_id=0))
        # an experts module called on its own, outside any model forward, is refused too
        experts = experts_modules(om.model)[0][1]
        hidden, index = torch.zeros(1, 32), torch.tensor([[0, 1]])
        with pytest.raises(OffloadError, match="busy: thread 'first-caller'"):
            _bounded(lambda: experts(hidden, index, torch.ones(1, 2)))
        release.set()
        thread.join(LIMIT_S)
        planner.after_routing = base
        assert first["out"].tokens == expected[tuple(PROMPTS[0])]
        om.engine.check()
        assert om.engine.state.owner is None
        # the refused calls left nothing behind: direct use works again, and so does generate
        with torch.no_grad():
            _bounded(lambda: om.model(input_ids=ids))
            _bounded(lambda: experts(hidden, index, torch.ones(1, 2)))
        assert om.engine.state.owner is None
        got = om.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS).tokens
        assert got == expected[tuple(PROMPTS[1])]


def test_overlapping_direct_forwards_from_two_threads_never_mix(mixtral):
    """Two threads calling ``om.model.generate`` themselves: each forward is exclusive, so
    a call either gets the resident tokens or a clear busy error, never wrong output."""
    store, expected = mixtral
    outcomes: list[tuple[list[int], object]] = []

    def client(prompt: list[int]) -> None:
        for _ in range(3):
            ids = torch.tensor([prompt])
            try:
                with torch.no_grad():
                    out = om.model.generate(ids, attention_mask=torch.ones_like(ids),
                                            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                            do_sample=False, pad_token_id=0)
                outcomes.append((prompt, out[0, len(prompt) :].tolist()))
            except OffloadError as exc:
                outcomes.append((prompt, exc))

    with _offloaded(store) as om:
        _bounded(lambda: _in_threads(client, [(p,) for p in PROMPTS[:2]]), 60.0)
        om.engine.check()
        assert om.engine.state.owner is None  # every forward, refused or not, let go
    assert len(outcomes) == 6
    for prompt, got in outcomes:
        if isinstance(got, OffloadError):
            assert "one offloaded model serves one call at a time" in str(got)
        else:
            assert got == expected[tuple(prompt)], prompt


def test_a_nested_measure_is_refused_instead_of_deadlocking(mixtral):
    store, expected = mixtral
    with _offloaded(store) as om:
        nested = r"inside a measured run \(or a forward call\) of this model"
        with pytest.raises(OffloadError, match=nested):
            _bounded(lambda: om.measure(lambda: om.generate(PROMPTS[0], max_new_tokens=2)))
        assert om.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS).tokens == expected[
            tuple(PROMPTS[0])]


# ---- item 5: failures in the workers and at the predictor boundary ---------------------------
class _WidePredictor(RandomPredictor):
    """Predicts one expert id the model does not have (as tables profiled wider would)."""

    name = "too-wide"

    def predict_batch(self, layer, slots, max_size=0):
        ids = super().predict_batch(layer, slots, max_size)
        return [*ids[:-1], self.shape.num_experts]


def _after_failure_the_model_still_works(om, expected) -> None:
    """The caches are consistent, and the next generation gives the resident tokens."""
    om.engine.check()
    prompt = PROMPTS[2]
    got = _bounded(lambda: om.generate(prompt, max_new_tokens=NEW_TOKENS))
    assert got.tokens == expected[tuple(prompt)]
    om.engine.check()
    assert all(not c.loading() for c in om.engine.caches)
    assert om.engine.state.owner is None


def test_a_predictor_naming_an_expert_beyond_n_is_a_clear_error_not_a_hang(mixtral):
    store, expected = mixtral
    wide = _WidePredictor(ModelShape(3, 8, 2))
    with _offloaded(store, predictor=wide) as om:
        start = time.perf_counter()
        with pytest.raises(OffloadError, match=r"predictor 'too-wide' predicted expert 8 .*0\.\.7"):
            _bounded(lambda: om.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS))
        assert time.perf_counter() - start < 10
        om.engine.planner.predictor = RandomPredictor(ModelShape(3, 8, 2))
        _after_failure_the_model_still_works(om, expected)


class _FailingTier:
    """Wraps a tier; reads made by prefetch workers raise ``exc`` while armed."""

    # the Tier protocol: never reads in place, so the loader fetches and copies

    name, emulated, reads_in_place = "failing", False, False


    def read_into(self, block, parts, between=None):

        return False

    def __init__(self, inner, exc: BaseException) -> None:
        self.inner, self.exc, self.armed = inner, exc, True

    def fetch(self, block, buf, between=None):
        if self.armed and threading.current_thread().name.startswith("stmoe-prefetch"):
            raise self.exc
        return self.inner.fetch(block, buf)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("exc", [KeyError((0, 99)), OSError(5, "Input/output error (injected)"),
                                 RuntimeError("injected")])
def test_a_worker_whose_fetch_raises_anything_fails_the_call_at_once(mixtral, exc):
    store, expected = mixtral
    with _offloaded(store) as om:
        om.engine.tier = tier = _FailingTier(om.engine.tier, exc)
        with pytest.raises(StoreError, match="a prefetch worker failed"):
            _bounded(lambda: om.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS))
        tier.armed = False
        _after_failure_the_model_still_works(om, expected)



class _FailingDisk(_FailingTier):
    """Every read raises while armed, the compute thread's too; the prefetches queued as
    each of the compute thread's failed are counted."""

    def __init__(self, inner, engine) -> None:
        super().__init__(inner, OSError(5, "Input/output error (injected)"))
        self.engine, self.queued = engine, []

    def fetch(self, block, buf, between=None):
        if self.armed and not threading.current_thread().name.startswith("stmoe-prefetch"):
            self.queued.append(len(self.engine.prefetcher.queue))
        if self.armed:
            raise self.exc
        return self.inner.fetch(block, buf)


def test_a_failed_forwards_prefetches_are_not_the_next_forwards_error(mixtral):
    """transformers' own generate on the offloaded model (no measured run: nothing resets
    between calls). A forward failing at a layer leaves the prefetches it queued; read
    after it while the disk still failed, their error was the next call's, on a disk that
    works again. They end with the failed forward (``Engine.leave_step``)."""
    store, expected = mixtral
    prompt = PROMPTS[1]
    ids = torch.tensor([prompt])

    def generate():
        return om.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)

    with _offloaded(store) as om:
        engine = om.engine
        engine.tier = tier = _FailingDisk(engine.tier, engine)
        with pytest.raises(OSError, match="injected"):
            _bounded(generate)
        with engine.cv:  # what the workers would still read, they read failing
            while engine.prefetcher.queue:
                engine.cv.wait(0.05)
            engine.prefetcher.drain()
        tier.armed = False
        assert tier.queued and tier.queued[0] > 0  # prefetches were queued as it failed
        assert _bounded(generate)[0, len(prompt):].tolist() == expected[tuple(prompt)]
        om.engine.check()

def test_a_worker_failing_before_its_fetch_fails_the_call_at_once(mixtral):
    """A request for an expert the store lacks (queued past the predictor check) fails in
    the worker before any read: the caller gets the error, the workers keep serving."""
    store, expected = mixtral
    with _offloaded(store) as om:
        prefetcher = om.engine.prefetcher
        base = prefetcher.request
        prefetcher.request = lambda fwd, layer, experts, max_loads: base(
            fwd, layer, [8, *experts], max_loads)
        bad = r"worker failed: layer \d: expert 8 is outside its experts 0\.\.7"
        with pytest.raises(StoreError, match=bad):
            _bounded(lambda: om.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS))
        prefetcher.request = base
        assert all(t.is_alive() for t in prefetcher._threads)
        _after_failure_the_model_still_works(om, expected)


def _plant_a_dead_load(engine, cache, expert: int) -> None:
    """Leave ``expert``'s slot LOADING by a thread that has ended (as a loader that died)."""

    def claim() -> None:
        with engine.cv:
            cache.claim(expert, prefetch=True)

    t = threading.Thread(target=claim)
    t.start()
    t.join()
    assert cache.state[cache.where[expert]] == LOADING


def test_a_slot_whose_loader_died_is_reloaded_by_the_caller(mixtral):
    """A LOADING slot whose thread is gone can never become READY: the compute thread's
    wait notices, frees it and loads the expert itself (no hang)."""
    store, expected = mixtral
    with _offloaded(store, capacity=8, workers=0) as om:
        engine = om.engine
        cache = engine.caches[0]
        _plant_a_dead_load(engine, cache, 3)
        with engine.cv:
            cache.pinned = frozenset({3})
        slots, _, _, _ = _bounded(lambda: engine.path._ensure(cache, [3]), 10.0)
        with engine.cv:
            cache.pinned = frozenset()
        assert cache.holder[slots[3]] == 3 and not cache.loading()
        engine.check()
        _plant_a_dead_load(engine, cache, 5)  # left between runs: the next run frees it
        _after_failure_the_model_still_works(om, expected)


def test_a_stuck_load_is_a_clear_error_after_the_stall_limit(mixtral):
    """A worker whose read never returns: the caller waiting for that expert gets a clear
    error after the stall limit; once the read completes, the model works again."""
    store, expected = mixtral
    with _offloaded(store, capacity=8, predictor="oracle") as om:  # it prefetches the needed
        engine = om.engine
        engine.prefetcher.stall_limit_s = 1.0
        gate = threading.Event()
        inner = engine.tier

        class Stuck:
            # the Tier protocol: never reads in place, so the loader fetches and copies
            name, emulated, reads_in_place = "stuck", False, False

            def read_into(self, block, parts, between=None):
                return False

            def fetch(self, block, buf, between=None):
                if threading.current_thread().name.startswith("stmoe-prefetch"):
                    gate.wait(LIMIT_S)
                return inner.fetch(block, buf)

            def close(self) -> None:
                inner.close()

        engine.tier = Stuck()
        with pytest.raises(StoreError, match=r"expert \d+ has been loading for more than 1 s on "
                                             r"thread 'stmoe-prefetch-\d'"):
            _bounded(lambda: om.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS))
        gate.set()  # the reads complete: the model recovers
        engine.tier = inner
        engine.prefetcher.stall_limit_s = 300.0
        _after_failure_the_model_still_works(om, expected)
