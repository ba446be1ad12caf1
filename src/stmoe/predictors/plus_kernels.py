"""Compiled inner loops of the probabilistic table predictors (stmoe-plus, hybrid).

The state is plain count arrays kept in one *scale*: every new observation adds
``s`` instead of 1, and ``s`` grows by ``1/decay`` per token, so older counts
weigh less without touching them (exponential forgetting at O(K^2) per update).

    co[d-1, l, e, f]  tokens with e at layer l and f at layer l+d   (d = 1..D)
    r[d-1, l, e]      tokens with e at layer l (and a layer l+d)
    tt[l, e, f]       consecutive tokens of a sequence: e at l, then f at l
    rt[l, e]          tokens followed in their sequence, with e at l
    p[l, f], z[l]     tokens choosing f at l; tokens seen at l
    rc[l, f]          (per sequence) recency: an exponential moving average over the
                      sequence's tokens of "f chosen at l", factor ``gamma``

Token memory (a ring of the last W tokens' routing, the profiling trace's last
tokens first; a nearest-neighbour vote):

    mcol[l, e, j]     1 if memory token j chose e at layer l (uint8)
    mset[l, j, :]     memory token j's experts at layer l;  mstate = [filled, next slot]
    sim[l, j]         similarity of the current token to memory token j over its
                      layers 0..l: sum over l' <= l of lam ** (l - l') * overlap at l'

The vote for the target layer weighs each memory token by (its similarity over
the known layers / the best one) ** power: with a high power only the nearest
neighbours count, tokens that agree on many experts at once, which pairwise
counts cannot express.

A signal is a linear pool of smoothed conditionals: for source experts S,
``mean_{e in S} (C[e, f] + a * prior[f]) / (R[e] + a)``; a missing source falls
back to the prior. Scores are a weighted sum of the signals, the prior and a
constant: with the grid's weights (>= 0) a linear pool of probabilities, with
logistic weights the log-odds that f is chosen (``to_probability`` turns them
into probabilities where set sizes or the lookahead fusion need them).
"""

from __future__ import annotations

import math

import numpy as np

from stmoe._numba import njit

D_MAX = 4  # farthest layer distance counted: l -> l+4 (second order at horizon 3)
# the pair counts (co, tt) are float32 (half the cache traffic of the hot rows): the
# scale is brought back by RESCALE_BY whenever it passes RESCALE_AT, far below overflow
RESCALE_AT = 1e30
RESCALE_BY = 1e-30
LOG_CUT_MIN = np.log(1e-12)  # the adaptive threshold's floor (a share of the scores)


@njit(cache=True)
def count_pairs(experts, seq_id, n, d_max):  # pragma: no cover - compiled
    """Profiling counts of a trace: (co [D, L-1, N, N], tt [L, N, N]) as float64."""
    t_len, n_layers, k = experts.shape
    co = np.zeros((d_max, max(n_layers - 1, 1), n, n), dtype=np.float64)
    tt = np.zeros((n_layers, n, n), dtype=np.float64)
    for t in range(t_len):
        follows = t > 0 and seq_id[t] == seq_id[t - 1]
        for layer in range(n_layers):
            for d in range(1, d_max + 1):
                if layer + d >= n_layers:
                    break
                for a in range(k):
                    e = experts[t, layer, a]
                    if e < 0:
                        continue
                    for b in range(k):
                        f = experts[t, layer + d, b]
                        if f >= 0:
                            co[d - 1, layer, e, f] += 1.0
            if follows:
                for a in range(k):
                    e = experts[t - 1, layer, a]
                    if e < 0:
                        continue
                    for b in range(k):
                        f = experts[t, layer, b]
                        if f >= 0:
                            tt[layer, e, f] += 1.0
    return co, tt


