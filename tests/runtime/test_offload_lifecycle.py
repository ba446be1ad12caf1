"""An offloaded model in its user's own code: what may change after ``stmoe.offload`` (and
is refused where the outputs would no longer be the resident model's), and its close.

From a practitioner's review (2026-12-07): casting the model after offloading, or switching
its experts implementation, ran on without an error and gave other tokens (or zeros and
NaN); a second ``close`` raised an AttributeError; ``close`` kept the caches' memory."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.options import OffloadOptions  # noqa: E402
from stmoe.runtime.store import pack  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

IDS = torch.tensor([[5, 17, 33, 60, 7, 21]])


@pytest.fixture()
def offloaded(tmp_path):
    model, _ = tiny_model("qwen3_moe")
    store = pack(model, tmp_path / "store")
    model, _ = tiny_model("qwen3_moe")
    with offload(model, store, capacity=3, predictor="ondemand") as om:
        yield om


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half()])
def test_a_model_cast_after_offload_is_refused_at_its_next_call(offloaded, cast):
    with torch.no_grad():
        offloaded.model(IDS)  # runs as offloaded
        cast(offloaded.model)
        with pytest.raises(OffloadError, match=r"cast to torch.*stored in torch\.float32: "
                                               r"cast the model before offloading"):
            offloaded.model(IDS)


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_switching_the_experts_implementation_after_offload_is_refused(offloaded, impl):
    offloaded.model.set_experts_implementation(impl)
    with torch.no_grad(), pytest.raises(OffloadError, match=f"set to '{impl}' after "
                                                            "stmoe.offload"):
        offloaded.model(IDS)


def test_a_second_close_does_nothing(offloaded):
    offloaded.close()
    offloaded.close()  # (an AttributeError before: the forward hooks' engine was gone)
    with pytest.raises(OffloadError, match="was closed"):
        offloaded.generate([5, 6, 7], max_new_tokens=2)


def test_close_lets_the_caches_memory_go(offloaded):
    """Nothing the engine made keeps a cache slot alive after close: the slabs, their
    mapped memory and the last call's weights bound on each layer's stand-in (the review
    found 384 MiB of caches still resident after close)."""
    import weakref

    offloaded.generate([5, 6, 7], max_new_tokens=3)
    path = offloaded.engine.path
    slabs = [weakref.ref(t) for c in offloaded.engine.caches for t in c.slabs.values()]
    assert slabs and any(g.__dict__.keys() - {"_module", "_seen"} for g in path.gathered)
    offloaded.close()
    gc.collect()
    assert all(ref() is None for ref in slabs)
    assert not any(c._memory for c in offloaded.engine.caches)


def test_a_step_batcher_is_closed_with_its_model_and_a_run_beside_it_refused(offloaded):
    """The batcher holds the model for its whole life: ``generate`` beside it waited for
    ever, and so did ``close``."""
    import threading

    from stmoe.runtime.batcher.batcher import StepBatcher

    batcher = StepBatcher(offloaded, max_batch=2)
    with pytest.raises(OffloadError, match="serving a StepBatcher"):
        offloaded.generate([5, 6, 7], max_new_tokens=2)
    done = threading.Event()
    closer = threading.Thread(target=lambda: (offloaded.close(), done.set()), daemon=True)
    closer.start()
    assert done.wait(30), "close waited for the batcher"
    assert batcher.closed and not batcher.thread.is_alive()


@pytest.mark.parametrize("tier", ["disk", "emulated"])
@pytest.mark.parametrize("held_past_the_wait", [False, True])
def test_close_from_another_thread_during_a_forward_ends_it_with_the_closed_error(
        tmp_path, monkeypatch, tier, held_past_the_wait):
    """A forward held inside a layer, after the layer's closed check and before its cache is
    read: close waits for it to let go before it frees anything, and the forward fails at its
    next layer with the one clear line. (Freed under it, the forward failed with a KeyError
    on a freed slot or a short read of a closed tier: the review's 4 runs in 15.) Held past
    close's wait (shortened here), the caches are freed under it: it fails with the same
    line, not with a KeyError or a short read that reads as a damaged store."""
    import threading

    import stmoe.runtime.engine as engine

    if held_past_the_wait:
        monkeypatch.setattr(engine, "CLOSE_WAIT_S", 0.2)
    model, _ = tiny_model("qwen3_moe")
    store = pack(model, tmp_path / "store")
    model, _ = tiny_model("qwen3_moe")
    om = offload(model, store, capacity=3, predictor="ondemand", tier=tier,
                 bandwidth="20MB" if tier == "emulated" else None)
    inside, go_on = threading.Event(), threading.Event()
    path, calls = om.engine.path, []
    on_device = path._on_device

    def held(*args, **kwargs):  # (called after the closed check, before the cache is read)
        calls.append(1)
        if len(calls) == 2:
            inside.set()
            go_on.wait(30)
        return on_device(*args, **kwargs)

    path._on_device = held
    errors: list[BaseException] = []

    def run():
        try:
            with torch.no_grad():
                om.model(IDS)
                om.model(IDS)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert inside.wait(30)
    closer = threading.Thread(target=om.close, daemon=True)
    closer.start()
    closer.join(2.0 if held_past_the_wait else 0.5)
    assert closer.is_alive() is not held_past_the_wait, "close freed the caches under a forward"
    go_on.set()
    worker.join(30)
    closer.join(30)
    assert not worker.is_alive() and not closer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], OffloadError), errors
    assert str(errors[0]) == "this offloaded model was closed; offload it again to run it"


def test_a_second_close_from_another_thread_returns_once_the_first_is_over(offloaded):
    """Two threads close one engine: the second waits for the first's teardown (before, it
    returned at once: a caller could then remove a store the first close's workers might
    still read). ``OffloadedModel.close`` also holds its run lock, except called inside a
    run; the engine's close is safe on its own."""
    import threading

    engine = offloaded.engine
    in_first, go_on, order = threading.Event(), threading.Event(), []
    tier_close = engine.tier.close

    def slow_close():
        in_first.set()
        go_on.wait(30)
        tier_close()
        order.append("first done")

    engine.tier.close = slow_close
    first = threading.Thread(target=engine.close, daemon=True)
    first.start()
    assert in_first.wait(30)
    second = threading.Thread(target=lambda: (engine.close(), order.append("second done")),
                              daemon=True)
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second close returned while the first was still closing"
    go_on.set()
    first.join(30)
    second.join(30)
    assert order == ["first done", "second done"]


