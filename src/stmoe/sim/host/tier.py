"""The reads in progress on the host pipeline's tier (``pipeline.py``), demand first.

A read is whole (the compute thread's) or, a prefetch worker's, in ``chunks``
pieces: between two, a read for another layer than the one the compute thread
stalls at is parked until the stall ends (``Prefetcher._between``), so a miss
waits at most one piece behind it. A read into a spare row keeps its thread busy
with page faults after the device is done (``first_touch_s``). How reads share
the device is ``link``'s.
"""

from __future__ import annotations

import heapq
import math

from stmoe.sim.host.inputs import HostCosts
from stmoe.sim.host.link import FifoLink, SharedLink

Landed = tuple[float, int, int, bool, float]  # (when, layer, expert, by a worker, its seconds)


class Tier:
    """Reads started, their pieces, parks and page faults, in time order."""

    def __init__(self, costs: HostCosts) -> None:
        self.c = costs
        self.link = FifoLink() if costs.fifo else SharedLink(costs.parallel)
        # reads in progress: id -> (layer, expert, by a worker, page faults after the device)
        self.reads: dict[int, tuple[int, int, bool, float]] = {}
        self.chunks_left: dict[int, int] = {}  # a worker's read: pieces still to start
        self.parked: list[int] = []  # worker reads waiting between two pieces
        self.began: dict[int, float] = {}  # when each read started (its seconds, as timed)
        self.landing: list[tuple[float, int]] = []  # (when, id): device done, faults left
        self.started = 0
        self.chunk_s = costs.chunk_s or costs.read_s / max(1, costs.chunks)

    def start(self, layer: int, e: int, worker: bool, t: float, spare: bool) -> int:
        """Start a read at ``t``; its id. ``spare``: into fresh memory (page faults)."""
        rid = self.started
        self.started += 1
        self.reads[rid] = (layer, e, worker, self.c.first_touch_s if spare else 0.0)
        self.began[rid] = t
        if worker and self.c.chunks > 1:
            self.chunks_left[rid] = self.c.chunks - 1
            self.link.start(rid, t, self.chunk_s)
        else:
            self.link.start(rid, t, self.c.read_s)
        return rid

    def next_event(self) -> float:
        return min(self.link.next_done(), self.landing[0][0] if self.landing else math.inf)

    def land(self, until: float, stalled: int | None) -> Landed | None:
        """The next read landing by ``until`` (pieces started or parked on the way; the
        compute thread stalls at layer ``stalled``, None: it does not), or None."""
        while self.next_event() <= until:
            if self.landing and self.landing[0][0] <= self.link.next_done():
                t, rid = heapq.heappop(self.landing)
            else:
                t, rid = self.link.pop()
                if self._piece_done(rid, t, stalled):
                    continue
                if self.reads[rid][3] > 0:  # its page faults still to come
                    heapq.heappush(self.landing, (t + self.reads[rid][3], rid))
                    continue
            layer, e, worker, _ = self.reads.pop(rid)
            return t, layer, e, worker, t - self.began.pop(rid)
        return None

    def _piece_done(self, rid: int, t: float, stalled: int | None) -> bool:
        """A piece of ``rid`` is done at ``t``: the next starts, or the read parks while the
        compute thread stalls at another layer (True); False: the read is whole."""
        left = self.chunks_left.get(rid, 0)
        if left <= 0:
            self.chunks_left.pop(rid, None)
            return False
        if stalled is not None and stalled != self.reads[rid][0]:
            self.parked.append(rid)
        else:
            self.chunks_left[rid] = left - 1
            self.link.start(rid, t, self.chunk_s)
        return True

    def resume(self, t: float) -> None:
        """The stall ended at ``t``: parked reads start their next piece."""
        parked, self.parked = self.parked, []
        for rid in parked:
            self.chunks_left[rid] -= 1
            self.link.start(rid, t, self.chunk_s)
