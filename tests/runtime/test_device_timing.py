"""The run's device timeline: exact figures, and memory a server's endless run can afford.

A scripted device: every event has its time on the device's clock, and has completed once
that clock has passed it; events are queued at the host's time, so an event queued later
never lies before what has completed (as on a GPU). The figures are checked against the
union and sums over every event at once (what the timeline computed before it folded).
"""

from __future__ import annotations

import random

import pytest

from stmoe.runtime import device_timing
from stmoe.runtime.device_timing import DeviceTimeline
from stmoe.runtime.store.device_ops import CopySpan


class Clock:
    now = 0.0


class Event:
    def __init__(self, clock: Clock, t: float) -> None:
        self.clock, self.t = clock, t

    def query(self) -> bool:
        return self.t <= self.clock.now

    def synchronize(self) -> None:  # the host waits: the device's clock reaches it
        self.clock.now = max(self.clock.now, self.t)

    def wait(self, stream: object = None) -> None:
        raise AssertionError("the timeline never makes a stream wait")


class Ops:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def record(self, stream: object) -> Event:
        return Event(self.clock, self.clock.now)

    def elapsed(self, start: Event, end: Event) -> float:
        assert start.query() and end.query(), "elapsed between events not completed"
        return end.t - start.t


def union(intervals: list[tuple[float, float]]) -> float:
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def scripted_run(timeline: DeviceTimeline, clock: Clock, steps: int, seed: int,
                 held: list[int], late: float = 0.3
                 ) -> tuple[list[tuple[float, float]], int, float]:
    """Copies on three streams (each in order, overlapping across streams, some long) and
    waits, queued as the host's clock moves; a ``late`` share of the copies handed to the
    timeline some steps after their fill announced them (``opening``: a worker still
    queuing its pieces while another folds); the timeline's held events after each step."""
    rng = random.Random(seed)
    free_at = [0.0, 0.0, 0.0]  # each stream's last copy's end
    intervals, nbytes, stall = [], 0, 0.0
    queuing: list[tuple[int, CopySpan, Event]] = []  # (step it is handed over, span, marker)
    for step in range(steps):
        clock.now += rng.uniform(0.0, 6e-4)  # the streams half busy
        stream = rng.randrange(3)
        start = max(clock.now + rng.uniform(0, 1e-4), free_at[stream])
        end = start + (rng.uniform(1e-4, 3e-4) if rng.random() < 0.95 else 5e-3)
        free_at[stream] = end
        size = rng.randrange(1, 7 << 20)
        marker = Event(clock, start)  # recorded on the stream before its copies
        timeline.opening("decode", marker)
        span = CopySpan(Event(clock, start), Event(clock, end), size)
        queuing.append((step + (rng.randrange(1, 6) if rng.random() < late else 0), span,
                        marker))
        for item in [q for q in queuing if q[0] <= step]:
            queuing.remove(item)
            timeline.copy("decode", item[1], item[2])
        intervals.append((start, end))
        nbytes += size
        if rng.random() < 0.3:
            before = clock.now + rng.uniform(0, 5e-5)
            after = before + rng.uniform(0, 2e-4)
            timeline.wait("decode", Event(clock, before), Event(clock, after))
            stall += after - before
        held.append(timeline.held())
    for _, span, marker in queuing:
        timeline.copy("decode", span, marker)
    return intervals, nbytes, stall


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_folding_keeps_the_figures_exact_and_the_events_few(monkeypatch, seed):
    monkeypatch.setattr(device_timing, "FOLD_AT", 64)
    clock = Clock()
    timeline = DeviceTimeline(Ops(clock))
    held: list[int] = []
    intervals, nbytes, stall = scripted_run(timeline, clock, 5000, seed, held)
    # a few times FOLD_AT (a 5 ms copy holds back what overlaps it), not the 6,500 events
    # the run queued
    assert max(held) < 8 * 64, max(held)
    figures = timeline.resolve()["decode"]
    assert figures["copies"] == len(intervals)
    assert figures["copy_bytes"] == nbytes
    assert figures["copy_busy_s"] == union(intervals)  # one sweep, in one order: bit for bit
    assert figures["device_stall_s"] == pytest.approx(stall, rel=1e-12)
    assert timeline.resolve()["prefill"]["copies"] == 0


def test_a_short_run_folds_nothing_before_its_end():
    clock = Clock()
    timeline = DeviceTimeline(Ops(clock))
    held: list[int] = []
    intervals, _, _ = scripted_run(timeline, clock, 300, 5, held)
    assert held[-1] >= len(intervals)  # every event kept until resolve
    assert timeline.resolve()["decode"]["copy_busy_s"] == pytest.approx(union(intervals),
                                                                         rel=1e-12)


def test_a_copy_still_running_holds_back_what_it_overlaps(monkeypatch):
    """A long copy queued first, short ones after it on other streams, all inside it: none
    is folded while it runs (they could not be counted apart from it), and the busy time is
    the long copy's alone."""
    monkeypatch.setattr(device_timing, "FOLD_AT", 4)
    clock = Clock()
    timeline = DeviceTimeline(Ops(clock))
    timeline.copy("decode", CopySpan(Event(clock, 0.0), Event(clock, 1.0), 10))
    for i in range(20):
        clock.now = 0.01 * (i + 1)
        t = clock.now
        timeline.copy("decode", CopySpan(Event(clock, t), Event(clock, t + 0.001), 1))
    assert timeline.held() == 21  # the long one started at 0: nothing after it can fold
    clock.now = 2.0
    figures = timeline.resolve()["decode"]
    assert figures["copy_busy_s"] == pytest.approx(1.0)
    assert figures["copies"] == 21 and figures["copy_bytes"] == 30


def test_a_copy_handed_over_late_is_not_left_out_of_what_folds_before_it(monkeypatch):
    """A worker records its copy's events, and hands the span over only when its pieces are
    queued; another worker's copy that folds meanwhile must not fold what the first overlaps
    (its fill announced itself first: ``opening``)."""
    monkeypatch.setattr(device_timing, "FOLD_AT", 1)
    clock = Clock()
    timeline = DeviceTimeline(Ops(clock))
    marker = Event(clock, 0.0)
    timeline.opening("decode", marker)
    first = CopySpan(Event(clock, 0.0), Event(clock, 1.0), 1)  # queued, not handed over yet
    clock.now = 2.0
    timeline.copy("decode", CopySpan(Event(clock, 0.5), Event(clock, 1.5), 1))  # folds
    timeline.copy("decode", first, marker)
    assert timeline.resolve()["decode"]["copy_busy_s"] == 1.5  # [0, 1.5], not 1 + 1


def test_copies_that_always_overlap_still_fold(monkeypatch):
    """A saturated link with two streams: every copy overlaps the next, so no moment is free
    of copies; the fold still goes on (the sweep carried from fold to fold), in linear time."""
    monkeypatch.setattr(device_timing, "FOLD_AT", 64)
    clock = Clock()
    timeline = DeviceTimeline(Ops(clock))
    intervals = []
    for k in range(20000):
        clock.now = float(k)  # copy k runs [k, k + 2]: the one before ends after it starts
        timeline.copy("decode", CopySpan(Event(clock, k), Event(clock, k + 2.0), 1))
        intervals.append((float(k), k + 2.0))
        assert timeline.held() < 200
    clock.now = 1e9
    figures = timeline.resolve()["decode"]
    assert figures["copy_busy_s"] == union(intervals) == 20001.0
