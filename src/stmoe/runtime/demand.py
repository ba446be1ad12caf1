"""The compute thread's own loads: every expert a layer call needs made READY in a slot,
waiting for the workers' loads in flight or reading misses itself (the *stall*).

Why apart from ``experts_path``: the wait loop is the one part of a layer call that meets the
workers (their loads in flight, their failures, dead loaders reaped), and is tested on its
own (tests/runtime/test_concurrency.py calls ``ensure`` with a worker stuck).
"""

from __future__ import annotations

import time

from stmoe.runtime.cache import LOADING, READY, LayerCache
from stmoe.runtime.prefetch import Prefetcher
from stmoe.runtime.state import EngineState

Slots = dict[int, int]  # expert -> cache slot


class DemandLoads:
    """A layer call's experts made READY (``ensure``), on the compute thread, with its read
    buffer ``buf``."""

    def __init__(self, state: EngineState, prefetcher: Prefetcher, buf: object) -> None:
        self.state, self.prefetcher, self._buf = state, prefetcher, buf

    def ensure(self, cache: LayerCache, needed: list[int]) -> tuple[Slots, list[int], int, int]:
        """Every needed expert READY in a slot, but those beyond the capacity (a long
        prompt's: listed, not loaded); with the hits, and of them the late ones. Meanwhile
        the workers start no new load (paused since ``_begin``): the disk or link serves
        what is needed now first (readers share its bandwidth), the next layer's loads
        start as soon as this layer computes."""
        slots: Slots = {}
        extra: list[int] = []
        with self.state.cv:
            hits = sum(e in cache.where for e in needed)
            late = sum(e in cache.where and cache.state[cache.where[e]] == LOADING for e in needed)
            self._wait_or_load(cache, list(needed), slots, extra)
        return slots, extra, hits, late

    def _wait_or_load(self, cache: LayerCache, todo: list[int], slots: Slots,
                      extra: list[int]) -> None:
        """(lock held) ``_ensure``'s loop: take READY slots, load misses, wait for loads."""
        state = self.state
        while todo:
            self.prefetcher.raise_error()
            progressed = False
            for e in list(todo):
                s = cache.where.get(e)
                if s is not None:
                    if cache.state[s] == READY:
                        slots[e] = s
                        todo.remove(e)
                        progressed = True
                    continue
                slot, wasted = cache.claim(e, prefetch=False)
                if slot is None:
                    if any(st == LOADING and cache.holder[i] not in cache.pinned
                           for i, st in enumerate(cache.state)):
                        continue  # a worker is filling a slot we could take next
                    extra.append(e)  # beyond the capacity: read by the compute step
                else:
                    state.run.stats.bytes_wasted += wasted * state.expert_bytes
                    if wasted and state.run.admission is not None:
                        state.run.admission.wasted_read(cache.layer)
                    self._load_into(cache, slot, e)
                    slots[e] = slot
                todo.remove(e)
                progressed = True
            if todo and not progressed:  # bounded: failures raised, dead loads freed
                self.prefetcher.wait_for_loads(cache)

    def _load_into(self, cache: LayerCache, slot: int, expert: int) -> None:
        """Load a miss on the compute thread (lock held on entry and exit, not during I/O)."""
        state = self.state
        block = state.store.blocks[(cache.layer, expert)]
        state.cv.release()
        start = time.perf_counter()
        try:
            ready = state.fill(cache, slot, block, self._buf, self.state.demand_stream)
        except BaseException:
            state.cv.acquire()
            cache.abandon(slot)
            raise
        took = time.perf_counter() - start
        state.cv.acquire()
        state.filled(cache, slot, ready)
        state.run.stats.loaded(state.run.phase, "demand", block.nbytes, took)
