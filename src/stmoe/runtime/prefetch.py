"""The prefetch workers: predicted experts loaded ahead, off the compute thread.

Requests wait in one priority queue, ordered by (forward call, layer, rank): the
layer the compute thread reaches next comes first, and within a layer the
predictor's most confident expert. A worker claims a cache slot, reads the
expert through the engine's tier without holding the lock, and marks the slot
READY. A request whose layer the compute thread has already reached is *stale*
and dropped (the layer loaded its misses itself). A worker's I/O error is kept
and raised on the compute thread at its next layer (``raise_error``), with the
slot freed so the cache stays consistent.
"""

from __future__ import annotations

import heapq
import threading

import torch

from stmoe.runtime.cache import LOADING
from stmoe.runtime.state import EngineState
from stmoe.runtime.store import StoreError
from stmoe.runtime.tiers import aligned_buffer


class Prefetcher:
    """``workers`` threads loading queued (call, layer, expert) requests into the caches."""

    def __init__(self, state: EngineState, workers: int) -> None:
        self.state = state
        self.queue: list[tuple[int, int, int, int]] = []  # heap of (call, layer, rank, expert)
        self.error: BaseException | None = None  # a worker's failure, for the compute thread
        self.work = threading.Condition(state.lock)  # the workers wait here for requests
        self._closing = False
        self._threads = [threading.Thread(target=self._worker, name=f"stmoe-prefetch-{i}",
                                          daemon=True) for i in range(workers)]  # fmt: skip

    def start(self) -> None:
        for t in self._threads:
            t.start()

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

    def cancel(self) -> None:
        """(lock held) Forget every queued request (loads in flight go on)."""
        self.queue.clear()

    def drain(self) -> None:
        """(lock held) Wait until no worker is loading (workers that died cannot hold a
        slot: their failures free it)."""
        state = self.state
        while any(st == LOADING for c in state.caches for st in c.state):
            if not any(t.is_alive() for t in self._threads):
                break
            state.cv.wait(timeout=0.5)

    def raise_error(self) -> None:
        """(lock held) Re-raise a worker's failure here, on the compute thread."""
        exc, self.error = self.error, None
        if exc is not None:
            self.queue.clear()
            raise StoreError(f"a prefetch worker failed: {exc}") from exc

    def discard_error(self) -> None:
        """(lock held) A new run starts: a failure of the previous one is not raised."""
        self.error = None

    def close(self) -> None:
        """Stop the workers (a load in flight finishes first)."""
        with self.state.cv:
            self._closing = True
            self.work.notify_all()
        for t in self._threads:
            t.join()

    def _worker(self) -> None:
        state = self.state
        buf = aligned_buffer(state.max_block)
        stream = torch.cuda.Stream() if state.device.type == "cuda" else None
        while True:
            with state.cv:
                while not self.queue and not self._closing:
                    self.work.wait()
                if self._closing:
                    return
                fwd, layer, _rank, expert = heapq.heappop(self.queue)
                if (fwd, layer) <= state.run.pos:
                    state.run.stats.stale_dropped += 1
                    continue
                cache = state.caches[layer]
                slot, wasted = cache.claim(expert, prefetch=True)
                if slot is None:
                    continue
                state.run.stats.bytes_wasted += wasted * state.expert_bytes
            block = state.store.blocks[(layer, expert)]
            try:
                cache.write(slot, state.fetch(block, buf), stream)
            except BaseException as exc:  # raised on the compute thread at its next layer
                with state.cv:
                    cache.abandon(slot)
                    if self.error is None:
                        self.error = exc
                    state.cv.notify_all()
                continue
            with state.cv:
                cache.filled(slot)
                state.run.stats.bytes_moved += block.nbytes
                state.run.stats.prefetch_loads += 1
                state.cv.notify_all()
