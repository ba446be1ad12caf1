"""The one rule for a batch's prefetch set: the union of its slots' predictions.

Several sequences (slots) decode together and share one cache, so a batch loads
one set per layer. Each slot contributes a weight per expert: its normalised
scores where the predictor scores every expert (stmoe-plus, stmoe-mix), else 1
per expert it predicts (a vote). The batch's set orders experts by the summed
weight (the expected number of slots needing each), then by their best rank in
any slot, then by id, and is cut to the batch's size (0: every ranked expert).
``Predictor.predict_batch``, stmoe-plus, stmoe-mix and the simulator's prefetch
queue (compiled, through ``vote_union``) all follow it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from stmoe.util.jit import njit

_NONE = np.zeros(0, dtype=np.int64)


@njit(cache=True)
def order_union(candidates, weight, best_rank):  # pragma: no cover - compiled
    """``candidates`` (expert ids) by summed ``weight`` (descending), then ``best_rank``,
    then id: two stable sorts over the ids in ascending order."""
    ids = np.sort(candidates)
    ids = ids[np.argsort(best_rank[ids], kind="mergesort")]
    return ids[np.argsort(-weight[ids], kind="mergesort")]


@njit(cache=True)
def vote_union(ids, ptr, sets):  # pragma: no cover - compiled
    """The union of the ranked sets ``ids[ptr[i] : ptr[i + 1]]`` for i in ``sets``, one
    vote per predicted expert, in the batch order (ids below ``num_experts``)."""
    n = 0
    for i in sets:
        for j in range(ptr[i], ptr[i + 1]):
            n = max(n, ids[j] + 1)
    votes = np.zeros(n)
    best = np.full(n, n, dtype=np.int64)
    seen = np.zeros(n, dtype=np.int64)
    n_seen = 0
    for i in sets:
        for j in range(ptr[i], ptr[i + 1]):
            e = ids[j]
            if votes[e] == 0:
                seen[n_seen] = e
                n_seen += 1
            votes[e] += 1
            best[e] = min(best[e], j - ptr[i])
    return order_union(seen[:n_seen], votes, best)


def union_of_sets(sets: Sequence[np.ndarray], size: int = 0) -> np.ndarray:
    """The batch's set from ranked id lists (one per slot): one vote per predicted expert."""
    if len(sets) == 1:  # a batch of one: its own set (the rule's order), without the kernel
        return np.asarray(sets[0][:size] if size > 0 else sets[0], dtype=np.int16)
    ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in sets]) if sets else _NONE
    ptr = np.zeros(len(sets) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(s) for s in sets])
    order = vote_union(ids, ptr, np.arange(len(sets)))
    return (order[:size] if size > 0 else order).astype(np.int16)


def union_of_scores(scores: Iterable[np.ndarray], size: int) -> np.ndarray:
    """The batch's set from every slot's scores ([N] each): their normalised sum, the
    rank of an expert in a slot being its place by that slot's score."""
    weight = best = None
    for s in scores:
        if weight is None:
            weight = np.zeros(len(s))
            best = np.full(len(s), len(s), dtype=np.int64)
        weight += s / max(s.sum(), 1e-300)
        rank = np.empty(len(s), dtype=np.int64)
        rank[np.argsort(-s, kind="mergesort")] = np.arange(len(s))
        np.minimum(best, rank, out=best)
    if weight is None:
        return np.zeros(0, dtype=np.int16)
    return _cut(np.arange(len(weight)), weight, best, size)


def _cut(candidates: np.ndarray, weight: np.ndarray, best: np.ndarray, size: int) -> np.ndarray:
    order = order_union(candidates.astype(np.int64), weight, best)
    return (order[:size] if size > 0 else order).astype(np.int16)
