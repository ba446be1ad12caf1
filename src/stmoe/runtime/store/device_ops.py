"""What the tiers that feed a GPU ask of the device: page-locked host memory, copies that
return before they are done, and events that say when they are.

Why an interface: the protocol around those three (a bounce buffer is not written again
before the copy out of it has completed; a slot is not read before the copy into it has)
is where the races are, and it must be tested where CI runs, with no GPU. So the tiers are
written against ``DeviceOps`` and ``HostPinning``; ``CudaOps`` and ``CudaHostPinning`` are
the real ones; ``store.stand_in`` has the CPU's (``HostThreadOps``: copies that run on a
host thread, late, reading their source when they run, as a copy engine does, so a buffer
overwritten too early shows up as wrong bytes at the destination; ``NoPinning``).

Host memory is page-locked with ``cudaHostRegister`` on memory stmoe maps itself, not with
``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every pinned
block up to a power of two (a 12 GiB store would lock 16 GiB) and keeps freed blocks
cached; registering an anonymous mapping locks exactly its pages, and unregistering gives
them back (torch's own checkpoint stager pins this way: ``torch.cuda._pin_memory_utils``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from stmoe.errors import OffloadError

NO_CUDA = ("needs CUDA, and torch sees no GPU here; use --tier disk or --tier emulated")


class CopyEvent(Protocol):
    """A point in a stream's work: ``query`` (done yet?), ``synchronize`` (the host waits
    for it), ``wait`` (``stream``'s later work waits for it: what torch's
    ``Stream.wait_event(e)`` calls, ``e.wait(stream)``; None: the current stream)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def wait(self, stream: object = None) -> None: ...


class DeviceOps(Protocol):
    """Asynchronous copies on a stream (None: the device's current one, where the compute
    runs), the events after them, and streams of their own for the loaders."""

    def new_stream(self, priority: int = 0) -> object:
        """A copy stream (``priority`` -1: a demand's; CUDA's priorities order kernels, not
        copies, so what keeps a demand's copy ahead is the workers' ``CopyWindow``)."""
        ...

    def elapsed(self, start: CopyEvent, end: CopyEvent) -> float:
        """Seconds from ``start`` to ``end`` (both recorded here, both completed)."""
        ...

    def launch(self, stream: object, work: Callable[[], None]) -> None:
        """Queue ``work``'s device work on ``stream`` (after what is queued there)."""
        ...

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

    def drain(self) -> None:
        """The host waits for every copy queued so far, on every stream (before host memory
        a copy may still read is unlocked and unmapped)."""
        ...


class HostPinning(Protocol):
    """Page-locks host memory stmoe mapped itself (``register``), and gives it back."""

    kind: str

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Locked memory allocated by the driver (``host_lock``'s fallback where ``register``
        is refused): uint8, at least ``nbytes``."""
        ...


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
            clear_last_error()
            raise OffloadError(f"page-locking {nbytes / 2**30:.2f} GiB of host memory in place "
                               f"(cudaHostRegister) failed (cudaError {err})")

    def unregister(self, ptr: int) -> None:
        if int(self._rt.cudaHostUnregister(ptr)):  # type: ignore[attr-defined]
            clear_last_error()  # as register's: the next kernel launch must not see it

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def loaded_library(stem: str, maps: Path = Path("/proc/self/maps")) -> ctypes.CDLL | None:
    """The shared library ``stem`` (``libcudart.so``) this process has mapped, opened again
    (the same copy, its state included), or None where none is mapped or ``maps`` is
    unreadable."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and f"/{stem}" in fields[5]:
            return ctypes.CDLL(fields[5].strip())
    return None


def clear_last_error() -> None:
    """Reset the CUDA runtime's last error in this thread. Why: torch's binding returns a
    failed ``cudaHostRegister``'s error and leaves it set, and torch checks every kernel
    launch with ``cudaGetLastError``, so the next launch would raise it as its own (every
    later run in the process failing) after stmoe had reported it and carried on. Nothing
    to do where the runtime is linked into torch statically (not mapped)."""
    lib = loaded_library("libcudart.so")
    if lib is not None:
        lib.cudaGetLastError()


