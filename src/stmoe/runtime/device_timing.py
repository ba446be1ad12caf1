"""A run's copies to the device and the compute stream's waits for them, timed by the
device's own events, per phase: what a GPU tier's stall and copy bandwidth are.

Why events: on a GPU tier a load's copy is queued and the compute thread moves on (the slot
is READY once its copy is queued; ``slot_events``), so the host's clocks see neither the
copy nor the wait: the compute *stream* waits for a slot's ready event. So every block's
copies carry an event before and after them (``device_ops.CopySpan``), every wait of the
compute stream for pending copies an event before and after it, and at the run's end
(``resolve``) they become seconds: ``device_stall_s`` (the compute stream's time waiting
for copies), ``copy_busy_s`` (the union of the copies' intervals: the link's busy time)
and the bytes copied, whose ratio is the copy bandwidth the run achieved. Every time is
measured from one reference event recorded before the first of them.

Bounded: a server's run lasts as long as the server, so the events cannot all wait for its
end. Once a phase holds ``FOLD_AT`` of them, those completed are folded into sums and let
go (``_Phase.fold``), exactly: a copy's interval joins the busy time only once every copy
not yet folded starts no earlier than it (the device's clock only moves forward: an event not yet
completed lies after every completed one; a fill announces itself, ``opening``, before its
first copy is queued, so a copy not yet handed to the timeline holds the edge back too).
The union is one sweep over the copies in the order they start, carried from fold to fold:
the figures are those of one pass over every event at the run's end, bit for bit. A short
run (a benchmark's) folds nothing before its end.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field

from stmoe.runtime.stats import PHASES
from stmoe.runtime.store.device_ops import CopyEvent, CopySpan, DeviceOps

FOLD_AT = 4096  # a phase's events kept before the completed ones are folded into sums


@dataclass
class _Phase:
    """One phase's copies and waits: those not folded yet, and the sums of those folded."""

    spans: list[CopySpan] = field(default_factory=list)
    waits: list[tuple[CopyEvent, CopyEvent]] = field(default_factory=list)
    # each fill still queuing its copies: an event recorded on its stream before them
    opening: list[CopyEvent] = field(default_factory=list)
    timed: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, bytes)
    copies: int = 0  # folded
    nbytes: int = 0
    busy: float = 0.0  # the union of the folded copies' intervals
    reach: float = -math.inf  # the latest end folded (the union's sweep goes on from it)
    stall: float = 0.0
    fold_at: int = field(default_factory=lambda: FOLD_AT)  # (read when made: tests lower it)

    def held(self) -> int:
        return len(self.spans) + len(self.waits) + len(self.timed)

    def fold(self, at: _Clock, final: bool) -> None:
        """Fold what has completed (``final``: every event has) into the sums: the union is
        one sweep over the copies in the order they start, taken up to ``edge``."""
        spans: list[CopySpan] = []
        for s in self.spans:  # a span whose end completed: its start did before it
            if final or s.query():
                self.timed.append((at(s.start), at(s.end), s.nbytes))
            else:
                spans.append(s)
        waits: list[tuple[CopyEvent, CopyEvent]] = []
        for before, after in self.waits:
            if final or after.query():
                self.stall += max(0.0, at(after) - at(before))
            else:
                waits.append((before, after))
        self.spans, self.waits = spans, waits
        # no copy not yet timed starts before ``edge``: a running one's start completed, a
        # fill's still queuing starts after its marker, any other after every completed event
        started = [e for e in [s.start for s in spans] + self.opening if e.query()]
        edge = math.inf if final else min((at(e) for e in started), default=math.inf)
        self.timed.sort()
        k = bisect.bisect_left(self.timed, (edge, -math.inf, 0))  # those starting before it
        for start, end, nbytes in self.timed[:k]:
            if end > self.reach:
                self.busy += end - max(start, self.reach)
                self.reach = end
            self.copies += 1
            self.nbytes += nbytes
        del self.timed[:k]
        self.fold_at = max(FOLD_AT, 2 * self.held())  # what stays waits for twice as many

    def figures(self) -> dict[str, float]:
        return {"copies": self.copies, "copy_bytes": self.nbytes, "copy_busy_s": self.busy,
                "copy_GBps": self.nbytes / self.busy / 1e9 if self.busy > 0 else 0.0,
                "device_stall_s": self.stall}


class _Clock:
    """An event's time from the timeline's reference (the event completed)."""

    def __init__(self, ops: DeviceOps, ref: CopyEvent) -> None:
        self.ops, self.ref = ops, ref

    def __call__(self, event: CopyEvent) -> float:
        event.synchronize()  # a no-op where it has completed
        return self.ops.elapsed(self.ref, event)


class DeviceTimeline:
    """One run's device events (see the module docstring); ``copy`` and ``wait`` may be
    called from any thread."""

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops
        self.ref = ops.record(None)  # before every event this timeline will hold
        self._at = _Clock(ops, self.ref)
        self._lock = threading.Lock()
        self._phases = {p: _Phase() for p in PHASES}

    def opening(self, phase: str, marker: CopyEvent) -> None:
        """A fill starts queuing its copies on the stream ``marker`` was just recorded on
        (before them): until ``copy`` (or ``closing``) nothing that may overlap them folds."""
        with self._lock:
            self._phases[phase].opening.append(marker)

    def closing(self, phase: str, marker: CopyEvent) -> None:
        """The fill that ``opening`` announced queued no span (it failed)."""
        with self._lock:
            self._drop(self._phases[phase], marker)

    def copy(self, phase: str, span: CopySpan, marker: CopyEvent | None = None) -> None:
        """A block's copies (``marker``: its fill's, from ``opening``, now closed)."""
        with self._lock:
            self._phases[phase].spans.append(span)
            if marker is not None:
                self._drop(self._phases[phase], marker)
            self._fold_if_full(self._phases[phase])

    def wait(self, phase: str, before: CopyEvent, after: CopyEvent) -> None:
        with self._lock:
            self._phases[phase].waits.append((before, after))
            self._fold_if_full(self._phases[phase])

    def held(self) -> int:
        """Events' spans and waits not folded yet (what the timeline keeps)."""
        with self._lock:
            return sum(p.held() for p in self._phases.values())

    def resolve(self) -> dict[str, dict[str, float]]:
        """Per phase: copies, copy_bytes, copy_busy_s, copy_GBps (bytes over busy time) and
        device_stall_s; waits for every event first (the run is over)."""
        with self._lock:
            self.ref.synchronize()  # CUDA times only between completed events
            for phase in self._phases.values():
                phase.fold(self._at, final=True)
            return {p: self._phases[p].figures() for p in PHASES}

    @staticmethod
    def _drop(phase: _Phase, marker: CopyEvent) -> None:
        phase.opening = [m for m in phase.opening if m is not marker]

    def _fold_if_full(self, phase: _Phase) -> None:
        if phase.held() >= phase.fold_at and self.ref.query():
            phase.fold(self._at, final=False)
