"""The arithmetic of a comparison of systems measured in rounds (pure, no torch).

Why here and not in a benchmark script: the benchmarks, the demo and the simulator's
check all order rounds, print medians with ranges and judge targets; the rules are
tested once, where they live.
"""

from __future__ import annotations

import statistics


def rotated(systems: list[str], rnd: int) -> list[str]:
    """Round ``rnd``'s order: each round starts one system later, so no system always
    runs first (a fresh page cache) or right after the same neighbour."""
    k = rnd % len(systems)
    return systems[k:] + systems[:k]


def closed(t_lru: float, t_best: float, t_oracle: float) -> float:
    """The share of the lru-only -> oracle time gap that ``t_best`` closes (nan: no gap)."""
    room = t_lru - t_oracle
    return (t_lru - t_best) / room if room > 0 else float("nan")


def spread(values: list[float], fmt: str = ".2f") -> str:
    """``median [min, max]`` of ``values``, each with ``fmt``."""
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def verdict(ok: bool) -> str:
    """A target's one word: MET or NOT MET."""
    return "MET" if ok else "NOT MET"


# Fewer rounds a side give no verdict: two rounds of one speed against two of the same fall
# apart a third of the time (2 of the 6 orders of 4 values), three one time in ten, five
# under 1% (2 of 252)
MIN_ROUNDS = 3


def against(mine: list[float], base: list[float]) -> str:
    """How speeds ``mine`` compare with ``base`` (higher is faster), by one rule for every
    report (issue 27): ``faster`` (median >= base's and the ranges apart), ``as fast``
    (median >= base's, ranges overlapping), ``within noise`` (median below but the ranges
    overlap: counts as 1.0x), ``slower`` (below, ranges apart); ``single run`` when either
    side has one value (no range to judge by), ``too few rounds`` when either has fewer
    than ``MIN_ROUNDS`` (ranges apart by chance too often to call)."""
    if len(mine) < 2 or len(base) < 2:
        return "single run"
    if min(len(mine), len(base)) < MIN_ROUNDS:
        return "too few rounds"
    return _order(mine, base)


def _order(mine: list[float], base: list[float]) -> str:
    overlap = max(mine) >= min(base) and max(base) >= min(mine)
    if statistics.median(mine) >= statistics.median(base):
        return "as fast" if overlap else "faster"
    return "within noise" if overlap else "slower"


def not_slower(mine: list[float], base: list[float]) -> bool:
    """The >= 1.0x target: median at least base's, or within noise (ranges overlap)."""
    if len(mine) < 2 or len(base) < 2:
        return statistics.median(mine) >= statistics.median(base)
    return _order(mine, base) != "slower"
