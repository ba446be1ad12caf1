"""Exploration (offline, not a policy): how far ahead must eviction see to reach the bound?

The cache replay's bound (``belady``, stmoe.evaluate.cache_replay) hits about 0.2 more
than stmoe-plus's score eviction on Qwen1.5 with the same prefetches, and the last
exploration (explore_surprise_eviction.py) found that lead is knowledge of the coming
tokens' routing, not the prefetches' precision. This asks how MANY coming tokens. Each
variant is told, exactly, the next ``H`` tokens at its layer (H = 0: only the current
token's demand) and nothing beyond, and keeps the resident demanded soonest:

- ``H-lru``: residents not demanded within H tokens go least recent first;
- ``H-score``: those are ranked by stmoe-plus's probability (what score eviction knows);
- ``H-plan``: as ``H-score``, and also told the plan's next H tokens: a resident the plan
  offers again before its next demand is evicted first (the bound's notion of need:
  dropping it costs no hit, the prefetch brings it back);
- ``admit-A-64-score``: the plan keeping only members demanded within A tokens (an
  admission that knows the future), evicted as ``64-score``.

Every variant runs under the runtime's rules (every prefetch of the set loaded, the set
protected), through the replay's ``score`` policy (lowest evicted, ties to the least
recent); the bound is freer (it may skip a prefetch or evict any resident). The horizons
were set before any run; ``H-plan`` and the admission were added after the first run
showed ``H-score`` stopping at about 60% of the lead on Qwen1.5.

Read: what a perfect forecast of H tokens could gain tells how far ahead an online one
must see. Same held-out cases as bench_eviction.py (stmoe-plus at 1.5K experts a layer,
tables never profiled on the routing replayed). Hit rates are deterministic.

    python benchmarks/explore_eviction_horizon.py
"""

from __future__ import annotations

from collections.abc import Callable

import bench_eviction as ev
import numpy as np

from stmoe.evaluate.cache_replay import replay_cache
from stmoe.evaluate.systems import PLUS_SET_SIZE_IN_K
from stmoe.predictors import ModelShape, make, profile
from stmoe.predictors.base import PrefetchPlan
from stmoe.trace.schema import RoutingTrace

HORIZONS = (0, 1, 2, 4, 8, 16, 32, 64)  # set before any run
ADMITS = (0, 1, 4, 16, 64)  # added after the first run, as H-plan
NEVER = np.float32(1e9)


def _next_use(t_count: int, n_layers: int, n: int, used_at: Callable[[int, int], np.ndarray],
              later_only: bool) -> np.ndarray:
    """[T*L, N]: tokens from each (token, layer) to each expert's next use at that layer
    (``used_at(t, layer)``: the ids used there), the current token's counted unless
    ``later_only``; NEVER when not again."""
    out = np.empty((t_count, n_layers, n), np.float32)
    nxt = np.full((n_layers, n), np.inf)
    for t in range(t_count - 1, -1, -1):
        if later_only:
            out[t] = np.minimum(nxt - t, NEVER)
        for layer in range(n_layers):
            nxt[layer, used_at(t, layer)] = t
        if not later_only:
            out[t] = np.minimum(nxt - t, NEVER)
    return out.reshape(t_count * n_layers, n)


def next_demand(trace: RoutingTrace) -> np.ndarray:
    """Tokens to each expert's next demand, the current token's included (0: demanded now)."""
    def routed(t: int, layer: int) -> np.ndarray:
        ids = trace.experts[t, layer]
        return ids[ids >= 0]

    return _next_use(trace.num_tokens, trace.num_layers, trace.num_experts, routed, False)


def next_offer(plan: PrefetchPlan, t_count: int, n: int) -> np.ndarray:
    """Tokens to the plan's next offer of each expert at its layer, later tokens only."""
    return _next_use(t_count, plan.num_layers, n, plan.at, True)


def admitted(plan: PrefetchPlan, distance: np.ndarray, horizon: int) -> PrefetchPlan:
    """``plan`` keeping only the members demanded within ``horizon`` tokens at their layer
    (offline: an admission that knows the future; 0 keeps those the token itself routes)."""
    ptr, ids = [0], []
    for row in range(len(plan.ptr) - 1):
        members = plan.ids[plan.ptr[row]:plan.ptr[row + 1]]
        ids += [e for e in members.tolist() if distance[row, e] <= horizon]
        ptr.append(len(ids))
    return PrefetchPlan(np.asarray(ptr, np.int64), np.asarray(ids, np.int16), plan.num_layers)


