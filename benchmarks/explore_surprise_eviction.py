"""Exploration (replay only, not a runtime policy): evict what the predictor would bring back.

The cache replay's bound (``belady``, stmoe.evaluate.cache_replay) gets much of its lead
over LRU from knowing which experts the plan will prefetch again before they are needed:
dropping those costs no hit. An online stand-in: per (layer, expert), the share of its
demands so far that its prefetch set did NOT hold (its *surprise*: how often the
predictor misses it), times how recently it was used. An expert the predictor usually
names is cheap to evict; one it misses is worth keeping. Scores go through the replay's
``score`` policy (lowest evicted, ties to the least recent), beside LRU, stmoe-plus's own
``score`` eviction and the bound, on bench_eviction's held-out cases (stmoe-plus at 1.5K
experts a layer, tables never profiled on the routing replayed). Its constants (the prior
1/2, a recency half-life of 8 tokens, a floor of 0.05) were set once, before any run, and
not tuned on these cases.

Target (exploratory): its hit rate above stmoe-plus's score eviction in most Qwen1.5 cases.

    python benchmarks/explore_surprise_eviction.py
"""

from __future__ import annotations

import bench_eviction as ev
import numpy as np

from stmoe.evaluate.cache_replay import replay_cache
from stmoe.evaluate.systems import PLUS_SET_SIZE_IN_K
from stmoe.predictors import ModelShape, make, profile
from stmoe.predictors.base import PrefetchPlan
from stmoe.trace.schema import RoutingTrace

PRIOR, HALF_LIFE, FLOOR = (1.0, 2.0), 8.0, 0.05


def surprise_scores(trace: RoutingTrace, plan: PrefetchPlan) -> np.ndarray:
    """[T*L, N] each expert's eviction score at (token, layer), from the tokens before it:
    (demands its set missed + 1) / (demands + 2), times (FLOOR + 2^-(age / HALF_LIFE))."""
    t_count, n_layers, n = trace.num_tokens, trace.num_layers, trace.num_experts
    demands, missed = np.zeros((n_layers, n)), np.zeros((n_layers, n))
    last = np.full((n_layers, n), -1e9)
    out = np.zeros((t_count * n_layers, n), dtype=np.float32)
    for t in range(t_count):
        for layer in range(n_layers):
            surprise = (missed[layer] + PRIOR[0]) / (demands[layer] + PRIOR[1])
            out[t * n_layers + layer] = surprise * (FLOOR + np.exp2(-(t - last[layer])
                                                                    / HALF_LIFE))
            held = set(plan.at(t, layer).tolist())
            for e in trace.experts[t, layer]:
                if e >= 0:
                    demands[layer, e] += 1
                    missed[layer, e] += e not in held
                    last[layer, e] = t
    return out


def case(replayed: RoutingTrace, tables_from: list[RoutingTrace], share: float) -> dict:
    tables = profile(tables_from)
    shape = ModelShape.of(replayed)
    capacity = max(shape.top_k, round(share * shape.num_experts))
    plan, scores = make("stmoe-plus", shape, tables,
                        set_size=PLUS_SET_SIZE_IN_K * shape.top_k).scored_plan(replayed)
    mask = np.asarray(replayed.is_decode)
    out = {"capacity": capacity}
    for name, policy, sc in (("lru", "lru", None), ("score", "score", scores),
                             ("surprise", "score", surprise_scores(replayed, plan)),
                             ("belady", "belady", None)):
        s = replay_cache(replayed, plan, capacity, policy, mask, sc)
        out[name] = {"hit_rate": round(s.hit_rate, 4),
                     "moved_per_token": round(s.moved_per_token, 2)}
    return out


def main() -> int:
    ev.case = case  # the same cases, this case's policies
    print("hit rate / experts moved per decode token; stmoe-plus at 1.5K a layer; HELD-OUT")
    q15, q36 = ev.qwen15_cases(), ev.qwen36_cases()
    for label, r in q15 + q36:
        ev.show(label, r)
    over = [r["surprise"]["hit_rate"] - r["score"]["hit_rate"] for _, r in q15]
    print(f"\nqwen1.5: surprise's hit rate - score's: {min(over):+.3f} .. {max(over):+.3f} "
          f"(median {float(np.median(over)):+.3f}); above in {sum(x > 0 for x in over)}, "
          f"equal in {sum(x == 0 for x in over)} of {len(over)}")
    better = sum(x > 0 for x in over)
    print(f"surprise's hit rate above score's in most qwen1.5 cases: {better}/{len(over)} "
          f"{'MET' if 2 * better > len(over) else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
