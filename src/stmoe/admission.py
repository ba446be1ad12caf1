"""Admission: whether a layer's prefetch is worth its bytes, decided from what the run measures.

The method's promise is that a miss costs at most an on-demand load, so prefetching is
never worse than not prefetching. On a saturated tier that only holds if prefetch is
selective: a wasted read delays a needed one, and a prefetched expert evicts one an LRU
cache would have hit. So, per MoE layer, as the run goes (docs/runtime.md, Admission):

* **confidence**: the predictor's measured precision at each rank r of its ranked set
  (an exponential average over the layer's calls: was the rank-r expert routed?). A rank
  is admitted while its precision is at least the break-even ``w / (1 + w)``, where ``w``
  is what a wasted read costs in saved reads: the tier's measured busy share (an idle
  tier's wasted read delays nothing; a saturated tier's delays a needed one). On a GPU's
  copy engine fed from pinned memory (``link_of("gpu")``) a wasted copy costs no saved
  read: the engine is idle while the compute runs, and a demand's copy goes ahead of a
  worker's next piece; what a wasted prefetch does cost, the cached expert it evicted, is
  scored below. (The host's clock cannot see the engine's busy share anyway: it sees a
  copy queued, not run. On the simulator's host pipeline, at GPU-like costs, Qwen1.5's
  routing with tables profiled on its other prompts, this rule was ahead of the busy share
  in 17 of 18 cases: docs/journal/2026-12-06-gpu-forecast.md.)
* **bandwidth**: no more loads than the tier can deliver before they are needed, the
  horizon's measured layer time over the measured read time of one expert, where reads
  share a device (the disk: one read in flight slows the others). On a serial link (the
  emulated tier: reads one after another) a load the link cannot deliver in time never
  starts: it is dropped as stale when its layer begins and a demand read goes first, so
  it costs nothing and the budget is the cache's; the confidence rule still decides;
* **fall back**: every ``window`` calls a layer's prefetch is scored: experts it brought
  in that were routed (saved reads) minus misses of experts a prefetch evicted (LRU
  would have hit them) minus ``w`` per wasted read. A losing layer turns prefetch off
  (plain LRU) for ``backoff`` calls, then probes for a window; a losing probe doubles the
  backoff (up to ``max_backoff``), a winning one keeps prefetch on.

No torch, no lock of its own: the engine calls it with its lock held; time comes in as
numbers, so the rules are tested on scripted outcomes (tests/runtime/test_admission.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AdmissionConfig:
    """The admission rule's knobs (the defaults are the runtime's)."""

    window: int = 8  # layer calls per verdict
    backoff: int = 16  # layer calls prefetch stays off after a losing window
    max_backoff: int = 256  # the longest a losing layer waits between probes
    ema: float = 0.2  # weight of the newest call in the rank precisions and the timings
    prior: float = 0.5  # a rank's precision before the layer has measured it


@dataclass
class _Layer:
    precision: list[float]  # [rank] exponential average: was the rank-r prediction routed
    on: bool = True
    off_left: int = 0  # calls until the next probe, while off
    backoff: int = 0
    probing: bool = False
    scores: deque[float] = field(default_factory=deque)  # the window's per-call scores
    ghosts: set[int] = field(default_factory=set)  # experts a prefetch evicted since
    prediction: tuple[int, tuple[int, ...]] | None = None  # (call, full ranked set)
    wasted: int = 0  # reads wasted since the last call
    off_calls: int = 0  # calls with prefetch off (reported)


def link_of(tier: str) -> tuple[bool, bool]:
    """(serial, free_waste) of the tier named ``tier``, for the runtime and the simulator
    alike: the emulated link and a GPU's copies from pinned memory (one copy stream, a
    demand ahead of the queued prefetches) are serial; only the GPU's wastes nothing."""
    return tier in ("emulated", "gpu"), tier == "gpu"


