"""The tier of the host pipeline (``sim/host/pipeline.py``): how concurrent expert reads share it.

A read's *work* is the time it takes alone (``latency + bytes / bandwidth``, the
single-reader figures ``stmoe calibrate`` measures). Two models:

* ``SharedLink`` (the disk): reads in progress share the device by processor
  sharing; alone a read runs at speed 1, with n >= 2 in progress they progress
  together at ``parallel`` times that speed (the measured throughput of
  ``workers + 1`` readers over that of one), each getting 1/n of it. A compute
  thread's miss therefore slows, and is slowed by, the prefetches in flight.
* ``FifoLink`` (the emulated tier): one link; a read starts when the link is free
  and takes its work (``EmulatedLinkTier`` serialises transfers exactly so).

Both answer the same three calls: ``start`` a read, the time of the next
completion (``next_done``), and ``pop`` that completion.
"""

from __future__ import annotations

import math


class SharedLink:
    """Processor sharing among the reads in progress (see the module docstring)."""

    def __init__(self, parallel: float) -> None:
        self.parallel = parallel  # aggregate speed with >= 2 reads, relative to one alone
        self.now = 0.0
        self.left: dict[int, float] = {}  # read id -> work left (s at speed 1)

    def _rate(self) -> float:
        """Progress per second of each read in progress."""
        n = len(self.left)
        return 1.0 if n <= 1 else self.parallel / n

    def _advance(self, t: float) -> None:
        if t > self.now and self.left:
            done = (t - self.now) * self._rate()
            for rid in self.left:
                self.left[rid] -= done
        self.now = max(self.now, t)

    def start(self, rid: int, t: float, work: float) -> None:
        self._advance(t)
        self.left[rid] = work

    def next_done(self) -> float:
        if not self.left:
            return math.inf
        return self.now + min(self.left.values()) / self._rate()

    def pop(self) -> tuple[float, int]:
        """Advance to the next completion: (its time, its read id)."""
        t = self.next_done()
        rid = min(self.left, key=lambda r: (self.left[r], r))
        self._advance(t)
        del self.left[rid]
        return t, rid


class FifoLink:
    """One link, transfers one after the other in the order they start."""

    def __init__(self) -> None:
        self.free = 0.0
        self.done: dict[int, float] = {}  # read id -> when it completes

    def start(self, rid: int, t: float, work: float) -> None:
        self.free = max(self.free, t) + work
        self.done[rid] = self.free

    def next_done(self) -> float:
        return min(self.done.values()) if self.done else math.inf

    def pop(self) -> tuple[float, int]:
        rid = min(self.done, key=lambda r: (self.done[r], r))
        return self.done.pop(rid), rid
