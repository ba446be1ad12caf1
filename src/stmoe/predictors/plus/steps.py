"""The compiled protocol of stmoe-plus and hybrid: learn one layer, predict one
layer, and the whole-trace replay that does both for every token and layer.

Learning updates, in the counts' scale (state.py), the pair counts of the layer
just routed against the token's earlier layers and the previous token, the
sequence's recency (an exponential moving average, factor ``gamma``) and the
token's similarity to every memory token: over its layers 0..l,
``sum over l' <= l of sim_decay ** (l - l') * overlap at l'``. A finished token
enters the token memory, evicting the oldest.

The kernels take the groups of state.py; those called from Python take them as
plain tuples and name them first.
"""

from __future__ import annotations

import numpy as np

from stmoe.predictors.base import ModelShape
from stmoe.predictors.plus.scoring import plus_scores, scores_for
from stmoe.predictors.plus.sizing import set_size, top_by_score
from stmoe.predictors.plus.state import (
    MEMORY_TOKENS,
    Buffers,
    Counts,
    FitFeatures,
    Settings,
    Stream,
    Token,
    TokenMemory,
)
from stmoe.util.jit import njit

# the pair counts are float32 (half the cache traffic of the hot rows): the scale is
# brought back by RESCALE_BY whenever it passes RESCALE_AT, far below overflow
RESCALE_AT = 1e30
RESCALE_BY = 1e-30


def memory_of(shape: ModelShape, recent: np.ndarray | None) -> TokenMemory:
    """A token memory holding the last MEMORY_TOKENS tokens of ``recent`` [M, L, K]."""
    memory = TokenMemory.empty(shape)
    if recent is not None:
        plain = tuple(memory)
        for token in np.asarray(recent, dtype=np.int16)[-MEMORY_TOKENS:]:
            memory_add(plain, token)
    return memory


@njit(cache=True)
def memory_similarity(chose, cur, layer, lam, sim):  # pragma: no cover - compiled
    """sim[layer] := lam * sim[layer - 1] + overlap of cur[layer] with every memory
    token's layer-``layer`` set (``chose``: TokenMemory.chose): the similarity over
    the token's layers 0..layer, nearer layers weighing more when lam < 1."""
    width = sim.shape[1]
    if layer > 0:
        for j in range(width):
            sim[layer, j] = lam * sim[layer - 1, j]
    else:
        sim[layer, :] = 0.0
    for e in cur[layer]:
        if e >= 0:
            row = chose[layer, e]
            for j in range(width):
                sim[layer, j] += row[j]


@njit(cache=True)
def memory_add(memory, cur):  # pragma: no cover - compiled
    """Put a finished token's [L, K] experts into the ring, evicting the oldest when full."""
    memory = TokenMemory(*memory)
    mcol, mset, ring = memory.chose, memory.experts, memory.ring
    width = mset.shape[1]
    slot = ring[1]
    if ring[0] == width:
        for layer in range(mset.shape[0]):
            for e in mset[layer, slot]:
                if e >= 0:
                    mcol[layer, e, slot] = 0
    for layer in range(mset.shape[0]):
        for a in range(mset.shape[2]):
            e = cur[layer, a]
            mset[layer, slot, a] = e
            if e >= 0:
                mcol[layer, e, slot] = 1
    ring[1] = (slot + 1) % width
    ring[0] = min(ring[0] + 1, width)


@njit(cache=True)
def recency_update(rc, cur, layer, gamma):  # pragma: no cover - compiled
    """The sequence's recency of layer ``layer`` after the router chose cur[layer]."""
    for f in range(rc.shape[1]):
        rc[layer, f] *= gamma
    for f in cur[layer]:
        if f >= 0:
            rc[layer, f] += 1.0 - gamma


@njit(cache=True)
def count_update(counts, token, layer, s):  # pragma: no cover - compiled
    """Count the router's choice at ``layer`` (token.experts[layer]) against the
    token's earlier layers and the previous token, adding ``s`` each."""
    cur = token.experts
    d_max = counts.pairs.shape[0]
    chosen = cur[layer]
    for f in chosen:
        if f >= 0:
            counts.expert_counts[layer, f] += s
    counts.layer_tokens[layer] += s
    for d in range(1, d_max + 1):
        src = layer - d
        if src < 0:
            break
        for e in cur[src]:
            if e < 0:
                continue
            counts.pair_totals[d - 1, src, e] += s
            for f in chosen:
                if f >= 0:
                    counts.pairs[d - 1, src, e, f] += s
    if token.has_previous:
        for e in token.previous[layer]:
            if e < 0:
                continue
            counts.temporal_totals[layer, e] += s
            for f in chosen:
                if f >= 0:
                    counts.temporal[layer, e, f] += s


@njit(cache=True)
def rescale(counts):  # pragma: no cover - compiled
    """Bring every count down by RESCALE_BY (the scale comes down with them)."""
    counts = Counts(*counts)
    pairs, pair_totals = counts.pairs, counts.pair_totals
    temporal, temporal_totals = counts.temporal, counts.temporal_totals
    expert_counts, layer_tokens = counts.expert_counts, counts.layer_tokens
    pairs *= RESCALE_BY  # (in place, as every in-place operator on an array)
    pair_totals *= RESCALE_BY
    temporal *= RESCALE_BY
    temporal_totals *= RESCALE_BY
    expert_counts *= RESCALE_BY
    layer_tokens *= RESCALE_BY


