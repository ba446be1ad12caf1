"""Compiled inner loops of ST-MoE (numba): scoring, the 2-bit table update, and replay.

Why numba: Algorithm 3 updates the tables after every token, so replay is a
sequential loop over T x L steps with a few dozen operations each; numpy cannot
vectorise it across tokens, and a Python loop runs ~20x below the replay target.
The same jitted ``predict_next`` / ``update_row`` serve both the one-step path
(the runtime's ``Predictor.step``) and the whole-trace replay kernel, so the two
paths run one implementation of docs/method.md's algorithms.

Conventions: expert ids are int16 with ``-1`` for an empty slot; CCT rows are
``ids[N, R]`` (int16) and ``conf[N, R]`` (int8, 0..3); scratch arrays are passed in
so a step allocates nothing but its result.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from stmoe.util.jit import njit

EMPTY = -1
CONF_MAX = 3  # 2-bit saturating counter: 0b11, strongly taken (docs/method.md)
CONF_NEW = 2  # new candidates start weakly taken, 0b10 (docs/method.md, Algorithms 1 and 3)


class Scoring(NamedTuple):
    """Algorithm 2's knobs, as ``predict_next`` and ``plan_trace`` take them.

    Pass ``tuple(scoring)`` from Python: numba types a plain tuple in C but a
    namedtuple in Python (~0.7 us a call, measured), and ``predict_next`` runs at
    every layer. The kernels unpack it by position, in this order.
    """

    w_ht: float  # score each HT expert adds
    threshold: float  # keep f when score[f] >= threshold (-inf: every scored expert)
    use_cct: bool  # score the CCT rows of the experts chosen at l
    use_ht: bool  # score HT[l+1]
    max_size: int  # > 0: keep the top ones only

    def for_layer0(self) -> Scoring:
        """Layer 0's scoring: every expert of HT[0] (no CCT row precedes it)."""
        return self._replace(threshold=-np.inf, use_cct=False, use_ht=True)


@njit(cache=True)
def new_scratch(n):  # pragma: no cover - compiled
    """Working memory of one predictor for N experts: (scores, touched, seen)."""
    return np.zeros(n, dtype=np.float64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_)


@njit(cache=True)
def _rank(cands, n, scores):  # pragma: no cover - compiled
    """Insertion-sort ``cands[:n]`` by score descending, then expert id ascending."""
    for i in range(1, n):
        c = cands[i]
        s = scores[c]
        j = i - 1
        while j >= 0 and (scores[cands[j]] < s or (scores[cands[j]] == s and cands[j] > c)):
            cands[j + 1] = cands[j]
            j -= 1
        cands[j + 1] = c


@njit(cache=True)
def predict_next(row_ids, row_conf, chosen, ht, scoring, scratch, out):  # pragma: no cover
    """Algorithm 2 for one token: the prefetch set of layer l+1, most confident first.

    row_ids/row_conf: CCT[l] ([N, R]); chosen: the router's experts at layer l [K];
    ht: HT[l+1] [K]; scoring: a ``Scoring`` as a plain tuple; scratch:
    ``new_scratch(N)`` (left clean on return); out: int16 [N] for the result.
    Returns its length.
    """
    w_ht, threshold, use_cct, use_ht, max_size = scoring
    scores, touched, seen = scratch
    # The "note f when first scored" lines repeat below on purpose: a shared helper
    # measured ~30% slower replay (bench_predictor.py), the hot loop of the project.
    n_touched = 0
    if use_cct:
        for e in chosen:
            if e < 0:
                continue
            for s in range(row_ids.shape[1]):
                f = row_ids[e, s]
                if f < 0:
                    continue
                if not seen[f]:
                    seen[f] = True
                    touched[n_touched] = f
                    n_touched += 1
                scores[f] += row_conf[e, s]
    if use_ht:
        for h in ht:
            if h < 0:
                continue
            if not seen[h]:
                seen[h] = True
                touched[n_touched] = h
                n_touched += 1
            scores[h] += w_ht
    n = 0
    for i in range(n_touched):
        f = touched[i]
        if scores[f] >= threshold:
            out[n] = f
            n += 1
    _rank(out, n, scores)
    if 0 < max_size < n:
        n = max_size
    for i in range(n_touched):  # leave the scratch clean for the next call
        scores[touched[i]] = 0.0
        seen[touched[i]] = False
    return n


@njit(cache=True)
def update_row(row_ids, row_conf, chosen, actual, in_actual):  # pragma: no cover - compiled
    """Algorithm 3 for CCT[l]: the router chose ``chosen`` at l, then ``actual`` at l+1.

    Taken candidates count up (saturating at 3), others count down, a candidate
    at 0 that is not taken frees its slot; freed and empty slots are then filled,
    in slot order, with the experts of ``actual`` not yet in the row, in router
    order, at confidence 2. ``in_actual``: bool [N] scratch, all False.
    """
    for a in actual:
        if a >= 0:
            in_actual[a] = True
    width = row_ids.shape[1]
    for e in chosen:
        if e < 0:
            continue
        for s in range(width):
            f = row_ids[e, s]
            if f < 0:
                continue
            if in_actual[f]:
                if row_conf[e, s] < CONF_MAX:
                    row_conf[e, s] += 1
            elif row_conf[e, s] > 0:
                row_conf[e, s] -= 1
            else:
                row_ids[e, s] = EMPTY
        for a in actual:
            if a < 0:
                continue
            present = False
            free = -1
            for s in range(width):
                if row_ids[e, s] == a:
                    present = True
                    break
                if free < 0 and row_ids[e, s] < 0:
                    free = s
            if present:
                continue
            if free < 0:
                break  # row full: the remaining experts of A find no slot
            row_ids[e, free] = a
            row_conf[e, free] = CONF_NEW
    for a in actual:
        if a >= 0:
            in_actual[a] = False


