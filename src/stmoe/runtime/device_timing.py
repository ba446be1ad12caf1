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
"""

from __future__ import annotations

import threading

from stmoe.runtime.stats import PHASES
from stmoe.runtime.store.device_ops import CopyEvent, CopySpan, DeviceOps


class DeviceTimeline:
    """One run's device events (see the module docstring); ``copy`` and ``wait`` may be
    called from any thread."""

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops
        self.ref = ops.record(None)  # before every event this timeline will hold
        self._lock = threading.Lock()
        self._copies: dict[str, list[CopySpan]] = {p: [] for p in PHASES}
        self._waits: dict[str, list[tuple[CopyEvent, CopyEvent]]] = {p: [] for p in PHASES}

    def copy(self, phase: str, span: CopySpan) -> None:
        with self._lock:
            self._copies[phase].append(span)

    def wait(self, phase: str, before: CopyEvent, after: CopyEvent) -> None:
        with self._lock:
            self._waits[phase].append((before, after))

    def resolve(self) -> dict[str, dict[str, float]]:
        """Per phase: copies, copy_bytes, copy_busy_s, copy_GBps (bytes over busy time) and
        device_stall_s; waits for every event first (the run is over)."""
        with self._lock:
            copies = {p: list(v) for p, v in self._copies.items()}
            waits = {p: list(v) for p, v in self._waits.items()}
        self.ref.synchronize()  # CUDA times only between completed events
        at = self._at
        out = {}
        for phase in PHASES:
            spans = sorted((at(s.start), at(s.end)) for s in copies[phase])
            busy, reach = 0.0, float("-inf")
            for start, end in spans:  # the union of the intervals
                if end > reach:
                    busy += end - max(start, reach)
                    reach = end
            nbytes = sum(s.nbytes for s in copies[phase])
            out[phase] = {"copies": len(spans), "copy_bytes": nbytes, "copy_busy_s": busy,
                          "copy_GBps": nbytes / busy / 1e9 if busy > 0 else 0.0,
                          "device_stall_s": sum(max(0.0, at(b) - at(a))
                                                for a, b in waits[phase])}
        return out

    def _at(self, event: CopyEvent) -> float:
        event.synchronize()
        return self.ops.elapsed(self.ref, event)
