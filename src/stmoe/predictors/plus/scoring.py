"""Compiled scoring of stmoe-plus and hybrid: every expert's score for a target layer.

A signal is a linear pool of smoothed conditionals: for source experts S,
``mean_{e in S} (C[e, f] + a * prior[f]) / (R[e] + a)`` over a count array C
(pairs of layers, or consecutive tokens) and its row totals R; a missing source
falls back to the prior. Scores are the weighted sum of the signals (layout.Signal),
the prior, recency, the token memory's vote and a constant: with the grid's
weights (>= 0) a linear pool of probabilities, with logistic weights the log-odds
that f is chosen (``to_probability`` turns them into probabilities where set
sizes or the lookahead fusion need them).

The token memory's vote for the target layer weighs each memory token by (its
similarity over the known layers / the best one) ** power: with a high power only
the nearest neighbours count, tokens that agree on many experts at once, which
pairwise counts cannot express.

The state arrives grouped (state.Counts, TokenMemory, Token, Settings, Buffers);
``scores_for``, called from Python, takes the groups as plain tuples and names them.
"""

from __future__ import annotations

import math

import numpy as np

from stmoe.predictors.plus.layout import SPATIAL_LAYERS, Signal, WeightRow
from stmoe.predictors.plus.state import Buffers, Counts, Settings, Token, TokenMemory
from stmoe.util.jit import njit

# the layout's positions as plain ints: numba before 0.66 (vLLM's CPU build pins 0.65)
# cannot index an array with an IntEnum member
_BIAS, _SPATIAL, _TEMPORAL = int(Signal.BIAS), int(Signal.SPATIAL), int(Signal.TEMPORAL)
_PRIOR, _RECENT = int(Signal.PRIOR), int(Signal.RECENT)
_MEMORY, _NARROW = int(Signal.MEMORY), int(Signal.NARROW)


@njit(cache=True)
def _prior(expert_counts, target, s, prior):  # pragma: no cover - compiled
    """prior := the target layer's expert frequencies, smoothed by half an observation."""
    n = expert_counts.shape[1]
    total = 0.0
    for f in range(n):
        prior[f] = expert_counts[target, f] + 0.5 * s
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
def memory_vote(memory, sim, known, target, power, votes, narrow):  # pragma: no cover
    """votes[0, f] := sum over memory tokens choosing f at ``target`` of
    (similarity / best similarity) ** power; tokens whose weight would be below
    1e-3 are skipped (with a high power only the nearest neighbours count). With
    ``narrow``, votes[1] gets the same at power * 4 (the nearest of the near; weights
    under 1e-4 skipped). ``sim``: the token's [L, W] similarity. Returns both totals."""
    votes1, votes4 = votes[0], votes[1]
    votes1[:] = 0.0
    if narrow:
        votes4[:] = 0.0
    total = 0.0
    total4 = 0.0
    if known < 0:
        return total, total4
    row = sim[known]
    filled = memory.ring[0]
    best = 0.0
    for j in range(filled):
        if row[j] > best:
            best = row[j]
    if best <= 0.0:
        return total, total4
    cut = best * 0.001 ** (1.0 / power)
    inv = 1.0 / best
    mset = memory.experts
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
                votes1[f] += wgt
        if narrow and wgt >= 0.1:  # (below, the narrow weight wgt ** 4 is under 1e-4)
            w4 = wgt * wgt
            w4 = w4 * w4
            for a in range(k):
                f = mset[target, j, a]
                if f >= 0:
                    votes4[f] += w4
    for f in range(votes1.shape[0]):
        total += votes1[f]
    if narrow:
        for f in range(votes4.shape[0]):
            total4 += votes4[f]
    return total, total4