@njit(cache=True)
def plus_learn(counts, chose, token, layer, gamma, sim_decay, online,
               s):  # pragma: no cover - compiled
    """Everything ``update`` does for one layer, in one compiled call. (The settings
    it needs come singly, and of the memory only ``chose``: every array or tuple
    item crossing from Python costs dispatch time, and this runs at every layer.)"""
    counts, token = Counts(*counts), Token(*token)
    recency_update(token.recency, token.experts, layer, gamma)
    memory_similarity(chose, token.experts, layer, sim_decay, token.similarity)
    if online:
        count_update(counts, token, layer, s)


@njit(cache=True)
def plus_predict(counts, memory, token, target, settings, s,
                 buf):  # pragma: no cover - compiled
    """Everything ``predict`` does, in one compiled call: the set in buf.top[:size];
    returns the size."""
    settings, buf = Settings(*settings), Buffers(*buf)
    scores_for(counts, memory, token, target, settings, s, buf, settings.adaptive)
    b = set_size(buf.scores, settings.set_size, settings.adaptive, buf.sizing, settings.cap,
                 target)
    top_by_score(buf.scores, b, buf.top)
    return b


@njit(cache=True)
def plus_replay(counts, memory, stream, settings, s, buf,
                features):  # pragma: no cover - compiled
    """The whole-trace replay of the protocol: predict(l) then update(l) for every
    token and layer. Returns (ptr, ids, scale) with PrefetchPlan's CSR arrays.

    The fit's features (state.FitFeatures): signal i's scores for each recorded
    token and layer (plus_scores with weight 1 on signal i alone), exactly the
    terms the weights multiply."""
    counts, memory, stream = Counts(*counts), TokenMemory(*memory), Stream(*stream)
    settings, buf, features = Settings(*settings), Buffers(*buf), FitFeatures(*features)
    experts, rows, feats = stream.experts, features.rows, features.feats
    t_len, n_layers, k = experts.shape
    n = counts.expert_counts.shape[1]
    width = settings.cap
    ptr = np.zeros(t_len * n_layers + 1, dtype=np.int64)
    ids = np.empty(t_len * n_layers * max(width, 1), dtype=np.int16)
    cur = np.full((n_layers, k), -1, dtype=np.int16)
    prev = np.full((n_layers, k), -1, dtype=np.int16)
    rc = np.zeros((n_layers, n))
    sim = np.zeros((n_layers, memory.experts.shape[1]), dtype=np.float32)
    unit = np.zeros(settings.rows.shape[1])
    has_prev = False
    pos = 0
    for t in range(t_len):
        if t == 0 or stream.seq_id[t] != stream.seq_id[t - 1]:
            has_prev = False
            rc[:, :] = 0.0
        cur[:, :] = -1
        for layer in range(n_layers):
            known = max(layer - settings.horizon, -1)
            look = stream.lookahead[t, layer] if stream.has_lookahead else stream.lookahead[0, 0]
            added = stream.has_lookahead and settings.horizon == 1 and layer > 0
            token = Token(cur, known, prev, has_prev, rc, sim, look, added)
            if rows.shape[0] > 0 and rows[t] >= 0:
                for i in range(feats.shape[2]):
                    unit[:] = 0.0
                    unit[i] = 1.0
                    plus_scores(counts, memory, token, layer, unit, settings, s, buf)
                    feats[rows[t], layer, i] = buf.scores
            scores_for(counts, memory, token, layer, settings, s, buf, settings.adaptive)
            b = set_size(buf.scores, settings.set_size, settings.adaptive, buf.sizing, width, layer)
            top_by_score(buf.scores, b, buf.top)
            for i in range(b):
                ids[pos + i] = buf.top[i]
            pos += b
            ptr[t * n_layers + layer + 1] = pos
            cur[layer] = experts[t, layer]
            plus_learn(counts, memory.chose, token, layer, settings.gamma, settings.sim_decay,
                       settings.online, s)
        prev[:, :] = cur
        has_prev = True
        if settings.online:
            memory_add(memory, cur)
            s /= settings.decay
            if s > RESCALE_AT:
                rescale(counts)
                s *= RESCALE_BY
    return ptr, ids[:pos].copy(), s


@njit(cache=True)
def plan_recall(experts, ptr, ids):  # pragma: no cover - compiled
    """Recall of a plan over layers 1..L-1 of every token (the fit's objective)."""
    t_len, n_layers, k = experts.shape
    hits = 0
    total = 0
    for t in range(t_len):
        for layer in range(1, n_layers):
            i = t * n_layers + layer
            for a in range(k):
                e = experts[t, layer, a]
                if e < 0:
                    continue
                total += 1
                for j in range(ptr[i], ptr[i + 1]):
                    if ids[j] == e:
                        hits += 1
                        break
    return hits / total if total > 0 else 0.0
