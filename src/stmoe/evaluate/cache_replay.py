"""Cache replay: a per-layer expert cache fed by a predictor's prefetches.

Each MoE layer has its own cache of ``capacity`` experts (one number for every layer, or
one per layer: ``stmoe.evaluate.layer_capacity`` sizes them). At every (token, layer):

1. the prefetch set's first ``capacity`` experts are loaded, most confident first
   (already resident: nothing moves); an insertion never evicts an expert of the
   same set (the whole set is protected first, as the runtime's planner does), and
   when only those are left, the rest of the set is dropped;
2. the router's experts are demanded: resident ones are hits; the others are
   misses, loaded on demand, never evicting another expert of the same demand.

Eviction picks a victim among the unprotected residents with a policy of
``stmoe.cache_policy`` (``lru``, ``lfu``, ``belady`` or ``score``, which takes the
scores each set was ranked from, ``Predictor.scored_plan``; the names and their
rules are documented there).

``belady`` is the bound: the most hits any eviction could make with the same prefetches.
It knows the trace and the plan, loads a prefetch only where that helps, and may evict
any resident (no set is protected from it: a relaxation of the rules above, so every
policy's run under them is one of its choices). An expert's *need* is its next counted
demand, unless the plan offers it again first (a prefetch of it, or a demand not
counted: a free load) and then never: dropping it costs no hit. The victim is the
resident needed last, and a prefetch is loaded only where it is needed sooner than its
victim. Furthest-next-use on the plain next demand (its rule before) is the optimum of
demand paging only: with prefetches it evicted an expert the plan was about to bring
back (LRU beat it on a 6-token trace). On 5,000 random small cases (1-2 layers, 2-7
tokens, 3-6 experts, 1-4 slots, some tokens not counted) its hits equal an exhaustive
search's optimum of the relaxed rules, and LRU's, LFU's and none's are at most that
(``tests/evaluate/test_belady_bound.py`` keeps 360 of them).

Every (token, layer) is one use stamp: its prefetched and demanded experts share it, and
ties go to the smaller expert id.

A load is *useful* once the router demands it while resident, *wasted* if it is
evicted (or the trace ends) first. Counters cover the tokens in ``count_mask``
(decode tokens when the trace marks them) at every layer; state evolves over
the whole trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stmoe import cache_policy as cp
from stmoe.predictors.base import PredictorError, PrefetchPlan
from stmoe.trace.schema import RoutingTrace
from stmoe.util.jit import njit

POLICIES = cp.names_for(cp.REPLAY)  # the policy names a replay accepts


@dataclass(frozen=True)
class CacheStats:
    """What a cache replay moved and how often the router found its experts resident."""

    capacity: int | tuple[int, ...]  # experts per layer: every layer's, or each layer's
    policy: str
    tokens: int  # tokens counted
    demanded: int  # expert uses the router asked for
    hits: int  # of which already resident
    moved: int  # experts loaded (prefetch + on demand)
    prefetched: int  # of which by prefetch
    useful: int  # loads the router then used
    wasted: int  # loads evicted (or left at the end) unused
    layer_demanded: tuple[int, ...] = ()  # ``demanded`` of each layer
    layer_hits: tuple[int, ...] = ()  # ``hits`` of each layer

    @property
    def hit_rate(self) -> float:
        return self.hits / self.demanded if self.demanded else 0.0

    @property
    def moved_per_token(self) -> float:
        return self.moved / self.tokens if self.tokens else 0.0

    @property
    def read_amplification(self) -> float | None:
        """Experts moved per expert needed (1.0 = nothing moved in vain); None if none needed."""
        if not self.useful:
            return 1.0 if not self.moved else None
        return self.moved / self.useful

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "capacity": list(self.capacity) if isinstance(self.capacity, tuple) else self.capacity,
            "policy": self.policy,
            "hit_rate": self.hit_rate,
            "moved_per_token": self.moved_per_token,
            "wasted_loads": self.wasted,
            "wasted_per_token": self.wasted / self.tokens if self.tokens else 0.0,
            "read_amplification": self.read_amplification,
            "hits": self.hits,
            "misses": self.demanded - self.hits,
            "demanded": self.demanded,
            "moved": self.moved,
            "prefetched": self.prefetched,
            "useful_loads": self.useful,
            "tokens": self.tokens,
        }


def replay_cache(
    trace: RoutingTrace,
    plan: PrefetchPlan,
    capacity: int | Sequence[int],
    policy: str = "lru",
    count_mask: np.ndarray | None = None,
    scores: np.ndarray | None = None,
) -> CacheStats:
    """Run the per-layer caches over ``trace`` with ``plan``'s prefetches; ``capacity``:
    experts per layer, one number or one per layer; ``scores`` ([T*L, N],
    ``Predictor.scored_plan``'s) rank the victims of policy ``score``."""
    code = cp.policy_code(policy, cp.REPLAY, PredictorError)
    caps = _capacities(capacity, trace)
    rows = trace.num_tokens * trace.num_layers
    if code != cp.SCORE:
        scores = np.zeros((rows, 0), dtype=np.float32)  # rows of none: (score's) victims as LRU
    elif scores is None:
        raise PredictorError("cache policy 'score' evicts by the predictor's scores: replay "
                             "with a scoring predictor's scored_plan (stmoe-plus, hybrid, "
                             "stmoe-mix)")
    elif scores.shape != (rows, trace.num_experts):
        raise PredictorError(f"scores of shape {scores.shape} for a trace of {rows} (token, "
                             f"layer) rows and {trace.num_experts} experts")
    if count_mask is None:
        count_mask = np.ones(trace.num_tokens, dtype=bool)
    experts = np.ascontiguousarray(trace.experts, dtype=np.int16)
    count_mask = np.asarray(count_mask, dtype=np.bool_)
    caps = np.minimum(caps, trace.num_experts)
    events = (_events(experts, plan, caps, count_mask, trace.num_experts) if code == cp.BELADY
              else _NO_EVENTS)
    counts = _replay(
        experts, (plan.ptr, plan.ids), (caps, code), count_mask, events,
        np.ascontiguousarray(scores, dtype=np.float32), trace.num_experts,
    )
    demanded, hits, moved, prefetched, useful, wasted = (int(x) for x in counts.sum(axis=0))
    return CacheStats(
        capacity=capacity if isinstance(capacity, int) else tuple(int(c) for c in caps),
        policy=cp.POLICIES[code], tokens=int(np.count_nonzero(count_mask)),
        demanded=demanded, hits=hits, moved=moved, prefetched=prefetched, useful=useful,
        wasted=wasted, layer_demanded=tuple(int(x) for x in counts[:, 0]),
        layer_hits=tuple(int(x) for x in counts[:, 1]),
    )


def _capacities(capacity: int | Sequence[int], trace: RoutingTrace) -> np.ndarray:
    """[L] int64 experts per layer, each checked to hold one token's experts."""
    caps = np.full(trace.num_layers, capacity, dtype=np.int64) if isinstance(
        capacity, (int, np.integer)) else np.asarray(capacity, dtype=np.int64).reshape(-1)
    if caps.shape != (trace.num_layers,):
        raise PredictorError(f"{caps.size} cache capacities for a trace of {trace.num_layers} "
                             "MoE layers: give one number, or one per layer")
    low = np.flatnonzero(caps < trace.top_k)
    if low.size:
        where = "" if isinstance(capacity, (int, np.integer)) else f" (layer {low[0]})"
        raise PredictorError(
            f"cache capacity {caps[low[0]]}{where} is below top-k {trace.top_k}: one token's "
            "experts must fit; use --capacity >= top-k"
        )
    return caps


_NO_EVENTS = (np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64),
              np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))


