"""Disk -> GPU: the disk tier's reads through a few pinned bounce buffers, so the experts
need not fit in host memory (a model bigger than RAM on a GPU; an in-place store too).

Why bounce buffers: a copy to the device runs asynchronously, on the copy engine, only
from page-locked memory, and locking the whole store is what a model bigger than RAM
cannot afford. So a block is read (O_DIRECT, size and CRC-32C checked: the disk tier's or
the in-place tier's own ``fetch``) into a free buffer of a small locked pool, its copy
into the slot is queued on the caller's stream, and the buffer goes back to the pool with
that copy's event. Whoever takes the buffer next waits for that event before reading into
it: a buffer is never overwritten while a copy out of it may still be running. Buffers
are handed out oldest-returned first, so with more buffers than copies in flight the wait
is rare (``BouncePool.waited`` counts the times it was not).

A buffer holds one whole block (``tiers.buffer_bytes``: for an in-place store, one chunk
more, where its aligned spans land), so one block's read and its copy do not overlap; with
several readers, several blocks are in flight at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import torch

from stmoe.runtime.store.device_ops import (
    CopyEvent,
    CudaHostPinning,
    CudaOps,
    DeviceOps,
    HostPinning,
    copy_parts,
)
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.host_lock import LockedHost
from stmoe.runtime.store.in_place import InPlaceTier
from stmoe.runtime.store.index import Block
from stmoe.runtime.store.tiers import Between, DiskTier, ReadBuffer, buffer_bytes

# Buffers in the pool: a reader per prefetch worker plus the compute thread's, each with
# its block's copy in flight while the next read starts.
DEFAULT_BUFFERS = 4


def bounce_buffers(workers: int) -> int:
    """The pool's buffers for ``workers`` prefetch threads: at least one more than them. A
    worker keeps its buffer while it pauses for the compute thread's stall
    (``between``), so with as many workers as buffers the compute thread's demand read
    would wait for a buffer that no paused worker gives back: a deadlock."""
    return max(DEFAULT_BUFFERS, workers + 1)


def bounce_bytes(store: ExpertStore) -> int:
    """One bounce buffer's size for ``store``: its largest block's read buffer, in pages."""
    size = max((buffer_bytes(b) for b in store.blocks.values()), default=4096)
    return -(-size // 4096) * 4096


class Bounce:
    """One page-locked buffer (``buf``, what a reader fills; ``tensor``, the same bytes);
    ``pending``: the event of the last copy out of it."""

    def __init__(self, nbytes: int, pinning: HostPinning) -> None:
        self.locked = LockedHost(nbytes, pinning)
        self.tensor, self.buf = self.locked.tensor, self.locked.view()
        self.pending: CopyEvent | None = None

    def close(self) -> None:
        with suppress(BufferError):  # a fetched block's view outlives it: unmapped later
            self.buf.release()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.locked.close()


class BouncePool:
    """``count`` locked buffers of ``nbytes``; ``acquire`` hands one out only once the copy
    out of it has completed, ``release`` takes it back with its new copy's event."""

    def __init__(self, count: int, nbytes: int, pinning: HostPinning) -> None:
        if count < 1:
            raise ValueError(f"a bounce pool needs at least one buffer, got {count}")
        self.pinning, self.nbytes = pinning, nbytes
        self.buffers: list[Bounce] = []
        try:
            for _ in range(count):
                self.buffers.append(Bounce(nbytes, pinning))
        except BaseException:
            self.close()
            raise
        self._free = deque(self.buffers)
        self._cv = threading.Condition()
        self.waited = 0  # acquisitions that found the last copy out still running

    def acquire(self) -> Bounce:
        with self._cv:
            while not self._free:
                self._cv.wait()
            bounce = self._free.popleft()
        self._drain(bounce)
        return bounce

    def _drain(self, bounce: Bounce) -> None:
        """Wait (this thread alone) until the last copy out of ``bounce`` has completed."""
        event, bounce.pending = bounce.pending, None
        if event is not None and not event.query():
            with self._cv:
                self.waited += 1
            event.synchronize()

    def release(self, bounce: Bounce, pending: CopyEvent | None) -> None:
        bounce.pending = pending
        with self._cv:
            self._free.append(bounce)
            self._cv.notify()

    def close(self) -> None:
        """Wait for every copy out of the buffers, then unlock and unmap them."""
        for bounce in self.buffers:
            self._drain(bounce)
            bounce.close()
        self.buffers = []


class DiskToDeviceTier:
    """The disk tier (packed store, or in place) feeding a device cache through a
    ``BouncePool``. ``fetch`` reads into the caller's own buffer (a gathered copy);
    ``load`` brings a block into a slot on the device, ``staged`` lends a read block to a
    caller that queues its own copy. ``ops``, ``pinning``: CUDA's unless given."""

    name = "gpu-disk"
    emulated = False
    reads_in_place = False
    to_device = True

    def __init__(self, reader: DiskTier | InPlaceTier, ops: DeviceOps | None = None,
                 pinning: HostPinning | None = None, buffers: int = DEFAULT_BUFFERS) -> None:
        self.reader, self.store, self.direct = reader, reader.store, reader.direct
        self.chunk_bytes = reader.chunk_bytes
        pinning = pinning or CudaHostPinning()
        self.ops = ops or CudaOps()
        self.pool = BouncePool(buffers, bounce_bytes(self.store), pinning)

    def fetch(self, block: Block, buf: ReadBuffer, between: Between = None) -> torch.Tensor:
        return self.reader.fetch(block, buf, between)

    def load(self, block: Block, dsts: list[torch.Tensor], stream: object,
             between: Between = None) -> CopyEvent:
        """Read ``block`` into a bounce buffer and queue its copy into ``dsts`` (a slot's
        parameters as uint8, block order) on ``stream``; the event completes when the slot
        holds it (and the buffer is free again)."""
        with self.staged(block, stream, between, dsts) as (_, event):
            assert event is not None
            return event

    @contextmanager
    def staged(self, block: Block, stream: object, between: Between = None,
               dsts: list[torch.Tensor] | None = None
               ) -> Iterator[tuple[torch.Tensor, CopyEvent | None]]:
        """``block`` read and checked into a bounce buffer: (its bytes, the copy's event).
        With ``dsts`` the copy is queued here; without, the caller queues its own on
        ``stream`` inside the block (a cache's ``write``). Either way an event recorded on
        ``stream`` after it guards the buffer: copies out of it on another stream race."""
        bounce = self.pool.acquire()
        queued = False
        try:
            src = self.reader.fetch(block, bounce.buf, between)
            self.store.check_size(block, src.numel())
            queued = True  # from here a copy out of the buffer may be in flight
            event = (copy_parts(self.ops, dsts, src, stream, between, self.chunk_bytes)
                     if dsts is not None else None)
            yield src, event
        finally:
            pending = None
            try:
                if queued:  # after every copy queued on the stream, the caller's too
                    pending = self.ops.record(stream)
            finally:
                self.pool.release(bounce, pending)

    def read_page(self, block: Block, buf: ReadBuffer) -> None:
        self.reader.read_page(block, buf)

    def read_into(self, block: Block, parts: list[object], between: Between = None,
                  buf: object = None) -> bool:
        """Never reads in place (``reads_in_place`` is False)."""
        return False

    def close(self) -> None:
        self.pool.close()
        self.reader.close()