@pytest.mark.parametrize("call,said", [
    (lambda m, s: offload(m, OffloadOptions(capacity=3)),
     "store is a folder, got OffloadOptions; give options by name"),
    (lambda m, s: offload(None, s), "expected a loaded model or a model folder, got NoneType"),
    (lambda m, s: offload(m, s, options={"capacity": 3}),
     "options: expected an OffloadOptions, got dict"),
    (lambda m, s: offload(m, s, admission="no"), "admission must be True or False, got 'no'"),
    (lambda m, s: offload(m, s, workers=1.5), "workers must be a whole number >= 0, got 1.5"),
    (lambda m, s: offload(m, s, capacity=3.5), "capacity 3.5: give a whole number of experts"),
])
def test_offloads_arguments_are_checked_for_what_they_are(tmp_path, call, said):
    """Each was a bare TypeError or AttributeError, or taken as something else
    (``admission="no"`` as True, ``capacity=3.5`` as 3.5 bytes)."""
    import re

    model, _ = tiny_model("qwen3_moe")
    store = pack(model, tmp_path / "store")
    with pytest.raises(OffloadError, match=re.escape(said)):
        call(model, store)


def test_a_ready_predictor_of_another_shape_is_refused_at_offload(tmp_path):
    """(It was taken, then failed at the first generate with an index out of range.)"""
    from stmoe.predictors import ModelShape, make

    model, _ = tiny_model("qwen3_moe")
    store = pack(model, tmp_path / "store")
    for shape in (ModelShape(2, 8, 2), ModelShape(3, 16, 2)):  # too few layers, other N
        with pytest.raises(OffloadError, match=f"predictor 'random' was made for "
                                               f"L={shape.num_layers} layers"):
            offload(model, store, capacity=3, predictor=make("random", shape))