@njit(cache=True)
def _prior(p, z, target, s, prior):  # pragma: no cover - compiled
    n = p.shape[1]
    total = 0.0
    for f in range(n):
        prior[f] = p[target, f] + 0.5 * s
        total += prior[f]
    for f in range(n):
        prior[f] /= total


@njit(cache=True)
def _add_signal(c, r, src, prior, a, w, out):  # pragma: no cover - compiled
    """out += w * mean over valid e in src of (c[e, :] + a * prior) / (r[e] + a)."""
    n = out.shape[0]
    if w == 0.0:
        return
    valid = 0
    for e in src:
        if e >= 0:
            valid += 1
    if valid == 0:
        for f in range(n):
            out[f] += w * prior[f]
        return
    prior_share = 0.0
    for e in src:
        if e < 0:
            continue
        inv = w / (valid * (r[e] + a))
        prior_share += a * inv
        row = c[e]
        for f in range(n):
            out[f] += row[f] * inv
    for f in range(n):
        out[f] += prior_share * prior[f]


@njit(cache=True)
def memory_similarity(mcol, cur, layer, lam, sim):  # pragma: no cover - compiled
    """sim[layer] := lam * sim[layer - 1] + overlap of cur[layer] with every memory
    token's layer-``layer`` set: the similarity over the token's layers 0..layer,
    nearer layers weighing more when lam < 1."""
    width = sim.shape[1]
    if layer > 0:
        for j in range(width):
            sim[layer, j] = lam * sim[layer - 1, j]
    else:
        sim[layer, :] = 0.0
    for e in cur[layer]:
        if e >= 0:
            row = mcol[layer, e]
            for j in range(width):
                sim[layer, j] += row[j]


@njit(cache=True)
def _power(x, power):  # pragma: no cover - compiled
    """x ** power, by squaring for the fitted exponents 4, 8, 16, 32 (pow is slow)."""
    if power == 4.0 or power == 8.0 or power == 16.0 or power == 32.0:
        y = x * x
        y = y * y
        if power >= 8.0:
            y = y * y
        if power >= 16.0:
            y = y * y
        if power >= 32.0:
            y = y * y
        return y
    return x**power


@njit(cache=True)
def memory_vote(mset, mstate, sim, known, target, power, votes, narrow, votes4):  # pragma: no cover
    """votes[f] := sum over memory tokens choosing f at ``target`` of
    (similarity / best similarity) ** power; tokens whose weight would be below
    1e-3 are skipped (with a high power only the nearest neighbours count). With
    ``narrow``, votes4 gets the same at power * 4 (the nearest of the near; weights
    under 1e-4 skipped). Returns both totals."""
    votes[:] = 0.0
    if narrow:
        votes4[:] = 0.0
    total = 0.0
    total4 = 0.0
    if known < 0:
        return total, total4
    row = sim[known]
    filled = mstate[0]
    best = 0.0
    for j in range(filled):
        if row[j] > best:
            best = row[j]
    if best <= 0.0:
        return total, total4
    cut = best * 0.001 ** (1.0 / power)
    inv = 1.0 / best
    k = mset.shape[2]
    # the near tokens' slots first, without branches (a mispredicted branch per
    # memory token costs more than the vote itself)
    near = np.empty(filled, dtype=np.int32)
    m = 0
    for j in range(filled):
        near[m] = j
        m += row[j] >= cut
    for i in range(m):
        j = near[i]
        wgt = _power(row[j] * inv, power)
        for a in range(k):  # (indexing, not a row view: this loop is the hot one)
            f = mset[target, j, a]
            if f >= 0:
                votes[f] += wgt
        if narrow and wgt >= 0.1:  # (below, the narrow weight wgt ** 4 is under 1e-4)
            w4 = wgt * wgt
            w4 = w4 * w4
            for a in range(k):
                f = mset[target, j, a]
                if f >= 0:
                    votes4[f] += w4
    for f in range(votes.shape[0]):
        total += votes[f]
    if narrow:
        for f in range(votes4.shape[0]):
            total4 += votes4[f]
    return total, total4


