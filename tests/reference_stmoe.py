"""A literal, slow, pure-Python reading of docs/method.md's ST-MoE, written independently of
the package's compiled kernels so tests can compare the two."""

from __future__ import annotations

import numpy as np


def profile_reference(experts: np.ndarray, n: int, width: int) -> list[list[list[list[int]]]]:
    """Algorithm 1: cct[l][e] = [[f, c], ...] over a [T, L, K] array."""
    t_count, n_layers, _ = experts.shape
    cct = []
    for layer in range(n_layers - 1):
        co = np.zeros((n, n), dtype=np.int64)
        for t in range(t_count):
            for e in experts[t, layer]:
                for f in experts[t, layer + 1]:
                    if e >= 0 and f >= 0:
                        co[e, f] += 1
        rows = []
        for e in range(n):
            ranked = sorted(range(n), key=lambda f: (-co[e, f], f))
            rows.append([[f, 2] for f in ranked[:width] if co[e, f] > 0])
        cct.append(rows)
    return cct


def predict_reference(row_lists, chosen, ht, w_ht=1.0, threshold=2.0):
    """Algorithm 2: the prefetch set, ranked by score then id."""
    score: dict[int, float] = {}
    for e in chosen:
        if e < 0:
            continue
        for f, c in row_lists[e]:
            score[f] = score.get(f, 0) + c
    for h in ht:
        if h >= 0:
            score[h] = score.get(h, 0) + w_ht
    kept = [f for f, s in score.items() if s >= threshold]
    return sorted(kept, key=lambda f: (-score[f], f))


def update_reference(row_lists, chosen, actual, width):
    """Algorithm 3 on one table: rows are lists of [f, c] with None for a free slot."""
    actual = [a for a in actual if a >= 0]
    for e in chosen:
        if e < 0:
            continue
        row = row_lists[e] + [None] * (width - len(row_lists[e]))
        for s, slot in enumerate(row):
            if slot is None:
                continue
            f, c = slot
            if f in actual:
                row[s] = [f, min(3, c + 1)]
            elif c > 0:
                row[s] = [f, c - 1]
            else:
                row[s] = None
        present = {slot[0] for slot in row if slot is not None}
        for a in actual:
            if a in present:
                continue
            free = next((s for s, slot in enumerate(row) if slot is None), None)
            if free is None:
                break
            row[free] = [a, 2]
            present.add(a)
        row_lists[e] = row


def row_as_list(row):
    return [slot for slot in row if slot is not None]


def replay_reference(
    experts, seq_starts, cct, width, *, use_ht=True, online=True, threshold=2.0, w_ht=1.0
):
    """Every (token, layer) prefetch set, docs/method.md order, layer 0 = all of HT[0]."""
    t_count, n_layers, _ = experts.shape
    starts = set(int(s) for s in seq_starts)
    ht = None
    sets = []
    for t in range(t_count):
        if t in starts:
            ht = None
        for layer in range(n_layers):
            hist = [] if ht is None or not use_ht else list(ht[layer])
            if layer == 0:
                sets.append(sorted(h for h in hist if h >= 0))
            else:
                rows = [row_as_list(r) for r in cct[layer - 1]]
                sets.append(predict_reference(rows, experts[t, layer - 1], hist, w_ht, threshold))
                if online:
                    update_reference(
                        cct[layer - 1], list(experts[t, layer - 1]), list(experts[t, layer]), width
                    )
        ht = experts[t].tolist()
    return sets
