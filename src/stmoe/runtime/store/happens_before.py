"""A happens-before check of the GPU tiers' stream protocol, run on the CPU's stand-in.

Why: the stand-in (``store.stand_in``) makes copies land late, so a slot read before its
copy landed shows as wrong bits. But it computes on the host as each kernel is called, so a
slot rewritten while the kernels that read it are only queued (a GPU's write-after-read
race) cannot show there: by the time a loader's copy runs, the host has long read the slot.
This checks the order itself, as CUDA defines it, whatever the host's timing happened to be.

Each stream (the compute stream included) keeps a vector clock: work queued on a stream
follows what the host has seen complete (an event synchronized, or queried done; a drain)
and what the host did before (its own accesses: a disk read into a bounce buffer),
an event recorded on a stream takes the stream's clock, and a stream's wait joins the
event's. Work reads and writes byte ranges; of any two accesses to one tracked row
(``track``: a cache's slab, row by row) where one writes, one must be ordered before the
other, or the two are a race (``races``). ``store.checked_ops`` reports the work: the
device ops' copies, events and waits, and the torch calls of the compute thread and of
launched work.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import torch

Clock = dict[int, int]  # timeline -> the count of its work a point in time follows
Extent = tuple[int, int]  # [start, end) bytes
Stamp = tuple[int, Clock]  # a piece of work's timeline and clock (``OrderingCheck.queue``)
COMPUTE = 0  # the compute stream's timeline (``None`` in DeviceOps' calls)
HOST = -1  # the host's own accesses (a read from disk into a bounce buffer)
HISTORY = 64  # a row's accesses kept, at most (those not yet ordered before a later one)
RACES_KEPT = 20  # distinct races listed; ``race_count`` counts them all


def _join(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass(frozen=True)
class Access:
    """One read or write of a row: its timeline, its clock, and what did it."""

    timeline: int
    clock: Clock
    write: bool
    what: str

    def before(self, other: Access) -> bool:
        return self.clock[self.timeline] <= other.clock.get(self.timeline, 0)


@dataclass(frozen=True)
class Race:
    """Two accesses to ``row``, one a write, neither ordered before the other."""

    row: str
    first: str
    second: str

    def __str__(self) -> str:
        return f"{self.row}: {self.first} and {self.second} are not ordered"


@dataclass(frozen=True)
class _Slab:
    label: str
    start: int
    row_bytes: int
    rows: int

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.start + self.rows * self.row_bytes

    def rows_in(self, start: int, end: int) -> range:
        first = max(0, (start - self.start) // self.row_bytes)
        last = min(self.rows - 1, (end - 1 - self.start) // self.row_bytes)
        return range(first, last + 1)


def extent(t: torch.Tensor, dim0: int | None = None) -> Extent | None:
    """The bytes ``t`` (or its row ``dim0``) spans, or None when it has none."""
    shape, stride = list(t.shape), list(t.stride())
    start = t.data_ptr()
    if dim0 is not None:
        start += dim0 * stride[0] * t.element_size()
        shape, stride = shape[1:], stride[1:]
    if any(s == 0 for s in shape):
        return None
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return start, start + span * t.element_size()


class OrderingCheck:
    """The clocks, the tracked rows, their accesses and the races found (module docstring).
    Thread-safe: the compute thread, the loaders and the stand-in's copy threads report."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._host: Clock = {}  # what the host has seen complete
        self._clocks: dict[int, Clock] = {COMPUTE: {}}  # each timeline's
        self._timelines: dict[int, tuple[object, int]] = {}  # id(stream) -> (it, timeline)
        self._slabs: list[_Slab] = []
        self._history: dict[tuple[int, int], list[Access]] = {}
        self.races: list[Race] = []
        self.race_count = 0
        self.reads = self.writes = self.compared = 0  # row accesses, and pairs that conflict
        self.by_slab: Counter[str] = Counter()  # accesses of each tracked slab, by label

    # ---- what is checked --------------------------------------------------------------
    def track(self, label: str, slab: torch.Tensor) -> None:
        """Check ``slab``'s rows (dimension 0; contiguous), each named ``label row r``."""
        if not slab.is_contiguous() or slab.dim() < 1 or slab.numel() == 0:
            raise ValueError(f"{label}: a tracked slab must be contiguous and not empty")
        with self._lock:
            self._slabs.append(_Slab(label, slab.data_ptr(),
                                     slab.stride(0) * slab.element_size(), slab.shape[0]))

    def summary(self) -> str:
        races = "; ".join(str(r) for r in self.races[:3])
        return (f"{self.race_count} races ({races})" if self.race_count else "no race") + (
            f"; {self.reads} reads and {self.writes} writes of tracked rows, "
            f"{self.compared} pairs compared")

    # ---- the clocks ---------------------------------------------------------------------
    def _timeline(self, stream: object) -> int:
        if stream is None:
            return COMPUTE
        held = self._timelines.get(id(stream))
        if held is None or held[0] is not stream:
            held = self._timelines[id(stream)] = (stream, len(self._clocks))
            self._clocks[held[1]] = {}
        return held[1]

    def queue(self, stream: object) -> Stamp:
        """Work queued on ``stream`` now: its timeline and its clock."""
        with self._lock:
            timeline = self._timeline(stream)
            clock = self._clocks[timeline]
            _join(clock, self._host)
            clock[timeline] = clock.get(timeline, 0) + 1
            return timeline, dict(clock)

    def mark(self, stream: object) -> Clock:
        """An event recorded on ``stream`` now: after what is queued there."""
        with self._lock:
            timeline = self._timeline(stream)
            _join(self._clocks[timeline], self._host)
            return dict(self._clocks[timeline])

    def host(self) -> Stamp:
        """An access by the host now: after what it has seen complete, and before any work
        queued from here on (``queue`` joins the host's clock)."""
        with self._lock:
            self._host[HOST] = self._host.get(HOST, 0) + 1
            return HOST, dict(self._host)

    def waits(self, stream: object, clock: Clock) -> None:
        with self._lock:
            _join(self._clocks[self._timeline(stream)], clock)

    def seen(self, clock: Clock) -> None:
        """The host saw an event with ``clock`` complete."""
        with self._lock:
            _join(self._host, clock)

    def drained(self) -> None:
        with self._lock:
            for clock in self._clocks.values():
                _join(self._host, clock)

    # ---- the accesses -------------------------------------------------------------------
    def touches(self, where: Extent) -> bool:
        return any(s.overlaps(*where) for s in self._slabs)

    def access(self, stamp: Stamp, where: Extent, write: bool, what: str) -> None:
        """Work ``stamp`` (``queue``'s) reads or writes ``where``: checked against every
        earlier access of the rows there not yet ordered before a later one."""
        timeline, clock = stamp
        start, end = where
        with self._lock:
            for i, slab in enumerate(self._slabs):
                if not slab.overlaps(start, end):
                    continue
                for row in slab.rows_in(start, end):
                    self.by_slab[slab.label] += 1
                    self._record((i, row), Access(timeline, clock, write, what))

    def _record(self, key: tuple[int, int], new: Access) -> None:
        if new.write:
            self.writes += 1
        else:
            self.reads += 1
        history = self._history.setdefault(key, [])
        for old in history:
            if old.write or new.write:
                self.compared += 1
                if not (old.before(new) or new.before(old)):
                    self._race(key, old, new)
        # what a later access must still be checked against: a write covers all before it,
        # a read the reads before it (a write before it may still race with a later read)
        history[:] = [a for a in history if not (a.before(new) and (new.write or not a.write))]
        history.append(new)
        if len(history) > HISTORY:
            del history[0]

    def _race(self, key: tuple[int, int], old: Access, new: Access) -> None:
        self.race_count += 1
        slab = self._slabs[key[0]]
        race = Race(f"{slab.label} row {key[1]}", old.what, new.what)
        if len(self.races) < RACES_KEPT and race not in self.races:
            self.races.append(race)
