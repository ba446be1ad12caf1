"""The slot protocol of a cache whose copies run asynchronously (runtime/slot_events.py), on
the CPU with the copy engine's stand-in (store.stand_in.HostThreadOps: copies that land
late, on another thread, reading their source only then): a slot is read only after its copy
has landed (``ready``), and rewritten only after its readers (``free``). Issue 43, item 1."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.slot_events import SlotEvents  # noqa: E402
from stmoe.runtime.store.pinned import PinnedHostTier  # noqa: E402
from stmoe.runtime.store.stand_in import HostThreadOps, NoPinning  # noqa: E402
from tiny_moe import packed_with_tables, tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11]
NEW = 6


class Gate:
    """An event the test completes (a kernel still reading a slot)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()

    def wait(self, stream: object = None) -> None:
        self.done.wait()


def test_a_copy_into_a_slot_waits_for_its_readers():
    ops = HostThreadOps()
    events = SlotEvents(2, ops)
    readers = Gate()
    events.free[0] = readers  # slot 0's last reader is still running
    stream = object()  # a loader's copy stream
    events.before_write(0, stream)
    dst, src = torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    copy = ops.copy_async(dst, src, stream)
    time.sleep(0.1)  # the stand-in's copies take no time: only the wait can hold it
    assert not copy.query() and int(dst.sum()) == 0
    readers.done.set()
    copy.synchronize()
    assert int(dst.sum()) == 8
    events.landing(0, copy)
    assert events.ready[0] is copy and events.free[0] is None
    ops.close()


def test_a_copy_into_a_slot_waits_for_the_copy_still_landing_there():
    """A prefetch evicted before it was read: its copy (another loader's stream) may not
    have landed. The new copy waits for it, so the two land in the order they were queued
    and the slot holds the new expert (without the wait: the old one, late)."""
    ops = HostThreadOps()
    events = SlotEvents(2, ops)
    dst = torch.zeros(8, dtype=torch.uint8)
    first_lands = Gate()
    ops.wait("prefetch stream", first_lands)  # the old copy is held back on its stream
    old = ops.copy_async(dst, torch.full((8,), 7, dtype=torch.uint8), "prefetch stream")
    events.landing(0, old)
    events.before_write(0, "demand stream")
    new = ops.copy_async(dst, torch.ones(8, dtype=torch.uint8), "demand stream")
    time.sleep(0.1)
    assert not new.query()  # the new copy waits for the one in flight
    first_lands.done.set()
    new.synchronize()
    old.synchronize()
    assert dst.tolist() == [1] * 8
    ops.close()


def test_reads_wait_for_the_copy_and_leave_a_free_event():
    ops = HostThreadOps(delay=0.05)
    events = SlotEvents(2, ops)
    dst, src = torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    events.landing(1, ops.copy_async(dst, src, object()))
    events.before_read([1])  # the compute (here the host) waits for the copy
    assert int(dst.sum()) == 8 and events.ready[1] is None
    events.after_read([1])
    assert events.free[1] is not None
    ops.close()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model, store, tables = packed_with_tables("qwen2_moe", tmp_path_factory.mktemp("qwen"))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return store, tables, want[0, len(PROMPT):]


def _late_copies(store, tables, capacity, predictor, delay=0.004):
    """Tokens of an offloaded generation whose every copy into a slot lands ``delay`` s late."""
    fresh, _ = tiny_model("qwen2_moe")
    with offload(fresh, store, capacity=capacity, predictor=predictor,
                 tables=None if predictor == "ondemand" else tables, workers=2) as om:
        ops = HostThreadOps(delay=delay)
        om.engine.tier = PinnedHostTier(om.engine.store, NoPinning(), ops)
        assert om.engine.state.events is not None  # the tier's copies are asynchronous
        tokens = om.generate(PROMPT, max_new_tokens=NEW).tokens
        copies = ops.copies
        om.engine.check()
        ops.close()
    return tokens, copies


@pytest.mark.parametrize(("capacity", "predictor"), [(2, "ondemand"), (4, "stmoe-plus"),
                                                     (8, "stmoe")])
def test_late_copies_give_the_resident_bits(qwen, capacity, predictor):
    store, tables, want = qwen
    got, copies = _late_copies(store, tables, capacity, predictor)
    assert copies > 0
    assert got == want.tolist()


def test_without_the_ready_wait_the_late_copies_are_read_too_soon(qwen, monkeypatch):
    """The protocol's wait is what the test above checks: removed, the compute reads slots
    whose copies have not landed, and the tokens change."""
    store, tables, want = qwen
    monkeypatch.setattr(SlotEvents, "before_read", lambda self, slots: None)
    got, _ = _late_copies(store, tables, 2, "ondemand", delay=0.02)
    assert got != want.tolist()


