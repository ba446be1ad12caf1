"""The prefetch workers: predicted experts loaded ahead, off the compute thread.

Requests wait in one priority queue, ordered by (forward call, layer, rank): the
layer the compute thread reaches next comes first, and within a layer the
predictor's most confident expert. A worker claims a cache slot, reads the
expert through the engine's tier without holding the lock, and marks the slot
READY. A request whose layer the compute thread has already reached is *stale*
and dropped (the layer loaded its misses itself). While the compute thread
stalls, the workers start no new load (``pause``): what it waits for gets the
whole bandwidth of the tier, which does not grow with readers. A block that does not
read whole and intact (``BlockError``: damaged, short, an I/O error) is a prefetch
skipped: its slot freed, one warning per block, and the layer that needs the expert reads
it itself (again: a passing error is over, a lasting one fails what needs that expert
only). Any other failure of a worker, anywhere in its loop (a bad request, the
bookkeeping), is kept, its slot freed so the cache stays consistent, and the compute
thread woken: it raises the error at once if it is waiting, else at its next layer
(``raise_error``); the worker goes on serving.

No wait is unbounded: the compute thread waits for a slot at most ``WAIT_S`` at a
time, then raises a kept failure, frees slots whose loader thread died (it loads
those experts itself) and refuses a load stuck longer than ``stall_limit_s``
(``reap``); ``drain`` and ``close`` are bounded the same way.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
import weakref

from stmoe.errors import BlockError, OffloadError
from stmoe.runtime.cache import LOADING, LayerCache
from stmoe.runtime.state import EngineState
from stmoe.runtime.store import StoreError
from stmoe.runtime.store.device_ops import thread_window
from stmoe.runtime.store.tiers import aligned_buffer

WAIT_S = 0.5  # the longest a waiter sleeps before checking for failures and dead loaders
STALL_LIMIT_S = 300.0  # a load taking longer is refused: the tier is not answering
CLOSE_WAIT_S = 10.0  # close() waits this long for the workers' loads in flight
log = logging.getLogger("stmoe.runtime")

# (cache, slot, layer, expert) a worker loads, and the run's phase when it started (its read
# is counted there)
Job = tuple[LayerCache, int, int, int, str]


class Prefetcher:
    """``workers`` threads loading queued (call, layer, expert) requests into the caches."""

    def __init__(self, state: EngineState, workers: int, cpus: set[int] | None = None) -> None:
        self.state = state
        # the CPUs the workers run on (None: those of the thread that starts them); a runtime
        # that pins its compute thread to some cores gives the others (the vLLM plugin)
        self.cpus = cpus
        self.queue: list[tuple[int, int, int, int]] = []  # heap of (call, layer, rank, expert)
        self.error: BaseException | None = None  # a worker's failure, for the compute thread
        self.skipped: set[tuple[int, int]] = set()  # (layer, expert) blocks a prefetch skipped
        self.work = threading.Condition(state.lock)  # the workers wait here for requests
        self._closing = False
        self.paused = False  # the compute thread is stalled: no new load may compete with it
        self.stall_limit_s = STALL_LIMIT_S
        self._threads = [threading.Thread(target=self._worker, name=f"stmoe-prefetch-{i}",
                                          daemon=True) for i in range(workers)]

    def start(self, owner: object | None = None) -> None:
        """Start the workers; with ``owner`` (the engine), they stop, the tier closes and the
        caches go when it is collected without a close (an offloaded model dropped unclosed:
        its threads, and the caches they hold, lived on)."""
        for t in self._threads:
            t.start()
        if owner is not None:
            weakref.finalize(owner, _abandoned, self).atexit = False  # (daemons die at exit)

    def request(self, fwd: int, layer: int, experts: list[int], max_loads: int) -> None:
        """(lock held) Queue loads for (call ``fwd``, ``layer``): the first ``max_loads`` of
        ``experts`` (ranked) not in the layer's cache yet."""
        cache = self.state.caches[layer]
        loads = [e for e in experts if e not in cache.where][:max_loads]
        if not self._threads:  # no workers: nothing would take the requests
            loads = []
        for rank, e in enumerate(loads):
            heapq.heappush(self.queue, (fwd, layer, rank, e))
        if self.queue:
            self.work.notify(len(self._threads))

    def pause(self, paused: bool) -> None:
        """(lock held) Hold back new loads while the compute thread stalls; loads in flight
        for other layers wait at their next chunk (``_between``). Every change wakes the
        workers: one waiting at a chunk may now be needed by the layer that stalls. No
        change wakes nobody: a layer whose experts are all cached calls this twice, and
        waking every idle worker for nothing hands the GIL back and forth at every layer.
        (``paused`` returns to False at every layer's end, so the layer a worker's chunk
        waits for never changes while it stays True.)"""
        if paused == self.paused:
            return
        self.paused = paused
        self.work.notify_all()

    def cancel(self) -> None:
        """(lock held) Forget every queued request (loads in flight go on)."""
        self.queue.clear()

    def drain(self) -> None:
        """(lock held) Wait until no thread is loading into a cache (bounded: slots of
        dead loaders are freed, a stuck load is refused; see ``reap``)."""
        state = self.state
        while True:
            for cache in state.caches:
                self.reap(cache)
            if not any(st == LOADING for c in state.caches for st in c.state):
                return
            state.cv.wait(timeout=WAIT_S)

    def wait_for_loads(self, cache: LayerCache) -> None:
        """(lock held) The compute thread waits for a slot of ``cache`` being loaded:
        at most ``WAIT_S``, then a worker's failure is raised and ``cache`` reaped."""
        self.state.cv.wait(timeout=WAIT_S)
        self.raise_error()
        self.reap(cache)

    def reap(self, cache: LayerCache) -> None:
        """(lock held) Free ``cache``'s LOADING slots whose loader thread died (they would
        never become READY); a load older than ``stall_limit_s`` is a StoreError."""
        now = time.monotonic()
        for s, st in enumerate(cache.state):
            if st != LOADING:
                continue
            loader = cache.loader[s]
            if loader is None or not loader.is_alive():
                cache.abandon(s)
            elif now - cache.since[s] > self.stall_limit_s:
                self.queue.clear()
                raise StoreError(f"layer {cache.layer}'s expert {cache.holder[s]} has been "
                                 f"loading for more than {self.stall_limit_s:g} s on thread "
                                 f"{loader.name!r}: the tier is not answering")

    def raise_error(self) -> None:
        """(lock held) Re-raise a worker's failure here, on the compute thread."""
        exc, self.error = self.error, None
        if exc is not None:
            self.queue.clear()
            detail = exc if isinstance(exc, (OffloadError, OSError)) else repr(exc)
            raise StoreError(f"a prefetch worker failed: {detail}") from exc

    def settle(self) -> None:
        """(lock held) The loads asked so far end: the queued ones forgotten, those in
        flight finished, a failure they left dropped (a new run starts, or a step failed and
        the next must not inherit a read that failed during it: the step's own error is
        already its requests')."""
        self.queue.clear()
        self.pause(False)  # (a failure between a stall's start and its end left it paused)
        try:
            self.drain()
        finally:
            self.error = None

    def close(self) -> None:
        """Stop the workers (loads in flight finish first, for at most ``CLOSE_WAIT_S``:
        the threads are daemons, a stuck one cannot keep the process alive)."""
        with self.state.cv:
            self._closing = True
            self.work.notify_all()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for t in self._threads:  # (not the calling one: a collection may run on a worker)
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def _worker(self) -> None:
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # this thread only
        buf = aligned_buffer(self.state.max_block)
        stream = self.state.copy_stream()
        window = thread_window()  # this worker's copies in flight on the device (a gpu tier)
        while not self._closing:
            job = None
            try:
                window.make_room()  # the next request is chosen when the link can take it
                with self.state.cv:
                    job = self._next_job()
                if job is not None:
                    self._load(job, buf, stream)
            except BaseException as exc:  # anything, anywhere: the compute thread raises it
                self._failed(job, exc)

    def _next_job(self) -> Job | None:
        """(lock held) The most urgent request that still matters, its slot claimed; None
        when there is none (yet) or the workers are closing."""
        state = self.state
        if (self.paused or not self.queue) and not self._closing:
            self.work.wait(timeout=WAIT_S)
        if self._closing or self.paused or not self.queue:
            return None
        fwd, layer, _rank, expert = heapq.heappop(self.queue)
        if (fwd, layer) <= state.run.pos:
            state.run.stats.stale_dropped += 1
            return None
        cache = state.caches[layer]
        slot, wasted = cache.claim(expert, prefetch=True)
        if slot is None:
            return None
        state.run.stats.bytes_wasted += wasted * state.expert_bytes
        admission = state.run.admission
        if admission is not None and cache.last_evicted is not None:
            if wasted:
                admission.wasted_read(layer)
            else:  # a cached expert LRU would have kept: a miss of it is prefetch's cost
                admission.evicted(layer, cache.last_evicted)
        return cache, slot, layer, expert, state.run.phase

    def _load(self, job: Job, buf: object, stream: object) -> None:
        """Read the job's expert through the tier (lock not held) and mark its slot READY."""
        state = self.state
        cache, slot, layer, expert, phase = job
        block = state.store.blocks[(layer, expert)]
        start = time.perf_counter()
        ready = state.fill(cache, slot, block, buf, stream, lambda: self._between(layer))
        took = time.perf_counter() - start
        with state.cv:
            state.filled(cache, slot, ready)
            state.run.stats.loaded(phase, "prefetch", block.nbytes, took)
            state.cv.notify_all()

    def _between(self, layer: int) -> None:
        """Between two chunks of a worker's read for ``layer``: while the compute thread
        stalls at another layer, wait (it reads what it needs first; the slot stays
        LOADING). Never for the stalled layer itself: its experts, or the slots it waits
        to claim, are what this read brings."""
        with self.state.cv:
            while (self.paused and not self._closing
                   and self.state.run.pos[1] != layer):
                self.work.wait(timeout=WAIT_S)

    def _failed(self, job: Job | None, exc: BaseException) -> None:
        """Free the job's slot, wake the waiter; keep the failure for the compute thread,
        unless it is the job's own block (a prefetch skipped: see the module docstring)."""
        with self.state.cv:
            if job is not None:  # its slot, unless the load had already landed
                cache, slot = job[0], job[1]
                if cache.loader[slot] is threading.current_thread():
                    cache.abandon(slot)
            say = job is not None and isinstance(exc, BlockError) and \
                (exc.layer, exc.expert) == (job[2], job[3])
            if say:
                self.state.run.stats.prefetch_failed += 1
                say = (exc.layer, exc.expert) not in self.skipped and not self._closing
                self.skipped.add((exc.layer, exc.expert))
            elif self.error is None:
                self.error = exc
            self.state.cv.notify_all()
        if say:  # (outside the lock: a slow log handler holds up no one)
            log.warning("%s; a prefetch skipped it, a layer that needs it reads it again", exc)


def _abandoned(prefetcher: Prefetcher) -> None:
    """An engine collected unclosed: its workers stop at their next wake (within ``WAIT_S``)
    and, with them, the last references to the tier and the caches go. Only a flag is set:
    this runs inside a garbage collection, on whatever thread it fell on (one of these
    workers, holding the engine's lock, perhaps), so it takes no lock and waits for
    nothing (a join there held up another engine's loads)."""
    prefetcher._closing = True