class CudaOps:
    """The real copies: ``copy_(non_blocking=True)`` on the stream, an event recorded after
    (timing enabled: the run's copy timeline reads them, ``runtime.device_timing``)."""

    def __init__(self, device: torch.device | None = None) -> None:
        _cudart()
        # the device its streams belong to: the calling thread's now, not each loading
        # thread's (a new thread's current device is 0, whatever the caller set)
        self.device = device if device is not None else torch.device(
            "cuda", torch.cuda.current_device())

    def new_stream(self, priority: int = 0) -> object:
        return torch.cuda.Stream(device=self.device, priority=priority)

    def elapsed(self, start: CopyEvent, end: CopyEvent) -> float:
        return float(start.elapsed_time(end)) / 1e3  # type: ignore[attr-defined]

    def _stream(self, stream: object) -> object:
        """``stream``, or (None) the compute stream: the current stream of the cache's
        device, not of the calling thread's current device (a server's thread, or a caller
        that left ``torch.cuda.device(1)``, is on device 0)."""
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def launch(self, stream: object, work: Callable[[], None]) -> None:
        with torch.cuda.stream(self._stream(stream)):  # type: ignore[arg-type]
            work()

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> CopyEvent:
        s = self._stream(stream)
        with torch.cuda.stream(s):  # type: ignore[arg-type]
            dst.copy_(src, non_blocking=True)
        return self.record(s)

    def record(self, stream: object) -> CopyEvent:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream(stream))  # type: ignore[arg-type]
        return event

    def wait(self, stream: object, event: CopyEvent) -> None:
        s = self._stream(stream)
        s.wait_event(event)  # type: ignore[attr-defined]  # the device waits, not the host

    def drain(self) -> None:
        torch.cuda.synchronize(self.device)  # every stream of the cache's device


class CopySpan:
    """The copies of one block: ``start`` (an event before them), ``end`` (after them: what
    ``query`` and ``synchronize`` wait for) and their bytes, for the run's copy timeline
    (``runtime.device_timing``)."""

    def __init__(self, start: CopyEvent, end: CopyEvent, nbytes: int) -> None:
        self.start, self.end, self.nbytes = start, end, nbytes

    def query(self) -> bool:
        return self.end.query()

    def synchronize(self) -> None:
        self.end.synchronize()

    def wait(self, stream: object = None) -> None:
        """``stream`` waits for the copies (torch's ``Stream.wait_event`` calls this: a span
        is a slot's ready event on the gpu tiers)."""
        self.end.wait(stream)


# A prefetch's copy (one given ``between``) goes in pieces of CHUNK bytes, at most
# COPY_DEPTH of a worker's pieces queued on the device at once, across its loads (the
# thread's ``CopyWindow``), ``between()`` called before each piece after a load's first:
# while the compute thread stalls the worker queues nothing more, so a demand's copy waits
# behind at most COPY_DEPTH pieces of each worker, never whole experts queued ahead of it
# (what the CPU tiers' 4 MiB chunks do for reads), and the prefetch queue stays on the host,
# where a demand goes first and a stale request is dropped. Two: one piece runs while the
# next is queued, so the pieces' issue costs no bandwidth.
COPY_DEPTH = 2


class CopyWindow:
    """One loading thread's copy pieces queued on the device and not yet seen complete,
    across its loads: without it a worker whose experts are one or two pieces each would
    never wait, and would queue every predicted expert on the copy stream at once."""

    def __init__(self, depth: int = COPY_DEPTH) -> None:
        self.depth = depth
        self.events: deque[CopyEvent] = deque()

    def make_room(self) -> None:
        """Wait (this thread alone, never the device) until fewer than ``depth`` pieces
        are in flight."""
        while self.events and self.events[0].query():
            self.events.popleft()
        while len(self.events) >= self.depth:
            self.events.popleft().synchronize()

    def add(self, event: CopyEvent) -> None:
        self.events.append(event)


_THREAD = threading.local()


def thread_window() -> CopyWindow:
    """The calling thread's ``CopyWindow`` (a prefetch worker's, for its own stream)."""
    window: CopyWindow | None = getattr(_THREAD, "window", None)
    if window is None:
        window = _THREAD.window = CopyWindow()
    return window


def copy_parts(ops: DeviceOps, dsts: list[torch.Tensor], src: torch.Tensor, stream: object,
               between: Callable[[], None] | None = None, chunk: int = 0) -> CopySpan:
    """``src`` (a block's bytes, uint8) into ``dsts`` (uint8 tensors that lie end to end in
    block order: a slot's parameters), each part one asynchronous copy, or with ``between``
    pieces of ``chunk`` bytes in the thread's ``CopyWindow`` (see COPY_DEPTH); the span of
    them all. The sizes are checked before any copy is queued."""
    total = sum(d.numel() for d in dsts)
    if total != src.numel() or not dsts:
        raise ValueError(f"a slot of {total} bytes for a block of {src.numel()}")
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    pos = 0
    for d in dsts:
        n = d.numel()
        step = chunk if between is not None and chunk > 0 else n
        pieces += [(d[a : a + step], src[pos + a : pos + min(a + step, n)])
                   for a in range(0, n, step)]
        pos += n
    window = thread_window() if between is not None else None
    start = ops.record(stream)
    for i, (d, s) in enumerate(pieces):
        if window is None:
            ops.copy_async(d, s, stream)
            continue
        window.make_room()
        if i:
            between()
        window.add(ops.copy_async(d, s, stream))
    return CopySpan(start, ops.record(stream), total)


def unmap(m: mmap.mmap) -> None:
    """Unmap now, or, where a view of it lives on (a fetched block, a traceback's frame),
    when the last one goes."""
    with contextlib.suppress(BufferError):
        m.close()