@njit(cache=True)
def memory_add(mcol, mset, mstate, cur):  # pragma: no cover - compiled
    """Put a finished token into the ring, evicting the oldest when full."""
    width = mset.shape[1]
    slot = mstate[1]
    if mstate[0] == width:
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
    mstate[1] = (slot + 1) % width
    mstate[0] = min(mstate[0] + 1, width)


@njit(cache=True)
def plus_scores(co, r, tt, rt, p, z, cur, known, prev, has_prev, target, w, alpha, s,
                prior, out, rc, mset, mstate, sim, power, votes):  # fmt: skip  # pragma: no cover
    """Scores of every expert for ``target`` given the token's layers 0..known (-1: none).

    w = (spatial from layers known, known-1, known-2, known-3; temporal (previous
    token at the target layer); prior; recency; token memory at ``power``; token
    memory at 4 * ``power``; a constant). The scores are the weighted sum: a
    linear pool (weights >= 0) or, with logistic weights, the log-odds of each
    expert being chosen. votes: a [2, N] buffer.
    """
    n = out.shape[0]
    k = cur.shape[1]
    d_max = co.shape[0]
    a = alpha * s
    _prior(p, z, target, s, prior)
    for f in range(n):
        out[f] = w[9]
    h = target - known
    for j in range(4):  # the token's layers known, known-1, ..., at distance h+j
        src = known - j
        if src >= 0 and 1 <= h + j <= d_max:
            _add_signal(co[h + j - 1, src], r[h + j - 1, src], cur[src], prior, a, w[j], out)
        elif w[j] != 0.0:
            for f in range(n):
                out[f] += w[j] * prior[f]
    if has_prev:
        _add_signal(tt[target], rt[target], prev[target], prior, a, w[4], out)
    elif w[4] != 0.0:
        for f in range(n):
            out[f] += w[4] * prior[f]
    for f in range(n):
        out[f] += w[5] * prior[f] + w[6] * rc[target, f] / k
    if w[7] != 0.0 or w[8] != 0.0:
        total, total4 = memory_vote(mset, mstate, sim, known, target, power, votes[0],
                                    w[8] != 0.0, votes[1])  # fmt: skip
        for i in range(2):
            wi = w[7 + i]
            if wi == 0.0:
                continue
            tot = total if i == 0 else total4
            if tot > 0.0:
                c = wi * k / tot
                for f in range(n):
                    out[f] += c * votes[i, f]
            else:
                for f in range(n):
                    out[f] += wi * prior[f]


@njit(cache=True)
def to_probability(scores):  # pragma: no cover - compiled
    """Log-odds to probabilities, in place (logistic weights only; exp in float32,
    twice as fast, precise enough for sizing sets)."""
    for f in range(scores.shape[0]):
        scores[f] = 1.0 / (1.0 + math.exp(np.float32(-scores[f])))


@njit(cache=True)
def recency_update(rc, cur, layer, gamma):  # pragma: no cover - compiled
    """The sequence's recency of layer ``layer`` after the router chose cur[layer]."""
    for f in range(rc.shape[1]):
        rc[layer, f] *= gamma
    for f in cur[layer]:
        if f >= 0:
            rc[layer, f] += 1.0 - gamma


@njit(cache=True)
def plus_update(co, r, tt, rt, p, z, cur, prev, has_prev, layer, s):  # pragma: no cover
    """Count the router's choice at ``layer`` (cur[layer]) against earlier layers and
    the previous token."""
    d_max = co.shape[0]
    chosen = cur[layer]
    for f in chosen:
        if f >= 0:
            p[layer, f] += s
    z[layer] += s
    for d in range(1, d_max + 1):
        src = layer - d
        if src < 0:
            break
        for e in cur[src]:
            if e < 0:
                continue
            r[d - 1, src, e] += s
            for f in chosen:
                if f >= 0:
                    co[d - 1, src, e, f] += s
    if has_prev:
        for e in prev[layer]:
            if e < 0:
                continue
            rt[layer, e] += s
            for f in chosen:
                if f >= 0:
                    tt[layer, e, f] += s