def _events(experts: np.ndarray, plan: PrefetchPlan, caps: np.ndarray,
            count_mask: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Belady's view of the future (module docstring), per (layer, expert) in ascending
    time, as two CSRs: its counted demands, and its free loads (the plan's prefetches of
    it, within the layer's capacity, and its demands not counted). Time 2t is step t's
    prefetch, 2t + 1 its demand."""
    t_count, n_layers = experts.shape[0], experts.shape[1]
    tokens = np.broadcast_to(np.arange(t_count)[:, None, None], experts.shape)
    layers = np.broadcast_to(np.arange(n_layers)[None, :, None], experts.shape)
    valid = experts >= 0
    counted = valid & count_mask[:, None, None]
    rows = np.arange(t_count * n_layers)
    starts = plan.ptr[:-1]
    stops = np.minimum(plan.ptr[1:], starts + caps[rows % n_layers])
    sizes = np.maximum(stops - starts, 0)
    row_of = np.repeat(rows, sizes)
    taken = np.repeat(starts - np.cumsum(np.r_[0, sizes[:-1]]), sizes) + np.arange(sizes.sum())
    uncounted = valid & ~counted
    free_key = np.r_[layers[uncounted] * n + experts[uncounted],
                     (row_of % n_layers) * n + plan.ids[taken]].astype(np.int64)
    free_time = np.r_[2 * tokens[uncounted] + 1, 2 * (row_of // n_layers)]
    need_key = (layers[counted] * n + experts[counted]).astype(np.int64)
    return (*_csr(need_key, 2 * tokens[counted] + 1, n_layers * n),
            *_csr(free_key, free_time, n_layers * n))


def _csr(keys: np.ndarray, times: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((times, keys))
    ptr = np.zeros(size + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(np.bincount(keys, minlength=size))
    return ptr, np.asarray(times, dtype=np.int64)[order]


@njit(cache=True)
def _drop(layer, v, res, unused, counted_load):  # pragma: no cover - compiled
    """Evict ``v``; 1 if it was a counted load never used (waste), else 0."""
    res[v] = False
    return 1 if unused[layer, v] and counted_load[layer, v] else 0


@njit(cache=True)
def _replay(experts, plan, cache, count_mask, events, scores,
            n):  # pragma: no cover - compiled
    """The counters of ``replay_cache``, [L, 6]: each layer's (demanded, hits, moved,
    prefetched, useful, wasted).

    plan: the prefetch sets as CSR (ptr, ids); cache: ([L] experts kept per layer,
    ``cache_policy`` code); events: ``_events``' CSRs, for Belady; scores: [T*L, N or 0]
    each prediction's scores, for score eviction."""
    ptr, ids = plan
    caps, policy = cache
    need_ptr, need_at, free_ptr, free_at = events
    t_count, n_layers = experts.shape[0], experts.shape[1]
    resident = np.zeros((n_layers, n), dtype=np.bool_)
    unused = np.zeros((n_layers, n), dtype=np.bool_)  # loaded, not yet demanded
    counted_load = np.zeros((n_layers, n), dtype=np.bool_)  # its load fell in count_mask
    last = np.zeros((n_layers, n), dtype=np.int64)
    freq = np.zeros((n_layers, n), dtype=np.int64)
    cursor = need_ptr[:-1].copy()
    free_cursor = free_ptr[:-1].copy()
    nxt = np.zeros(n, dtype=np.int64)  # Belady's need at this step's prefetch, then demand
    nxt_demand = np.zeros(n, dtype=np.int64)
    size = np.zeros(n_layers, dtype=np.int64)
    protect = np.zeros(n, dtype=np.bool_)
    out = np.zeros((n_layers, 6), dtype=np.int64)
    clock = 0
    for t in range(t_count):
        counted = count_mask[t]
        for layer in range(n_layers):
            clock += 1
            capacity = caps[layer]
            demanded = hits = moved = prefetched = useful = wasted = 0
            if policy == cp.BELADY:  # each expert's need (module docstring), at 2t and 2t + 1
                for e in range(n):
                    c = layer * n + e
                    while cursor[c] < need_ptr[c + 1] and need_at[cursor[c]] < 2 * t:
                        cursor[c] += 1
                    while free_cursor[c] < free_ptr[c + 1] and free_at[free_cursor[c]] <= 2 * t:
                        free_cursor[c] += 1
                    due = need_at[cursor[c]] if cursor[c] < need_ptr[c + 1] else cp.NEVER
                    f = free_cursor[c]
                    free = free_at[f] if f < free_ptr[c + 1] else cp.NEVER
                    nxt[e] = cp.NEVER if free < due else due
                    if free == 2 * t + 1:  # a free load at this very demand: the one after
                        free = free_at[f + 1] if f + 1 < free_ptr[c + 1] else cp.NEVER
                    nxt_demand[e] = cp.NEVER if free < due else due
            res = resident[layer]
            sc = scores[t * n_layers + layer]  # the scores this (token, layer)'s set came from
            start = ptr[t * n_layers + layer]
            stop = min(ptr[t * n_layers + layer + 1], start + capacity)  # what a cache holds
            for i in range(start, stop):  # the whole set first: no insertion evicts a member
                protect[ids[i]] = policy != cp.BELADY  # (the bound's relaxation: it may)
            for i in range(start, stop):  # 1. prefetch, most confident first
                p = ids[i]
                if res[p]:
                    continue
                if size[layer] >= capacity:
                    v = cp.choose_victim(res, protect, last[layer], freq[layer], nxt, sc, policy)
                    if v < 0:
                        break  # only this prefetch set is resident: drop the rest of it
                    if not cp.admits(policy, nxt[p], nxt[v]):
                        continue  # Belady declines a load needed no sooner than its victim
                    wasted += _drop(layer, v, res, unused, counted_load)
                    size[layer] -= 1
                res[p] = True
                size[layer] += 1
                unused[layer, p] = True
                counted_load[layer, p] = counted
                last[layer, p] = clock
                if counted:
                    moved += 1
                    prefetched += 1
            for i in range(start, stop):
                protect[ids[i]] = False
            if policy == cp.BELADY:
                nxt[:] = nxt_demand
            for a in experts[t, layer]:  # 2. demand
                if a >= 0:
                    protect[a] = True
            for a in experts[t, layer]:
                if a < 0:
                    continue
                if counted:
                    demanded += 1
                if res[a]:
                    if counted:
                        hits += 1
                    if unused[layer, a] and counted_load[layer, a]:
                        useful += 1
                else:
                    if size[layer] >= capacity:  # a victim exists: capacity >= K > demanded
                        v = cp.choose_victim(res, protect, last[layer], freq[layer], nxt, sc,
                                             policy)
                        wasted += _drop(layer, v, res, unused, counted_load)
                        size[layer] -= 1
                    res[a] = True
                    size[layer] += 1
                    if counted:
                        moved += 1
                        useful += 1
                unused[layer, a] = False
                last[layer, a] = clock
                freq[layer, a] += 1
            for a in experts[t, layer]:
                if a >= 0:
                    protect[a] = False
            out[layer, 0] += demanded
            out[layer, 1] += hits
            out[layer, 2] += moved
            out[layer, 3] += prefetched
            out[layer, 4] += useful
            out[layer, 5] += wasted
    for layer in range(n_layers):
        for e in range(n):
            if resident[layer, e] and unused[layer, e] and counted_load[layer, e]:
                out[layer, 5] += 1
    return out