class Admission:
    """Per-layer admission of a predictor's ranked prefetch sets."""

    def __init__(self, num_layers: int, capacity: int, horizon: int,
                 config: AdmissionConfig | None = None, *, serial: bool = False,
                 free_waste: bool = False) -> None:
        self.config = config or AdmissionConfig()
        self.capacity, self.horizon = capacity, horizon
        self.serial = serial  # the tier reads one block at a time (see the module doc)
        self.free_waste = free_waste  # a wasted read costs no saved read (a GPU's copies)
        self.layers = [_Layer([self.config.prior] * capacity) for _ in range(num_layers)]
        self.read_s: float | None = None  # one expert's read, measured
        self.layer_s: float | None = None  # one layer call's wall time, measured
        # the tier's busy share (reads' seconds over wall seconds), measured; None until the
        # first measurement (an unmeasured tier is not an idle one: it starts at that)
        self.busy: float | None = None
        self.turned_off = 0  # losing windows (reported)
        self.probes = 0
        # (clock, read seconds so far, reads so far) at the last decode layer call
        self.last_call: tuple[float, float, int] | None = None
        self.observed: tuple[int, int] | None = None  # the last (call, layer) observed

    @classmethod
    def for_tier(cls, num_layers: int, capacity: int, horizon: int, tier: str) -> Admission:
        """Admission for the tier named ``tier`` (its link: ``link_of``)."""
        serial, free_waste = link_of(tier)
        return cls(num_layers, capacity, horizon, serial=serial, free_waste=free_waste)

    # ---- what the planner asks -------------------------------------------------------
    def admit(self, fwd: int, layer: int, ranked: list[int]) -> list[int]:
        """The prefix of ``ranked`` worth loading for (call ``fwd``, ``layer``)."""
        st = self.layers[layer]
        st.prediction = (fwd, tuple(ranked))
        if not st.on:
            return []
        w = self.waste_cost()
        floor, precision = w / (1.0 + w), st.precision
        # the first rank below the floor (ranks past the capacity take the last one's)
        keep = next((r for r in range(min(len(ranked), self.capacity)) if precision[r] < floor),
                    len(ranked))
        return ranked[: min(keep, self.budget())]

    def wants(self, layer: int) -> bool:
        """Whether ``layer``'s prefetch is on (else the planner does not even predict)."""
        return self.layers[layer].on

    def waste_cost(self) -> float:
        """Saved reads a wasted read costs: the tier's busy share (0 idle .. 1 saturated);
        none where ``free_waste``."""
        return 0.0 if self.free_waste else min(1.0, max(0.0, self.busy or 0.0))

    def budget(self) -> int:
        """Loads the tier can deliver within the horizon's layers (every load, unmeasured;
        on a serial link, every load: what cannot arrive in time is dropped unstarted)."""
        if self.serial or not self.read_s or not self.layer_s:
            return self.capacity
        return max(1, min(self.capacity, int(self.horizon * self.layer_s / self.read_s)))

    # ---- what the layers and the workers report ----------------------------------------
    def evicted(self, layer: int, expert: int) -> None:
        """A prefetch's claim evicted ``expert`` (ready, cached) from ``layer``'s cache."""
        ghosts = self.layers[layer].ghosts
        ghosts.add(expert)
        if len(ghosts) > self.capacity:
            ghosts.pop()

    def wasted_read(self, layer: int) -> None:
        """A prefetched expert of ``layer`` was evicted unused."""
        self.layers[layer].wasted += 1

    def timings(self, read_s: float | None = None, layer_s: float | None = None,
                busy: float | None = None) -> None:
        """Measured: one expert read's seconds, one layer call's, the tier's busy share."""
        a = self.config.ema
        if read_s is not None:
            self.read_s = read_s if self.read_s is None else (1 - a) * self.read_s + a * read_s
        if layer_s is not None:
            self.layer_s = (layer_s if self.layer_s is None
                            else (1 - a) * self.layer_s + a * layer_s)
        if busy is not None:
            self.busy = busy if self.busy is None else (1 - a) * self.busy + a * busy

    def layer_called(self, fwd: int, layer: int, needed: set[int], prefetch_hits: int,
                     misses: set[int]) -> None:
        """Layer ``layer`` of call ``fwd`` routed ``needed``: of them ``prefetch_hits`` a
        prefetch brought in (unused until now), ``misses`` not in the cache."""
        st, cfg = self.layers[layer], self.config
        if st.prediction is not None and st.prediction[0] == fwd:
            precision, a, keep = st.precision, cfg.ema, 1 - cfg.ema
            for r, e in enumerate(st.prediction[1][: self.capacity]):
                precision[r] = keep * precision[r] + a * (e in needed)
        st.prediction = None
        harmed = len(misses & st.ghosts)
        st.ghosts -= needed
        score = prefetch_hits - harmed - self.waste_cost() * st.wasted
        st.wasted = 0
        if not st.on:
            st.off_calls += 1
            st.off_left -= 1
            if st.off_left <= 0:  # probe: prefetch on for a window
                st.on, st.probing = True, True
                st.scores.clear()
                self.probes += 1
            return
        st.scores.append(score)
        if len(st.scores) < cfg.window:
            return
        losing = sum(st.scores) < 0
        st.scores.clear()
        if losing:
            st.backoff = (min(cfg.max_backoff, 2 * st.backoff) if st.probing and st.backoff
                          else cfg.backoff)
            st.on, st.off_left = False, st.backoff
            st.ghosts.clear()
            self.turned_off += 1
        elif st.probing:
            st.backoff = 0
        st.probing = False

    def observe(self, fwd: int, layer: int, needed: set[int], prefetch_hits: int,
                misses: set[int], now: float, read_s: float, reads: int) -> None:
        """One decode layer call, as the runtime (or the simulator) saw it: ``layer_called``,
        then the timings since the last call from the clock ``now`` and the tier's
        cumulative read seconds and count (one arithmetic for both). A layer call made again
        (``runtime.step_layer``: a step's requests left after a damaged block) is observed
        once."""
        if self.observed == (fwd, layer):
            return
        self.observed = (fwd, layer)
        self.layer_called(fwd, layer, needed, prefetch_hits, misses)
        if self.last_call is not None:
            then, then_s, then_n = self.last_call
            wall, done = now - then, reads - then_n
            if wall > 0:
                self.timings(read_s=(read_s - then_s) / done if done else None,
                             layer_s=wall, busy=(read_s - then_s) / wall)
        self.last_call = (now, read_s, reads)

    def summary(self) -> dict[str, object]:
        """What admission did: layers off now, calls with prefetch off, verdicts, timings."""
        return {
            "layers_off": [i for i, st in enumerate(self.layers) if not st.on],
            "off_calls": [st.off_calls for st in self.layers],
            "turned_off": self.turned_off,
            "probes": self.probes,
            "read_s": self.read_s,
            "layer_s": self.layer_s,
            "tier_busy": self.busy,
            "serial": self.serial,
            "free_waste": self.free_waste,
        }


def record_call(run: Any, cache: Any, layer: int, needed: list[int], now: float) -> None:
    """(lock held) What prefetch did for one decode layer call, and the run's timings, told
    to ``run.admission.observe``: the routed experts a prefetch brought in (unused until now), the
    misses, and since the last call its wall time and the tier's read seconds and count
    (``run``: a ``RunState``; ``cache``: the layer's ``LayerCache``)."""
    where, prefetched, used = cache.where, cache.prefetched, cache.used
    hits, misses = 0, set()
    for e in needed:  # one pass (this runs at every decode layer call)
        s = where.get(e)
        if s is None:
            misses.add(e)
        elif prefetched[s] and not used[s]:
            hits += 1
    reads = run.stats.phases["decode"].reads
    run.admission.observe(run.fwd, layer, set(needed), hits, misses, now,
                          reads["demand"][1] + reads["prefetch"][1],
                          reads["demand"][0] + reads["prefetch"][0])