def test_the_temporary_store_of_a_model_never_closed_goes_when_the_process_exits(tmp_path):
    """A loaded model offloaded without a store gets a temporary one (a copy of its
    experts); never closed, it stayed on disk after the process exited."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from tiny_moe import tiny_model\n"
        "from stmoe.runtime.api import offload\n"
        "om = offload(tiny_model('qwen3_moe')[0], capacity=3, predictor='ondemand')\n"
        "print(om.config['store'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    store = Path(done.stdout.strip().splitlines()[-1])
    assert store.parent == tmp_path and store.name.startswith("stmoe-store-")
    assert not store.exists()


def test_generate_takes_token_ids_as_a_list_or_a_tensor(offloaded):
    want = offloaded.generate([5, 17, 33], max_new_tokens=3).tokens
    assert offloaded.generate(torch.tensor([5, 17, 33]), max_new_tokens=3).tokens == want
    assert offloaded.generate(torch.tensor([[5, 17, 33]]), max_new_tokens=3).tokens == want
    with pytest.raises(OffloadError, match=r"shape \[2, 3\].*one sequence of integer"):
        offloaded.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(OffloadError, match="dtype float32"):
        offloaded.generate(torch.ones(3), max_new_tokens=3)


def test_a_model_dropped_unclosed_stops_its_workers(tmp_path):
    """(Its prefetch threads, and the caches they hold, lived on after ``del``.)"""
    import threading

    def workers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("stmoe-prefetch")}

    before = workers()
    model, _ = tiny_model("qwen3_moe")
    store = pack(model, tmp_path / "store")
    om = offload(tiny_model("qwen3_moe")[0], store, capacity=3, predictor="ondemand")
    om.generate([5, 6, 7], max_new_tokens=3)
    import weakref

    started = workers() - before
    assert started
    slabs = [weakref.ref(t) for c in om.engine.caches for t in c.slabs.values()]
    del om
    gc.collect()
    for t in started:  # (they stop at their next wake: within half a second)
        t.join(5)
    assert not workers() - before
    gc.collect()
    assert all(ref() is None for ref in slabs)  # and the caches went with them


@pytest.mark.parametrize("same_place", [lambda m: m.to("cpu"), lambda m: m.cpu(),
                                        lambda m: m.to(torch.float32), lambda m: m.float()])
def test_moving_the_model_where_it_already_is_changes_nothing(offloaded, same_place):
    """(torch's "Cannot copy out of meta tensor" before: the experts' storage-free meta
    parameters were moved too.)"""
    with torch.no_grad():
        before = offloaded.model(IDS).logits
        assert same_place(offloaded.model) is offloaded.model
        assert torch.equal(offloaded.model(IDS).logits, before)


def test_a_model_moved_after_offload_is_refused_at_its_next_call(offloaded):
    """A move to another device than the experts are served on: one line at the next call
    (the meta device stands in for a GPU here: the resident weights moved, the experts
    served on the CPU)."""
    offloaded.model.to("meta")
    with torch.no_grad(), pytest.raises(OffloadError, match=r"moved to meta after stmoe\.offload"
                                                            r", but its experts are served on "
                                                            r"cpu"):
        offloaded.model(IDS.to("meta"))


def test_close_lets_a_temporary_stores_disk_go_while_the_model_is_still_held():
    """The opened store holds its data file (a repack cannot pull it from under a reader);
    close lets it go, so the temporary store removed then frees its disk at once, not when
    the user's last reference to the model goes (the diff's review)."""
    import contextlib
    import os

    model, _ = tiny_model("qwen3_moe")
    om = offload(model, capacity=3, predictor="ondemand")  # a store packed into a temp folder
    folder = om.engine.state.store.path

    def held() -> list[str]:
        links = []
        for n in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # (listdir's own descriptor, gone)
                links.append(os.readlink(f"/proc/self/fd/{n}"))
        return [link for link in links if link.startswith(str(folder))]

    assert held()  # (the store's descriptor, and the tier's)
    om.close()
    assert held() == [] and not folder.exists()


@pytest.mark.parametrize(("now", "served", "other"), [
    ("cpu", "cpu", False), ("meta", "cpu", True), ("cuda:0", "cuda:0", False),
    ("cuda:1", "cuda:0", True), ("cuda:0", "cpu", True), ("cuda:1", "cuda", False)])
def test_a_move_is_another_device_or_another_index(now, served, other):
    """(No CUDA needed: devices compared as values. The GPU tiers record an index; "cuda"
    alone is the current device, fixed at offload.)"""
    from stmoe.runtime.hf_glue import moved

    assert moved(torch.device(now), torch.device(served)) is other
