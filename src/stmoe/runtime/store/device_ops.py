"""What the tiers that feed a GPU ask of the device: page-locked host memory, copies that
return before they are done, and events that say when they are.

Why an interface: the protocol around those three (a bounce buffer is not written again
before the copy out of it has completed; a slot is not read before the copy into it has)
is where the races are, and it must be tested where CI runs, with no GPU. So the tiers are
written against ``DeviceOps`` and ``HostPinning``; ``CudaOps`` and ``CudaHostPinning`` are
the real ones, ``HostThreadOps`` and ``NoPinning`` the CPU's stand-ins: its copies run on
a host thread, late (``delay``), reading their source when they run, as a copy engine does,
so a buffer overwritten too early shows up as wrong bytes at the destination.

Host memory is page-locked with ``cudaHostRegister`` on memory stmoe maps itself, not with
``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every pinned
block up to a power of two (a 12 GiB store would lock 16 GiB) and keeps freed blocks
cached; registering an anonymous mapping locks exactly its pages, and unregistering gives
them back (torch's own checkpoint stager pins this way: ``torch.cuda._pin_memory_utils``).
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from stmoe.errors import OffloadError

NO_CUDA = ("needs CUDA, and torch sees no GPU here; use --tier disk or --tier emulated")


class CopyEvent(Protocol):
    """A point in a stream's work: ``query`` (done yet?), ``synchronize`` (wait for it)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceOps(Protocol):
    """Asynchronous copies on a stream (None: the device's current one)."""

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> CopyEvent:
        """Queue ``dst.copy_(src)`` on ``stream``; the event completes after it."""
        ...

    def record(self, stream: object) -> CopyEvent:
        """An event after everything queued on ``stream`` so far."""
        ...

    def wait(self, stream: object, event: CopyEvent) -> None:
        """Work queued on ``stream`` from now on runs after ``event`` (None: the current
        stream, where the compute runs)."""
        ...


class HostPinning(Protocol):
    """Page-locks host memory stmoe mapped itself (``register``), and gives it back."""

    kind: str

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


def _cudart() -> object:
    if not torch.cuda.is_available():
        raise OffloadError(f"--tier gpu {NO_CUDA}")
    return torch.cuda.cudart()


class CudaHostPinning:
    """``cudaHostRegister`` (portable) on a mapping; refused in one line without CUDA."""

    kind = "cuda"

    def __init__(self) -> None:
        self._rt = _cudart()

    def register(self, ptr: int, nbytes: int) -> None:
        err = int(self._rt.cudaHostRegister(ptr, nbytes, 1))  # type: ignore[attr-defined]
        if err:
            raise OffloadError(f"page-locking {nbytes / 2**30:.2f} GiB of host memory for the "
                               f"GPU failed (cudaError {err}); a smaller store, or --tier disk")

    def unregister(self, ptr: int) -> None:
        self._rt.cudaHostUnregister(ptr)  # type: ignore[attr-defined]


class NoPinning:
    """The CPU's stand-in: the memory stays ordinary (what CPU tests exercise: the fill, the
    checks, the sharing); ``registered`` counts what is held, for the tests."""

    kind = "none"

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]


class CudaOps:
    """The real copies: ``copy_(non_blocking=True)`` on the stream, an event recorded after."""

    def __init__(self) -> None:
        _cudart()

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> CopyEvent:
        s = stream if stream is not None else torch.cuda.current_stream()
        with torch.cuda.stream(s):  # type: ignore[arg-type]
            dst.copy_(src, non_blocking=True)
        return self.record(s)

    def record(self, stream: object) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(stream)  # type: ignore[arg-type]  # (None: the current stream)
        return event

    def wait(self, stream: object, event: CopyEvent) -> None:
        s = stream if stream is not None else torch.cuda.current_stream()
        s.wait_event(event)  # type: ignore[attr-defined]  # the device waits, not the host


class _HostEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class HostThreadOps:
    """The CPU's stand-in for a copy engine: one thread runs each stream's copies in order,
    each ``delay`` seconds after it is its turn, reading the source only then. ``copies``
    counts the copies run."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.copies = 0
        self._queues: dict[int, queue.SimpleQueue[Callable[[], None] | None]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _queue(self, stream: object) -> queue.SimpleQueue[Callable[[], None] | None]:
        with self._lock:
            q = self._queues.get(id(stream))
            if q is None:
                q = self._queues[id(stream)] = queue.SimpleQueue()
                t = threading.Thread(target=self._run, args=(q,), daemon=True,
                                     name="stmoe-copy-standin")
                t.start()
                self._threads.append(t)
            return q

    def _run(self, q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (job := q.get()) is not None:
            job()

    def _submit(self, work: Callable[[], None] | None, stream: object) -> CopyEvent:
        event = _HostEvent()

        def job() -> None:
            if work is not None:
                if self.delay:
                    time.sleep(self.delay)
                work()
            event._done.set()

        self._queue(stream).put(job)
        return event

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> CopyEvent:
        def copy() -> None:
            dst.copy_(src)
            self.copies += 1

        return self._submit(copy, stream)

    def record(self, stream: object) -> CopyEvent:
        return self._submit(None, stream)

    def wait(self, stream: object, event: CopyEvent) -> None:
        """None, the compute's "stream", is the host here (the CPU computes as it is
        called): the host waits. A copy stream waits in its queue, as a device would."""
        if stream is None:
            event.synchronize()
        else:
            self._submit(event.synchronize, stream)

    def close(self) -> None:
        """Let the queued copies finish, then stop the threads."""
        with self._lock:
            queues, self._queues = list(self._queues.values()), {}
        for q in queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []


class AllOf:
    """One event for several (copies of one block, perhaps on one stream, perhaps not)."""

    def __init__(self, events: list[CopyEvent]) -> None:
        self.events = events

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


def copy_parts(ops: DeviceOps, dsts: list[torch.Tensor], src: torch.Tensor,
               stream: object) -> CopyEvent:
    """``src`` (a block's bytes, uint8) into ``dsts`` (uint8 tensors that lie end to end in
    block order: a slot's parameters), each part one asynchronous copy; one event for all.
    The sizes are checked before any copy is queued."""
    total = sum(d.numel() for d in dsts)
    if total != src.numel() or not dsts:
        raise ValueError(f"a slot of {total} bytes for a block of {src.numel()}")
    events: list[CopyEvent] = []
    pos = 0
    for d in dsts:
        n = d.numel()
        events.append(ops.copy_async(d, src[pos : pos + n], stream))
        pos += n
    return events[0] if len(events) == 1 else AllOf(events)


def unmap(m: mmap.mmap) -> None:
    """Unmap now, or, where a view of it lives on (a fetched block, a traceback's frame),
    when the last one goes."""
    with contextlib.suppress(BufferError):
        m.close()