@njit(cache=True)
def plan_trace(
    experts, new_seq, cct_ids, cct_conf, scoring, online, layer0_ht, num_experts
):  # pragma: no cover - compiled
    """Replay a whole trace in docs/method.md's order; return the ranked prefetch set of every
    (token, layer) as CSR arrays ``ptr [T*L+1]``, ``ids [M]``.

    Per token: for each layer l, predict l's set (layer 0 from HT[0] alone, when
    ``layer0_ht``), then learn CCT[l-1] from (chosen at l-1, chosen at l) when
    ``online``; after the token, HT = its experts. HT empties at each sequence
    start; the CCT is shared. ``cct_ids``/``cct_conf`` are updated in place.
    ``scoring``: a ``Scoring`` as a plain tuple.
    """
    w_ht, _, _, use_ht, max_size = scoring
    layer0 = (w_ht, -np.inf, False, True, max_size)  # Scoring.for_layer0
    t_count, n_layers, k = experts.shape
    ptr = np.zeros(t_count * n_layers + 1, dtype=np.int64)
    ids = np.empty(max(16, t_count * n_layers * k), dtype=np.int16)
    scratch = new_scratch(num_experts)
    out = np.empty(num_experts, dtype=np.int16)
    ht = np.full((n_layers, k), EMPTY, dtype=np.int16)
    empty_row_ids = np.full((1, 1), EMPTY, dtype=np.int16)
    empty_row_conf = np.zeros((1, 1), dtype=np.int8)
    no_chosen = np.full(1, EMPTY, dtype=np.int16)
    for t in range(t_count):
        if new_seq[t]:
            ht[:, :] = EMPTY
        for layer in range(n_layers):
            idx = t * n_layers + layer
            if layer == 0:
                n = 0
                if layer0_ht and use_ht:
                    n = predict_next(empty_row_ids, empty_row_conf, no_chosen, ht[0], layer0,
                                     scratch, out)
            else:
                n = predict_next(cct_ids[layer - 1], cct_conf[layer - 1], experts[t, layer - 1],
                                 ht[layer], scoring, scratch, out)
            start = ptr[idx]
            if start + n > ids.shape[0]:
                grown = np.empty(2 * ids.shape[0] + n, dtype=np.int16)
                grown[:start] = ids[:start]
                ids = grown
            ids[start : start + n] = out[:n]
            ptr[idx + 1] = start + n
            if online and layer > 0:
                update_row(
                    cct_ids[layer - 1],
                    cct_conf[layer - 1],
                    experts[t, layer - 1],
                    experts[t, layer],
                    scratch[2],
                )
        ht[:, :] = experts[t]
    return ptr, ids[: ptr[-1]].copy()


@njit(cache=True)
def plan_hits(experts, ptr, ids, num_experts, max_sizes, curve_mask):  # pragma: no cover
    """Per (token, layer): |P ∩ A|, |P|, |A|; and, over ``curve_mask``, the hits and
    set sizes when each set is cut to its first ``b`` experts, for every b in ``max_sizes``."""
    t_count, n_layers = experts.shape[0], experts.shape[1]
    hits = np.zeros((t_count, n_layers), dtype=np.int32)
    sizes = np.zeros((t_count, n_layers), dtype=np.int32)
    actual = np.zeros((t_count, n_layers), dtype=np.int32)
    curve_hits = np.zeros(max_sizes.shape[0], dtype=np.int64)
    curve_sizes = np.zeros(max_sizes.shape[0], dtype=np.int64)
    in_actual = np.zeros(num_experts, dtype=np.bool_)
    prefix = np.zeros(num_experts + 1, dtype=np.int64)
    for t in range(t_count):
        for layer in range(n_layers):
            a_count = 0
            for a in experts[t, layer]:
                if a >= 0:
                    in_actual[a] = True
                    a_count += 1
            start, stop = ptr[t * n_layers + layer], ptr[t * n_layers + layer + 1]
            n = stop - start
            h = 0
            for i in range(n):
                if in_actual[ids[start + i]]:
                    h += 1
                prefix[i + 1] = h
            hits[t, layer] = h
            sizes[t, layer] = n
            actual[t, layer] = a_count
            if curve_mask[t, layer]:
                for j in range(max_sizes.shape[0]):
                    b = min(max_sizes[j], n)
                    curve_hits[j] += prefix[b]
                    curve_sizes[j] += b
            for a in experts[t, layer]:
                if a >= 0:
                    in_actual[a] = False
    return hits, sizes, actual, curve_hits, curve_sizes