@njit(cache=True)
def top_by_score(scores, budget, out):  # pragma: no cover - compiled
    """The ``budget`` best experts, highest score first, ties to the smaller id
    (insertion into a short sorted list: budget is small next to N)."""
    m = 0
    if budget <= 0:
        return 0
    for f in range(scores.shape[0]):
        s = scores[f]
        if m == budget and s <= scores[out[m - 1]]:
            continue
        i = m if m < budget else budget - 1
        while i > 0 and scores[out[i - 1]] < s:
            out[i] = out[i - 1]
            i -= 1
        out[i] = f
        if m < budget:
            m += 1
    return m


@njit(cache=True)
def set_size(scores, budget, adaptive, ctl, cap, target):  # pragma: no cover - compiled
    """How many experts this prediction gets; the mean over predictions is ``budget``.

    Fixed: ``budget`` itself, fractional budgets realised by carrying the remainder
    (5.5 gives 5, 6, 5, 6, ...). Adaptive (layers after the first): every expert
    whose share of the scores clears one common threshold, steered so the mean
    size stays ``budget``. The experts most likely to be picked anywhere are taken
    first (the choice that maximises expected hits for a mean budget): a
    prediction unsure between several plausible experts gets a larger set, a
    confident one little more than its K favourites, and one with no plausible
    expert at all (scores flat over all N) stays small, since no expert there is
    worth a transfer. ctl = [remainder, log threshold (0: not yet set)].
    """
    if adaptive and target > 0:
        total = 0.0
        for f in range(scores.shape[0]):
            total += scores[f]
        if total > 0.0:
            if ctl[1] == 0.0:  # start at this prediction's budget-th share
                ranked = np.sort(scores)[::-1]
                i = min(max(int(budget) - 1, 0), scores.shape[0] - 1)
                ctl[1] = np.log(max(ranked[i] / total, 1e-12))
            cut = np.exp(ctl[1]) * total
            b = 0
            for f in range(scores.shape[0]):
                if scores[f] >= cut and scores[f] > 0.0:  # never an expert scored 0
                    b += 1
            b = max(1 if budget >= 1 else 0, min(b, cap))
            # steer towards the mean; bounded, so predictions with fewer candidates
            # than the budget cannot wind the threshold down (or a budget < 1 up) forever
            step = 0.02 * (b - budget) / max(budget, 1e-9)
            ctl[1] = min(max(ctl[1] + step, LOG_CUT_MIN), -1e-9)
            return b
    ctl[0] += budget
    b = int(np.floor(ctl[0]))
    b = max(1 if budget >= 1 else 0, min(b, cap))
    ctl[0] -= b
    return b


@njit(cache=True)
def _rescale(co, r, tt, rt, p, z):  # pragma: no cover - compiled
    co *= RESCALE_BY
    r *= RESCALE_BY
    tt *= RESCALE_BY
    rt *= RESCALE_BY
    p *= RESCALE_BY
    z *= RESCALE_BY


@njit(cache=True)
def _fuse(scores, look, beta):  # pragma: no cover - compiled
    """scores := (1 - beta) * scores / sum + beta * rank weights of the lookahead ids.

    With beta = 1 the tables keep a vanishing weight: the lookahead's ids come
    first and the tables still order the rest (not the expert ids)."""
    total = 0.0
    for f in range(scores.shape[0]):
        total += scores[f]
    keep = max(1.0 - beta, 1e-6)
    if total > 0:
        for f in range(scores.shape[0]):
            scores[f] *= keep / total
    add_rank_weights(scores, look, beta)