@njit(cache=True)
def plus_scores(counts, memory, token, target, w, settings, s,
                buf):  # pragma: no cover - compiled
    """buf.scores := every expert's score for ``target`` given the token's layers
    0..token.known (-1: none), weights ``w`` (by Signal), counts at scale ``s``."""
    out, prior = buf.scores, buf.prior
    n = out.shape[0]
    k = token.experts.shape[1]
    d_max = counts.pairs.shape[0]
    a = settings.alpha * s
    _prior(counts.expert_counts, target, s, prior)
    for f in range(n):
        out[f] = w[_BIAS]
    known = token.known
    h = target - known
    for j in range(SPATIAL_LAYERS):  # the token's layers known, known-1, ..., at distance h+j
        src = known - j
        wj = w[_SPATIAL + j]
        if src >= 0 and 1 <= h + j <= d_max:
            _add_signal(counts.pairs[h + j - 1, src], counts.pair_totals[h + j - 1, src],
                        token.experts[src], prior, a, wj, out)
        elif wj != 0.0:
            for f in range(n):
                out[f] += wj * prior[f]
    wt = w[_TEMPORAL]
    if token.has_previous:
        _add_signal(counts.temporal[target], counts.temporal_totals[target],
                    token.previous[target], prior, a, wt, out)
    elif wt != 0.0:
        for f in range(n):
            out[f] += wt * prior[f]
    rc = token.recency
    for f in range(n):
        out[f] += w[_PRIOR] * prior[f] + w[_RECENT] * rc[target, f] / k
    if w[_MEMORY] != 0.0 or w[_NARROW] != 0.0:
        total, total4 = memory_vote(memory, token.similarity, known, target, settings.power,
                                    buf.votes, w[_NARROW] != 0.0)
        for i in range(2):
            wi = w[_MEMORY + i]
            if wi == 0.0:
                continue
            tot = total if i == 0 else total4
            if tot > 0.0:
                c = wi * k / tot
                for f in range(n):
                    out[f] += c * buf.votes[i, f]
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
def has_ids(look):  # pragma: no cover - compiled
    """Whether a lookahead row holds any expert id (-1 is empty)."""
    for f in look:  # noqa: SIM110 - a plain loop compiles to no allocation
        if f >= 0:
            return True
    return False


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


# the weight rows as plain ints (as the positions above)
_KNOWN, _START = int(WeightRow.KNOWN), int(WeightRow.START)
_JOINT, _FRESH = int(WeightRow.JOINT), int(WeightRow.FRESH)


@njit(cache=True)
def weight_row(known, has_prev, added, look_logit):  # pragma: no cover - compiled
    """Which of the weight rows (layout.WeightRow) a prediction takes."""
    if known < 0:
        return _START if has_prev else _FRESH
    return _JOINT if added and look_logit else _KNOWN


@njit(cache=True)
def with_lookahead(scores, look, use_look, settings, probabilities):  # pragma: no cover
    """Turn the table scores into what the set is chosen from, in place.

    look_logit (hybrid with logistic weights fitted with the lookahead): the
    lookahead's rank weights times ``beta`` join the log-odds as one more signal.
    Otherwise logistic log-odds become probabilities where set sizes or the
    fusion need them, and the lookahead is fused by ``_fuse`` with weight beta.
    With ``probabilities`` the result is always a probability-like score (>= 0)."""
    if use_look and settings.look_logit:
        add_rank_weights(scores, look, settings.beta)
        if probabilities:
            to_probability(scores)
        return
    if settings.logistic and (probabilities or use_look):
        to_probability(scores)
    if use_look:
        _fuse(scores, look, settings.beta)


@njit(cache=True)
def scores_for(counts, memory, token, target, settings, s, buf,
               probabilities):  # pragma: no cover - compiled
    """buf.scores := the scores a set is chosen from: plus_scores with the
    prediction's weight row, then ``with_lookahead`` (``probabilities``: as adaptive
    sets need them, and as ``PlusPredictor.scores`` returns them). A lookahead
    without any id (all -1) takes no part."""
    counts, memory, token = Counts(*counts), TokenMemory(*memory), Token(*token)
    settings, buf = Settings(*settings), Buffers(*buf)
    use_look = token.use_lookahead and has_ids(token.lookahead)
    row = weight_row(token.known, token.has_previous, use_look, settings.look_logit)
    plus_scores(counts, memory, token, target, settings.rows[row], settings, s, buf)
    with_lookahead(buf.scores, token.lookahead, use_look, settings, probabilities)