def horizon_values(distance: np.ndarray, horizon: int, beyond: np.ndarray | None
                   ) -> np.ndarray:
    """Within ``horizon`` tokens: 2 + (horizon - distance), the soonest highest; beyond it
    ``beyond`` in [0, 1] (score's probability) or 0 (ties: the least recent is evicted)."""
    inside = distance <= horizon
    tail = beyond if beyond is not None else np.zeros_like(distance)
    return np.where(inside, 2.0 + horizon - distance, tail).astype(np.float32)


def plan_aware(distance: np.ndarray, offer: np.ndarray, horizon: int, beyond: np.ndarray
               ) -> np.ndarray:
    """``horizon_values``, but an expert the plan offers again (within the horizon) before
    its next demand is worth nothing: the bound's notion of need, dropping it costs no hit."""
    free = (offer <= distance) & (offer <= horizon) & (distance > 0)
    return np.where(free, -1.0, horizon_values(distance, horizon, beyond)).astype(np.float32)


def case(replayed: RoutingTrace, tables_from: list[RoutingTrace], share: float) -> dict:
    shape = ModelShape.of(replayed)
    capacity = max(shape.top_k, round(share * shape.num_experts))
    plan, scores = make("stmoe-plus", shape, profile(tables_from),
                        set_size=PLUS_SET_SIZE_IN_K * shape.top_k).scored_plan(replayed)
    mask = np.asarray(replayed.is_decode)
    prob = (1 / (1 + np.exp(-scores))).astype(np.float32)
    distance = next_demand(replayed)
    offer = next_offer(plan, replayed.num_tokens, replayed.num_experts)
    runs: list[tuple[str, str, np.ndarray | None]] = [
        ("lru", "lru", None), ("score", "score", scores)]
    for h in HORIZONS:
        runs += [(f"{h}-lru", "score", horizon_values(distance, h, None)),
                 (f"{h}-score", "score", horizon_values(distance, h, prob)),
                 (f"{h}-plan", "score", plan_aware(distance, offer, h, prob))]
    runs.append(("belady", "belady", None))
    admits = [(f"admit-{a}", admitted(plan, distance, a)) for a in ADMITS]
    runs_admit = [(f"{name}-64-score", "score", horizon_values(distance, 64, prob), p)
                  for name, p in admits] + [("admit-0-bound", "belady", None, admits[0][1])]
    out: dict = {"capacity": capacity}
    for name, policy, values, p in [(*r, plan) for r in runs] + runs_admit:
        s = replay_cache(replayed, p, capacity, policy, mask, values)
        out[name] = {"hit_rate": round(s.hit_rate, 4),
                     "moved_per_token": round(s.moved_per_token, 2)}
    return out


def median_rate(rows: list[tuple[str, dict]], name: str) -> float:
    return float(np.median([r[name]["hit_rate"] for _, r in rows]))


def share_of_lead(rows: list[tuple[str, dict]], name: str) -> list[float]:
    """Per case, the share of score -> bound closed by ``name``."""
    return [(r[name]["hit_rate"] - r["score"]["hit_rate"])
            / (r["belady"]["hit_rate"] - r["score"]["hit_rate"])
            for _, r in rows if r["belady"]["hit_rate"] > r["score"]["hit_rate"]]


def main() -> int:
    ev.case = case  # bench_eviction's cases, this case's policies
    print("hit rate / experts moved per decode token; stmoe-plus at 1.5K a layer; HELD-OUT; "
          "H-*: OFFLINE (knows the next H tokens' demands)")
    q15, q36 = ev.qwen15_cases(), ev.qwen36_cases()
    for label, r in q15 + q36:
        ev.show(label, r)
    for label, rows in (("qwen1.5", q15), ("qwen3.6", q36)):
        med = {k: median_rate(rows, k) for k in ("lru", "score", "belady")}
        print(f"\n{label} ({len(rows)} cases), medians: lru {med['lru']:.3f}, score "
              f"{med['score']:.3f}, bound {med['belady']:.3f}; share of score -> bound "
              "closed, median [min, max]:")
        for h in HORIZONS:
            cells = []
            for tail in ("lru", "score", "plan"):
                closed = share_of_lead(rows, f"{h}-{tail}")
                rate = median_rate(rows, f"{h}-{tail}")
                cells.append(f"{h}-{tail} {rate:.3f}, {float(np.median(closed)):+.0%} "
                             f"[{min(closed):+.0%}, {max(closed):+.0%}]")
            print(f"  H={h:>2}: " + "   ".join(cells))
        cells = [f"{a} {median_rate(rows, f'admit-{a}-64-score'):.3f}" for a in ADMITS]
        bound0 = median_rate(rows, "admit-0-bound")
        print(f"  prefetches admitted only when demanded within A tokens, evicted at H=64 "
              f"(offline), A: {', '.join(cells)}; A=0's bound {bound0:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
