"""What the runtime measures, per phase (prefill / decode) and per MoE layer.

Vocabulary as in docs/method.md: for every (forward call, layer), A is the set of
experts the router picked (over the whole batch) and P the prefetch set issued
for it; a *hit* is an expert of A already in the cache or on its way when the
layer asks, a *miss* one the compute thread had to load itself.

* hit rate = hits / |A|; prefetch recall = |P & A| / |A|; precision = |P & A| / |P|
* bytes moved: every byte read from the slow tier (prefetches and misses)
* bytes wasted: bytes of prefetched experts evicted (or left at the end) unused
* stall: time the compute thread waited for expert weights
* reads: the tier's reads of whole experts into the cache and how long they took,
  counted in the phase they started in, the compute thread's (its misses; the
  workers start no new load meanwhile, though one in flight goes on, and with
  no prefetch at all it reads alone) apart from the workers' (prefetches, often
  two at once): the tier's speed as the run met it (a virtual disk's drifts over
  minutes), which the simulator's check takes
  (``benchmarks/bench_sim_check.py --tier-from-runs``)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PHASES = ("prefill", "decode")
_COLUMNS = ("needed", "hits", "late", "predicted", "predicted_used", "calls")


@dataclass
class PhaseCounters:
    """Counters of one phase, one entry per MoE layer."""

    num_layers: int
    needed: np.ndarray = field(init=False)  # sum |A|
    hits: np.ndarray = field(init=False)
    late: np.ndarray = field(init=False)  # hits still loading when asked (waited on)
    predicted: np.ndarray = field(init=False)  # sum |P|
    predicted_used: np.ndarray = field(init=False)  # sum |P & A|
    stall_s: np.ndarray = field(init=False)
    calls: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._rows = [[0] * len(_COLUMNS) for _ in range(self.num_layers)]
        self._stall = [0.0] * self.num_layers
        # reads finished in this phase: {"demand" | "prefetch": [count, seconds]}
        self.reads = {"demand": [0, 0.0], "prefetch": [0, 0.0]}
        # a device cache's: its copies and the compute stream's waits, as the device timed
        # them (``device_timing``: copies, copy_bytes, copy_busy_s, copy_GBps,
        # device_stall_s); None elsewhere
        self.device: dict[str, float] | None = None
        self.sync()

    def add_read(self, kind: str, seconds: float) -> None:
        """(lock held) One expert read by the compute thread (``demand``) or a worker."""
        entry = self.reads[kind]
        entry[0] += 1
        entry[1] += seconds

    def add(self, layer: int, stall_s: float, needed: int, hits: int, late: int,
            predicted: int, predicted_used: int) -> None:
        """One layer call (kept as Python numbers: this runs on the compute thread)."""
        row = self._rows[layer]
        row[0] += needed
        row[1] += hits
        row[2] += late
        row[3] += predicted
        row[4] += predicted_used
        row[5] += 1
        self._stall[layer] += stall_s

    def sync(self) -> None:
        for name, col in zip(_COLUMNS, zip(*self._rows, strict=True), strict=True):
            setattr(self, name, np.asarray(col, dtype=np.int64))
        self.stall_s = np.asarray(self._stall, dtype=np.float64)

    def summary(self, per_layer: bool = False) -> dict[str, Any]:
        self.sync()
        out = _ratios(self.needed.sum(), self.hits.sum(), self.predicted.sum(),
                      self.predicted_used.sum())
        out.update(late_hits=int(self.late.sum()), stall_s=float(self.stall_s.sum()),
                   layer_calls=int(self.calls.sum()))
        for kind, (count, seconds) in self.reads.items():
            out[f"{kind}_reads"], out[f"{kind}_read_s"] = count, seconds
        if self.device is not None:
            out["device"] = dict(self.device)
        if per_layer:
            out["per_layer"] = [
                {"layer": layer, **_ratios(self.needed[layer], self.hits[layer],
                                            self.predicted[layer], self.predicted_used[layer]),
                 "stall_s": float(self.stall_s[layer])}
                for layer in range(self.num_layers)
            ]
        return out


def _ratios(needed: int, hits: int, predicted: int, used: int) -> dict[str, Any]:
    return {
        "needed": int(needed),
        "hits": int(hits),
        "misses": int(needed - hits),
        "hit_rate": float(hits / needed) if needed else 0.0,
        "prefetched": int(predicted),
        "prefetch_recall": float(used / needed) if needed else 0.0,
        "prefetch_precision": float(used / predicted) if predicted else 0.0,
    }


@dataclass
class RuntimeStats:
    """Everything one offloaded run measured; reset with ``OffloadEngine.reset``."""

    num_layers: int
    expert_bytes: int
    phases: dict[str, PhaseCounters] = field(init=False)
    bytes_moved: int = 0
    bytes_wasted: int = 0
    prefetch_loads: int = 0
    demand_loads: int = 0
    stale_dropped: int = 0  # prefetch requests dropped because their layer had passed
    prefetch_failed: int = 0  # prefetches skipped: their block did not read intact
    overflow_loads: int = 0  # experts a call needed beyond the capacity (read into spare rows)
    admission: dict[str, Any] | None = None  # what prefetch admission did (stmoe.admission)

    def __post_init__(self) -> None:
        self.phases = {p: PhaseCounters(self.num_layers) for p in PHASES}

    def loaded(self, phase: str, kind: str, nbytes: int, seconds: float,
               overflow: bool = False) -> None:
        """(lock held) One expert read from the tier, by the compute thread (``demand``;
        ``overflow``: beyond the cache's capacity) or a worker (``prefetch``): the bytes
        moved, the load counted, its time in ``phase``."""
        self.bytes_moved += nbytes
        if kind == "demand":
            self.demand_loads += 1
        else:
            self.prefetch_loads += 1
        self.overflow_loads += overflow
        self.phases[phase].add_read(kind, seconds)

    def to_dict(self, per_layer: bool = True) -> dict[str, Any]:
        return {
            "bytes_moved": self.bytes_moved,
            "bytes_wasted": self.bytes_wasted,
            "prefetch_loads": self.prefetch_loads,
            "demand_loads": self.demand_loads,
            "stale_dropped": self.stale_dropped,
            "prefetch_failed": self.prefetch_failed,
            "overflow_loads": self.overflow_loads,
            "expert_bytes": self.expert_bytes,
            "phases": {p: c.summary(per_layer) for p, c in self.phases.items()},
            **({"admission": self.admission} if self.admission is not None else {}),
        }
