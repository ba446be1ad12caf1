"""The CPU's stand-ins for a GPU's copy engine and page-locking (``device_ops``' protocols).

Why: the races the GPU tiers guard against (a bounce buffer rewritten before the copy out
of it ran; a slot read before the copy into it landed, or rewritten while kernels read it)
only show where copies complete late, after the call that queued them returned. So
``HostThreadOps`` runs each stream's copies on a thread of its own, each late (a fixed
``delay`` plus its bytes over ``bytes_per_s``), reading the source only then; with
``one_engine`` the copies of every stream also take turns on one engine in the order they
were queued. ``NoPinning`` keeps memory ordinary and counts what is held. With them the
tiers, the engine's slot protocol and the whole offload path on a GPU tier run in CPU tests
(``runtime.accelerator.stand_in``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from stmoe.runtime.store.device_ops import CopyEvent


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

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class _HostEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.at = 0.0  # time.perf_counter() when it completed

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def wait(self, stream: object = None) -> None:
        """Called by ``HostThreadOps.wait`` only with None (the host, where the stand-in's
        compute runs, or a copy thread already at its turn in its queue): the caller waits."""
        if stream is not None:
            raise ValueError("a stand-in event is waited on through HostThreadOps.wait")
        self._done.wait()

    def _complete(self) -> None:
        self.at = time.perf_counter()
        self._done.set()


class HostThreadOps:
    """The CPU's stand-in for a copy engine: one thread runs each stream's copies in order,
    each ``delay`` seconds (plus its bytes over ``bytes_per_s``) after it is its turn,
    reading the source only then. ``one_engine``: copies of every stream share one engine,
    served in the order they were queued (a GPU's single copy engine at its worst: a copy
    queued later waits for every one queued before it). ``copies`` counts the copies run."""

    def __init__(self, delay: float = 0.0, bytes_per_s: float | None = None,
                 one_engine: bool = False) -> None:
        self.delay, self.bytes_per_s, self.one_engine = delay, bytes_per_s, one_engine
        self.copies = 0
        self._queues: dict[int, queue.SimpleQueue[Callable[[], None] | None]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._engine = threading.Condition()
        self._tickets, self._serving = 0, 0  # the one engine's order: queued, now served

    def new_stream(self, priority: int = 0) -> object:
        return _Stream(priority)

    def elapsed(self, start: CopyEvent, end: CopyEvent) -> float:
        return end.at - start.at  # type: ignore[attr-defined]

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
                work()
            event._complete()

        self._queue(stream).put(job)
        return event

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> CopyEvent:
        ticket = -1
        if self.one_engine:  # its place in the engine's order, taken as it is queued
            with self._engine:
                ticket, self._tickets = self._tickets, self._tickets + 1
        nbytes = dst.numel() * dst.element_size()
        seconds = self.delay + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

        def copy() -> None:
            if ticket >= 0:
                with self._engine:
                    self._engine.wait_for(lambda: self._serving == ticket)
            try:
                if seconds:
                    time.sleep(seconds)
                dst.copy_(src)
                self.copies += 1
            finally:
                if ticket >= 0:
                    with self._engine:
                        self._serving += 1
                        self._engine.notify_all()

        return self._submit(copy, stream)

    def record(self, stream: object) -> CopyEvent:
        return self._submit(None, stream)

    def launch(self, stream: object, work: Callable[[], None]) -> None:
        """The work runs on the stream's thread, after what is queued there (None: the
        compute's, the host: now)."""
        if stream is None:
            work()
        else:
            self._submit(work, stream)

    def wait(self, stream: object, event: CopyEvent) -> None:
        """None, the compute's "stream", is the host here (the CPU computes as it is
        called): the host waits. A copy stream waits in its queue, as a device would. Either
        way through ``event.wait``, the method torch's ``Stream.wait_event`` calls, so an
        event that lacks it fails here as it would on CUDA."""
        waits = event.wait  # looked up now: one that lacks it fails in the caller, as on CUDA
        if stream is None:
            waits(None)
        else:
            self._submit(lambda: waits(None), stream)

    def drain(self) -> None:
        """Wait for every job queued so far, on every stream's thread."""
        with self._lock:
            queues = list(self._queues.values())
        events = []
        for q in queues:
            event = _HostEvent()
            q.put(event._complete)
            events.append(event)
        for event in events:
            event.synchronize()

    def close(self) -> None:
        """Let the queued copies finish, then stop the threads."""
        with self._lock:
            queues, self._queues = list(self._queues.values()), {}
        for q in queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []


class _Stream:
    """A stand-in stream: a name for one copy thread's queue (kept alive by its holder)."""

    def __init__(self, priority: int) -> None:
        self.priority = priority