def test_a_copy_span_is_waited_on_the_way_torch_waits_on_an_event():
    """On the gpu tiers a slot's ready event is a CopySpan (``copy_parts``), and CUDA's
    ``Stream.wait_event(e)`` is ``e.wait(stream)``: a span must answer it with its last
    event's wait on that stream. (Missing, every gpu-tier run failed at its first read on
    a real GPU, while the stand-in, which called ``synchronize``, went on.)"""
    from stmoe.runtime.store.device_ops import CopySpan

    class Recorded:
        def __init__(self) -> None:
            self.waited: list[object] = []

        def query(self) -> bool:
            return True

        def synchronize(self) -> None: ...

        def wait(self, stream: object = None) -> None:
            self.waited.append(stream)

    start, end = Recorded(), Recorded()
    span = CopySpan(start, end, 64)
    stream = object()
    torch.cuda.Stream.wait_event(stream, span)  # torch's own code, which needs no GPU
    assert end.waited == [stream] and start.waited == []


def test_the_stand_in_waits_through_the_events_own_wait_and_fails_in_the_caller():
    ops = HostThreadOps()

    class NoWait:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None: ...

    with pytest.raises(AttributeError, match="wait"):
        ops.wait(object(), NoWait())  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="wait"):
        ops.wait(None, NoWait())  # type: ignore[arg-type]
    ops.close()


def _gpu_engine(tmp_path, ops):
    """An offloaded tiny model on the gpu tier's stand-in (``ops``), nothing loaded yet."""
    from stmoe.runtime.accelerator import stand_in
    from stmoe.runtime.store import pack

    store = pack(tiny_model("qwen2_moe")[0], tmp_path / "store")
    return stand_in(ops=ops), lambda: offload(tiny_model("qwen2_moe")[0], store, capacity=2,
                                              predictor="ondemand", tier="gpu")


def test_a_load_that_fails_after_queuing_its_copies_leaves_them_to_the_next_write(tmp_path):
    """A fill that raises after its copies were queued (an error in a conversion, say):
    the slot goes back to FREE, and the next loader of it must wait for those copies, or
    they could land after its own. The failure's event is the slot's until then."""
    ops = HostThreadOps(delay=0.3)
    device, offloaded = _gpu_engine(tmp_path, ops)
    with device, offloaded() as om:
        state = om.engine.state
        queued = state.loader.fill

        def fails_after_queuing(*args, **kwargs):
            queued(*args, **kwargs)  # its copies land 0.3 s from now
            raise OSError("a conversion failed")

        state.loader.fill = fails_after_queuing
        cache = state.caches[0]
        with pytest.raises(OSError, match="conversion"):
            state.fill(cache, 0, state.store.blocks[(0, 0)], None, ops.new_stream())
        pending = state.events[0].ready[0]
        assert pending is not None and not pending.query()  # the next write waits on it
        pending.synchronize()


def test_a_slots_conversion_is_not_timed_as_its_copy(tmp_path, monkeypatch):
    """Where a slot holds its kernel's layout (int4 on CUDA), the conversion runs on the
    copy's stream before the slot's ready event; the run's copy timeline takes the copy
    alone, or the achieved bandwidth would count conversion kernels as transfer time."""
    ops = HostThreadOps()
    device, offloaded = _gpu_engine(tmp_path, ops)
    with device, offloaded() as om:
        state = om.engine.state
        cache = state.caches[0]
        monkeypatch.setattr(cache, "layouts", {"stand-in": None})
        monkeypatch.setattr(cache, "convert", lambda slot: time.sleep(0.3))
        spans = []
        monkeypatch.setattr(state.run.timeline, "copy",
                            lambda phase, span, marker=None: spans.append(span))
        ready = state.fill(cache, 0, state.store.blocks[(0, 0)], None, ops.new_stream())
        ready.synchronize()
        (span,) = spans
        assert ops.elapsed(span.start, span.end) < 0.15  # the copy's
        assert ops.elapsed(ready.start, ready.end) >= 0.3  # the ready event's: with it


def test_a_long_runs_timeline_folds_while_the_copies_land(qwen, monkeypatch):
    """A server's run never ends, so its device timeline folds as it goes (FOLD_AT lowered
    here): through the real fill path, every fill's announcement is closed, the timeline
    holds few events while hundreds are queued, and the run's figures count every copy."""
    from stmoe.runtime import device_timing

    monkeypatch.setattr(device_timing, "FOLD_AT", 8)
    store, tables, want = qwen
    held: list[int] = []
    handed = device_timing.DeviceTimeline.copy

    def copy(self, phase, span, marker=None):
        handed(self, phase, span, marker)
        held.append(self.held())

    monkeypatch.setattr(device_timing.DeviceTimeline, "copy", copy)
    fresh, _ = tiny_model("qwen2_moe")
    with offload(fresh, store, capacity=2, predictor="stmoe-plus", tables=tables,
                 workers=2) as om:
        ops = HostThreadOps(delay=0.001)
        om.engine.tier = PinnedHostTier(om.engine.store, NoPinning(), ops)
        r = om.generate(PROMPT, max_new_tokens=4 * NEW)
        phases = om.engine.state.run.timeline._phases.values()
        assert not any(p.opening for p in phases)  # every announcement closed
        ops.close()
    assert r.tokens[:NEW] == want.tolist()
    copies = sum(r.stats["phases"][p]["device"]["copies"] for p in ("prefill", "decode"))
    assert copies == len(held) > 50, (copies, len(held))
    assert max(held) < 40, max(held)  # folded during the run, not kept to its end
