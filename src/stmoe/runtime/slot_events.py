"""The slot protocol of a cache whose copies run asynchronously (a GPU's HBM slots).

Why: a copy into a slot on a copy stream returns before it lands, and the kernels that
read a slot are only queued when the compute thread moves on. Two races follow, and a
host wait for either would stall the accelerator. So each slot carries two events:

- ``ready``: recorded after the copy into the slot (the tier's event); the compute stream
  waits on it before any kernel reads the slot (``before_read``: ``wait_event``, not a
  host wait; a host only on a device whose compute runs on the host, the CPU's stand-in);
- ``free``: recorded on the compute stream once the slot's last reader is launched
  (``after_read``, before the layer unpins the slot, so it is set by the time the slot can
  be evicted); a loader's stream waits on it before it overwrites the slot
  (``before_write``): a write-after-read race cannot happen, whatever the host does. It
  waits on the slot's ``ready`` too where no reader consumed it (a prefetch evicted before
  its use): two loaders' copies into one slot land in the order they were queued.

The events of a slot are written under the engine's lock by the thread that holds the
slot (its loader, or the compute thread while the slot is pinned). A cache whose copies
complete before ``fill`` returns (the CPU tiers) has no ``SlotEvents``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from stmoe.runtime.store.device_ops import CopyEvent


class StreamOps(Protocol):
    """What the protocol asks of the device (``store.device_ops``: CUDA's, the CPU's stand-in)."""

    def record(self, stream: object) -> CopyEvent:
        """An event after everything queued on ``stream`` (None: the compute stream)."""
        ...

    def wait(self, stream: object, event: CopyEvent) -> None:
        """Work queued on ``stream`` from now on runs after ``event`` (None: the compute
        stream)."""
        ...


class SlotEvents:
    """One layer cache's ``ready`` and ``free`` events, slot by slot."""

    def __init__(self, capacity: int, ops: StreamOps,
                 waited: Callable[[CopyEvent, CopyEvent], None] | None = None) -> None:
        self.ops = ops
        self.waited = waited  # told the events around each wait for copies (their timing)
        self.ready: list[CopyEvent | None] = [None] * capacity
        self.free: list[CopyEvent | None] = [None] * capacity

    def before_write(self, slot: int, stream: object) -> None:
        """A loader about to copy into ``slot`` on ``stream``: after the slot's last
        readers, and after the copy into it still in flight, if any (an expert prefetched
        on another stream and evicted before it was read: without the wait, that copy
        could land after this one, and the slot would hold the wrong expert). The copy
        stream waits, the host does not."""
        free, landing = self.free[slot], self.ready[slot]
        if free is not None:
            self.ops.wait(stream, free)
        if landing is not None:
            self.ops.wait(stream, landing)

    def landing(self, slot: int, event: CopyEvent | None) -> None:
        """(lock held) The copy into ``slot`` is queued; ``event`` completes when it lands."""
        self.ready[slot] = event
        self.free[slot] = None  # its last readers' event was waited on before the copy

    def before_read(self, slots: list[int]) -> None:
        """(the compute thread) Kernels about to read ``slots``: the compute stream waits
        for their copies; a slot waited for once stays ordered on that stream."""
        pending = [s for s in slots if self.ready[s] is not None]
        if not pending:
            return
        before = self.ops.record(None) if self.waited is not None else None
        for s in pending:
            ready = self.ready[s]
            assert ready is not None
            self.ops.wait(None, ready)
            self.ready[s] = None
        if before is not None and self.waited is not None:
            self.waited(before, self.ops.record(None))

    def after_read(self, slots: list[int]) -> None:
        """(the compute thread, before it unpins ``slots``) Their readers are launched:
        one event on the compute stream for all of them."""
        if slots:
            event = self.ops.record(None)
            for s in slots:
                self.free[s] = event
