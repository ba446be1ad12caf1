"""The cache replay's ``belady`` is the bound on hits for the same prefetches.

An exhaustive search finds the most hits any run of the relaxed rules can make (module
docstring of ``stmoe.evaluate.cache_replay``: a prefetch may be loaded or not, any
resident evicted at any load; a demanded expert must be resident after its demand, a miss
if it was not before; hits counted on the counted tokens only). ``belady``'s hits equal
it on random small cases with several layers, prefetch sets of any size and tokens not
counted; every other policy's are at most that. Before, belady's furthest-next-use on the
plain next demand was not: LRU made 17 hits where it made 16."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from stmoe.evaluate.cache_replay import POLICIES, replay_cache
from stmoe.predictors.base import PrefetchPlan
from stmoe.trace.schema import RoutingTrace, TraceMeta


def _optimum(sets: list[list[int]], demands: list[list[int]], counted: list[bool],
             capacity: int) -> int:
    """The most counted hits of one layer's cache under the relaxed rules, by search."""
    @functools.cache
    def best(t: int, resident: frozenset[int]) -> int:
        if t == len(demands):
            return 0
        pool = sorted(resident | set(sets[t]))  # keeping more never costs: the largest sets
        out = 0
        for kept in itertools.combinations(pool, min(capacity, len(pool))):
            hits = len(set(demands[t]) & set(kept)) if counted[t] else 0
            rest = sorted(set(kept) - set(demands[t]))
            for others in itertools.combinations(rest, min(capacity - len(demands[t]),
                                                           len(rest))):
                out = max(out, hits + best(t + 1, frozenset(demands[t]) | frozenset(others)))
        return out

    return best(0, frozenset())


def _case(rng: np.random.Generator) -> tuple[RoutingTrace, PrefetchPlan, int, np.ndarray]:
    n, layers, tokens = int(rng.integers(3, 7)), int(rng.integers(1, 3)), int(rng.integers(2, 8))
    k = int(rng.integers(1, 3))
    capacity = int(rng.integers(k, min(n, 4) + 1))
    experts = np.stack([[rng.choice(n, k, replace=False) for _ in range(layers)]
                        for _ in range(tokens)]).astype(np.int16)
    sets = [rng.choice(n, int(rng.integers(0, min(n, capacity + 2) + 1)), replace=False)
            for _ in range(tokens * layers)]  # (beyond the capacity: its first C taken)
    plan = PrefetchPlan(np.cumsum([0] + [len(x) for x in sets]).astype(np.int64),
                        np.concatenate([*sets, np.zeros(0)]).astype(np.int16), layers)
    trace = RoutingTrace(experts=experts, seq_starts=np.array([0]),
                         is_decode=np.ones(tokens, dtype=bool),
                         meta=TraceMeta(num_experts=n, top_k=k, num_layers=layers, model="t",
                                        source="", synthetic=True, extra={}))
    return trace, plan, capacity, rng.random(tokens) < 0.8


@pytest.mark.parametrize("seed", range(6))
def test_belady_makes_the_most_hits_any_eviction_can_with_the_same_prefetches(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        trace, plan, capacity, counted = _case(rng)
        want = 0
        for layer in range(trace.num_layers):
            sets = [plan.at(t, layer)[:capacity].tolist() for t in range(trace.num_tokens)]
            demands = [trace.experts[t, layer].tolist() for t in range(trace.num_tokens)]
            want += _optimum(sets, demands, counted.tolist(), capacity)
        got = replay_cache(trace, plan, capacity, "belady", count_mask=counted)
        assert got.hits == want, (trace.experts.tolist(), plan.ids.tolist(), capacity)
        assert got.moved == got.useful + got.wasted
        for policy in set(POLICIES) - {"belady", "score"}:
            assert replay_cache(trace, plan, capacity, policy,
                                count_mask=counted).hits <= want, policy


def test_the_case_where_furthest_next_use_lost_to_lru():
    """The property test's case: one layer (here alone), demands 3 6 4 3 5 5, prefetches 3,
    6, 5, 3, -, 5, two slots. Furthest-next-use evicted the 5 it had just prefetched (needed
    at token 4) for the demanded 4, where the 3 it kept comes back by prefetch at token 3."""
    demands, sets = [3, 6, 4, 3, 5, 5], [[3], [6], [5], [3], [], [5]]
    experts = np.array(demands, dtype=np.int16)[:, None, None]
    plan = PrefetchPlan(np.cumsum([0] + [len(x) for x in sets]).astype(np.int64),
                        np.array([e for x in sets for e in x], dtype=np.int16), 1)
    trace = RoutingTrace(experts=experts, seq_starts=np.array([0]),
                         is_decode=np.ones(6, dtype=bool),
                         meta=TraceMeta(num_experts=7, top_k=1, num_layers=1, model="t",
                                        source="", synthetic=True, extra={}))
    lru = replay_cache(trace, plan, 2, "lru").hits
    best = replay_cache(trace, plan, 2, "belady").hits
    assert best == _optimum(sets, [[d] for d in demands], [True] * 6, 2) == 5 >= lru