@njit(cache=True)
def weight_row(known, has_prev, added, look_logit):  # pragma: no cover - compiled
    """Which of the [4, 10] weight rows a prediction takes: 0 with layers of the token
    known, 1 with none known yet (layer 0, layers below the horizon), 2 with the
    lookahead joined to the log-odds, 3 at a sequence's first token before its
    layers (nothing but the prior known)."""
    if known < 0:
        return 1 if has_prev else 3
    return 2 if added and look_logit else 0


@njit(cache=True)
def has_ids(look):  # pragma: no cover - compiled
    """Whether a lookahead row holds any expert id (-1 is empty)."""
    for f in look:  # noqa: SIM110 - a plain loop compiles to no allocation
        if f >= 0:
            return True
    return False


@njit(cache=True)
def add_rank_weights(scores, look, weight):  # pragma: no cover - compiled
    """scores += weight * the lookahead's rank weights: m, m-1, ..., 1 over its m
    ranked ids (-1 skipped), normalised to sum 1."""
    m = 0
    for f in look:
        if f >= 0:
            m += 1
    norm = m * (m + 1) / 2.0
    i = 0
    for f in look:
        if f >= 0:
            scores[f] += weight * (m - i) / norm
            i += 1


@njit(cache=True)
def with_lookahead(scores, look, use_look, beta, logistic, look_logit,
                   adaptive):  # fmt: skip  # pragma: no cover - compiled
    """Turn the table scores into what the set is chosen from, in place.

    look_logit (hybrid with logistic weights fitted with the lookahead): the
    lookahead's rank weights times ``beta`` join the log-odds as one more signal.
    Otherwise logistic log-odds become probabilities where set sizes or the
    fusion need them, and the lookahead is fused by ``_fuse`` with weight beta.
    With ``adaptive`` the result is always a probability-like score (>= 0)."""
    if use_look and look_logit:
        add_rank_weights(scores, look, beta)
        if adaptive:
            to_probability(scores)
        return
    if logistic and (adaptive or use_look):
        to_probability(scores)
    if use_look:
        _fuse(scores, look, beta)


@njit(cache=True)
def plus_replay(co, r, tt, rt, p, z, experts, seq_id, look, use_look, w, beta, alpha, decay,
                online, budget, adaptive, ctl, horizon, cap, scale, gamma, mcol, mset,
                mstate, power, lam, logistic, look_logit, rows,
                feats):  # fmt: skip  # pragma: no cover - compiled
    """The whole-trace replay of the protocol: predict(l) then update(l) for every
    token and layer. Returns (ptr, ids, scale) with PrefetchPlan's CSR arrays.
    w: [4, 10] weight rows, one per prediction as ``weight_row`` picks.

    The fit's features: for tokens t with rows[t] >= 0, feats[rows[t], l, i] :=
    signal i's scores for layer l (plus_scores with weight 1 on signal i alone),
    exactly the terms the weights multiply."""
    t_len, n_layers, k = experts.shape
    n = p.shape[1]
    width = cap
    ptr = np.zeros(t_len * n_layers + 1, dtype=np.int64)
    ids = np.empty(t_len * n_layers * max(width, 1), dtype=np.int16)
    cur = np.full((n_layers, k), -1, dtype=np.int16)
    prev = np.full((n_layers, k), -1, dtype=np.int16)
    prior = np.zeros(n)
    scores = np.zeros(n)
    out = np.zeros(n, dtype=np.int64)
    rc = np.zeros((n_layers, n))
    sim = np.zeros((n_layers, mset.shape[1]), dtype=np.float32)
    votes = np.zeros((2, n))
    unit = np.zeros(w.shape[1])
    has_prev = False
    pos = 0
    for t in range(t_len):
        if t == 0 or seq_id[t] != seq_id[t - 1]:
            has_prev = False
            rc[:, :] = 0.0
        cur[:, :] = -1
        for layer in range(n_layers):
            known = max(layer - horizon, -1)
            if rows.shape[0] > 0 and rows[t] >= 0:
                for i in range(feats.shape[2]):
                    unit[:] = 0.0
                    unit[i] = 1.0
                    plus_scores(co, r, tt, rt, p, z, cur, known, prev, has_prev, layer, unit,
                                alpha, scale, prior, scores, rc, mset, mstate, sim, power,
                                votes)  # fmt: skip
                    feats[rows[t], layer, i] = scores
            lk = look[t, layer] if use_look else look[0, 0]
            added = use_look and horizon == 1 and layer > 0
            scores_for(co, r, tt, rt, p, z, cur, known, prev, has_prev, layer, w, alpha, scale,
                       prior, scores, rc, mset, mstate, sim, power, votes, lk, added, beta,
                       logistic, look_logit, adaptive)  # fmt: skip
            b = set_size(scores, budget, adaptive, ctl, cap, layer)
            top_by_score(scores, b, out)
            for i in range(b):
                ids[pos + i] = out[i]
            pos += b
            ptr[t * n_layers + layer + 1] = pos
            cur[layer] = experts[t, layer]
            recency_update(rc, cur, layer, gamma)
            memory_similarity(mcol, cur, layer, lam, sim)
            if online:
                plus_update(co, r, tt, rt, p, z, cur, prev, has_prev, layer, scale)
        prev[:, :] = cur
        has_prev = True
        if online:
            memory_add(mcol, mset, mstate, cur)
            scale /= decay
            if scale > RESCALE_AT:
                _rescale(co, r, tt, rt, p, z)
                scale *= RESCALE_BY
    return ptr, ids[:pos].copy(), scale


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


@njit(cache=True)
def plus_learn(co, r, tt, rt, p, z, cur, prev, has_prev, layer, s, rc, gamma, mcol, sim,
               lam, online):  # fmt: skip  # pragma: no cover - compiled
    """Everything ``update`` does for one layer, in one compiled call."""
    recency_update(rc, cur, layer, gamma)
    memory_similarity(mcol, cur, layer, lam, sim)
    if online:
        plus_update(co, r, tt, rt, p, z, cur, prev, has_prev, layer, s)


@njit(cache=True)
def scores_for(co, r, tt, rt, p, z, cur, known, prev, has_prev, target, rows, alpha, s, prior,
               scores, rc, mset, mstate, sim, power, votes, look, use_look, beta, logistic,
               look_logit, adaptive):  # fmt: skip  # pragma: no cover - compiled
    """The scores a set is chosen from: plus_scores with the prediction's weight row
    (``weight_row`` of the [4, 10] ``rows``), then ``with_lookahead``. A lookahead
    without any id (all -1) takes no part."""
    use_look = use_look and has_ids(look)
    row = weight_row(known, has_prev, use_look, look_logit)
    plus_scores(co, r, tt, rt, p, z, cur, known, prev, has_prev, target, rows[row], alpha, s,
                prior, scores, rc, mset, mstate, sim, power, votes)  # fmt: skip
    with_lookahead(scores, look, use_look, beta, logistic, look_logit, adaptive)


@njit(cache=True)
def plus_predict(co, r, tt, rt, p, z, cur, known, prev, has_prev, target, rows, alpha, s, prior,
                 scores, rc, mset, mstate, sim, power, votes, look, use_look, beta, budget,
                 adaptive, ctl, cap, out, logistic, look_logit):  # fmt: skip  # pragma: no cover
    """Everything ``predict`` does, in one compiled call; returns the set size."""
    scores_for(co, r, tt, rt, p, z, cur, known, prev, has_prev, target, rows, alpha, s, prior,
               scores, rc, mset, mstate, sim, power, votes, look, use_look, beta, logistic,
               look_logit, adaptive)  # fmt: skip
    b = set_size(scores, budget, adaptive, ctl, cap, target)
    top_by_score(scores, b, out)
    return b
