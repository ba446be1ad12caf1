"""Fitting stmoe-plus's weights (and hybrid's lookahead weights) at profiling.

The fit sees only the profiling trace: it counts on its first tokens and replays
the last ``FIT_HOLDOUT`` share (at most FIT_MAX_TOKENS), learning online as the
predictor does, to choose the weights that recall most there. First two rounds
of coordinate search over small grids (a linear pool; the objective: recall at
FIT_SET_SIZE x K); then, with the smoothing, recency and memory found there, a
logistic fit (scipy) of all the weights to whether each expert is chosen (the
log-odds: a weighted sum of the signals, so the best pool may subtract the
prior, i.e. score lift over base rate), kept when it recalls more. The result
is a fitted.PlusFit; profiling stores its ``to_dict()`` in the tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from stmoe.predictors.base import ModelShape
from stmoe.predictors.counting import layer_tokens, pair_counts
from stmoe.predictors.plus.fitted import (
    DEFAULT_ALPHA,
    DEFAULT_GAMMA,
    DEFAULT_POWER,
    DEFAULT_SIM_DECAY,
    DEFAULT_W,
    WEIGHT_MAX,
    JointFit,
    LookaheadFit,
    PlusFit,
    Weights,
)
from stmoe.predictors.plus.layout import NUM_SIGNALS, START_SIGNALS, Signal
from stmoe.predictors.plus.scoring import add_rank_weights
from stmoe.predictors.plus.state import NO_FEATURES, Buffers, Counts, FitFeatures, Settings, Stream
from stmoe.predictors.plus.steps import memory_of, plan_recall, plus_replay
from stmoe.trace.schema import RoutingTrace
from stmoe.trace.select import _token_range
from stmoe.trace.summary import expert_load
from stmoe.util.progress import progress

FIT_HOLDOUT = 0.2  # share of the profiling tokens held back to choose the weights
FIT_MAX_TOKENS = 512  # held-back tokens used at most (the fit's cost)
FIT_SET_SIZE = 1.5  # the fit maximises recall at this many experts per prediction, times K
FIT_DECAY = 0.999  # the fit replays with PlusConfig's default forgetting
FIT_MAX_ROWS = 2_000_000  # (token, layer, expert) rows at most in the logistic fit
FIT_L2 = 0.01  # the logistic fit's ridge penalty (on standardised signals)


@dataclass(frozen=True)
class _Trial:
    """One point of the search: what a replay of the held-back tokens runs with."""

    w: Weights
    alpha: float = DEFAULT_ALPHA
    gamma: float = DEFAULT_GAMMA
    power: float = DEFAULT_POWER
    sim_decay: float = DEFAULT_SIM_DECAY
    logistic: bool = False
    w_start: Weights | None = None
    w_fresh: Weights | None = None
    w_joint: Weights | None = None

    def with_value(self, name: Signal | str, value: float) -> _Trial:
        """This trial with one grid value: a signal's weight, or a setting by name."""
        if isinstance(name, Signal):
            w = list(self.w)
            w[name] = value
            return replace(self, w=tuple(w))
        return replace(self, **{name: value})

    def rows(self) -> np.ndarray:
        """The kernels' [4, NUM_SIGNALS] weight rows (by layout.WeightRow)."""
        main = list(self.w)
        return np.array([main, *(main if w is None else list(w)
                                 for w in (self.w_start, self.w_joint, self.w_fresh))])


# the coordinate search's grids, in search order: a signal's weight or a setting
_GRIDS: tuple[tuple[Signal | str, tuple[float, ...]], ...] = (
    (Signal.SECOND, (0.0, 0.25, 0.5, 1.0, 2.0)),
    (Signal.THIRD, (0.0, 0.25, 0.5, 1.0)),
    (Signal.FOURTH, (0.0, 0.25, 0.5, 1.0)),
    (Signal.TEMPORAL, (0.0, 0.5, 1.0, 2.0, 4.0)),
    (Signal.PRIOR, (0.0, 0.25, 1.0)),
    (Signal.RECENT, (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)),
    ("alpha", (0.25, 1.0, 4.0, 16.0)),
    ("gamma", (0.5, 0.8, 0.9, 0.97)),
    (Signal.MEMORY, (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)),
    ("power", (4.0, 8.0, 16.0, 32.0)),
    ("sim_decay", (0.5, 0.8, 1.0)),
)
_START = _Trial(DEFAULT_W)

Replay = Callable[..., float]


def fit(trace: RoutingTrace, holdout: float = FIT_HOLDOUT) -> dict[str, Any]:
    """``fit_weights`` in the tables file's JSON form (what ``info["plus"]`` holds)."""
    return fit_weights(trace, holdout).to_dict()


def fit_weights(trace: RoutingTrace, holdout: float = FIT_HOLDOUT) -> PlusFit:
    """Choose the weights, smoothing and recency factor (and hybrid's beta) on the
    profiling trace's last ``holdout`` share of tokens, counting on the rest and
    learning online as the predictor does; never sees evaluation data. Traces too
    small to hold any back keep the defaults (see the module docstring)."""
    cut = round(trace.num_tokens * (1 - holdout))
    held = min(trace.num_tokens - cut, FIT_MAX_TOKENS)
    if cut < 8 or held < 4:
        return PlusFit()
    first, rest = _token_range(trace, 0, cut), _token_range(trace, cut, cut + held)
    k, n = trace.top_k, trace.num_experts
    co, tt = pair_counts(first)
    base = Counts(co.astype(np.float32), co.sum(axis=3) / k, tt.astype(np.float32),
                  tt.sum(axis=2) / k, expert_load(first).astype(np.float64),
                  layer_tokens(first).astype(np.float64))
    stream = Stream.of(rest.experts, rest.seq_starts)
    memory = memory_of(ModelShape.of(trace), np.asarray(first.experts))

    def replay(trial: _Trial, beta: float = 0.0, look: Any = None,
               features: FitFeatures = NO_FEATURES, look_logit: bool = False) -> float:
        run = stream if look is None else stream._replace(
            lookahead=np.ascontiguousarray(look, dtype=np.int16), has_lookahead=True)
        settings = Settings(trial.rows(), trial.alpha, trial.gamma, trial.power,
                            trial.sim_decay, beta, trial.logistic, look_logit, FIT_SET_SIZE * k,
                            False, int(np.ceil(FIT_SET_SIZE * k)), 1, FIT_DECAY, True)
        ptr, ids, _ = plus_replay(base.copy(), memory.copy(), run, settings, 1.0, Buffers.new(n),
                                  features)
        return plan_recall(stream.experts, ptr, ids)

    trial, best = _START, replay(_START)
    steps = [(name, value) for name, grid in _GRIDS for value in grid] * 2
    for name, value in progress(steps, len(steps), "fitting stmoe-plus's weights"):
        candidate = trial.with_value(name, value)
        score = replay(candidate)
        if score > best + 1e-12:
            trial, best = candidate, score
    linear, linear_w = best, trial.w
    data = _fit_data(replay, trial, stream.experts, n)
    if data is not None:
        candidate = _logistic_trial(trial, data)
        if candidate is not None:
            score = replay(candidate)
            if score > best:
                trial, best = candidate, score
    fitted = PlusFit(w=trial.w, alpha=trial.alpha, gamma=trial.gamma, power=trial.power,
                     sim_decay=trial.sim_decay, fitted=True, logistic=trial.logistic,
                     heldout_tokens=int(held), heldout_recall=best, heldout_recall_linear=linear,
                     w_linear=linear_w, w_start=trial.w_start, w_fresh=trial.w_fresh)
    points = {}
    for point, look in (("early", rest.lookahead), ("late", rest.lookahead_late)):
        if look is not None:
            points[point] = _fit_lookahead(replay, trial, look, data if trial.logistic else None)
    return replace(fitted, early=points.get("early"), late=points.get("late"))


def _logistic_trial(trial: _Trial, data: _FitData) -> _Trial | None:
    """``trial`` with logistic weights: of the known layers, of a token with no known
    layer (w_start: the signals that exist before its layers) and of a sequence's
    first token (w_fresh: the prior alone). None if a fit fails."""
    prior = [START_SIGNALS.index(Signal.PRIOR)]
    weights, start, fresh = (_logistic(data.x, data.y), _logistic(data.x_start, data.y_start),
                             _logistic(data.x_start[:, prior], data.y_start))
    if weights is None or start is None or fresh is None:
        return None
    w_start, w_fresh = [0.0] * NUM_SIGNALS, [0.0] * NUM_SIGNALS
    for i, coef in zip(START_SIGNALS, start[:-1], strict=True):
        w_start[i] = coef
    w_start[Signal.BIAS] = start[-1]
    w_fresh[Signal.PRIOR], w_fresh[Signal.BIAS] = fresh[0], fresh[1]
    return replace(trial, w=tuple(weights), logistic=True, w_start=tuple(w_start),
                   w_fresh=tuple(w_fresh))


def _fit_lookahead(replay: Replay, trial: _Trial, look: np.ndarray,
                   data: _FitData | None) -> LookaheadFit:
    """hybrid's weights at one lookahead point: the fusion's beta, or (with logistic
    ``data``) the lookahead's rank weights as one more signal of a joint logistic
    fit, where that recalls more."""
    score, beta = max((replay(trial, b, look), b) for b in (0.25, 0.5, 0.75, 0.9, 1.0))
    joint = None
    if data is not None:
        ranks = _rank_weights(np.asarray(look)[data.tokens], data.num_experts)
        coefs = _logistic(np.hstack([data.x, ranks]), data.y)
        if coefs is not None:
            w_joint = tuple(coefs[:-2] + coefs[-1:])  # (the lookahead's coefficient is [-2])
            joint_score = replay(replace(trial, w_joint=w_joint), coefs[-2], look, look_logit=True)
            if joint_score > score:
                joint, score = JointFit(w_joint, coefs[-2]), joint_score
    return LookaheadFit(beta, score, joint)


class _FitData(NamedTuple):
    """The logistic fits' rows (token, layer, expert) from the fit's own replay."""

    x: np.ndarray  # the signals' scores at layers >= 1 (the constant left out)
    y: np.ndarray  # whether each expert was chosen
    x_start: np.ndarray  # START_SIGNALS at every layer (what exists before the token's layers)
    y_start: np.ndarray
    tokens: np.ndarray  # the held-back tokens used
    num_experts: int


def _fit_data(replay: Replay, trial: _Trial, experts: np.ndarray, n: int) -> _FitData | None:
    """The logistic fits' data on the held-back tokens (at most FIT_MAX_ROWS rows);
    None when there is nothing to fit."""
    held, n_layers, _ = experts.shape
    if n_layers < 2:
        return None
    take = min(held, max(1, FIT_MAX_ROWS // (n_layers * n)))
    chosen = np.unique(np.linspace(0, held - 1, take).round().astype(np.int64))
    rows = np.full(held, -1, dtype=np.int64)
    rows[chosen] = np.arange(chosen.size)
    feats = np.zeros((chosen.size, n_layers, NUM_SIGNALS, n), dtype=np.float32)
    replay(trial, features=FitFeatures(rows, feats))
    y = np.zeros((chosen.size, n_layers, n))
    picks = experts[chosen].astype(np.int64)
    t_i, l_i, _ = np.nonzero(picks >= 0)
    y[t_i, l_i, picks[picks >= 0]] = 1.0
    if not 0 < y[:, 1:].sum() < y[:, 1:].size:
        return None
    # [T, L, N, 9]: every signal but the constant (Signal.BIAS, the last)
    signals = feats[:, :, :-1].transpose(0, 1, 3, 2).astype(np.float64)
    return _FitData(signals[:, 1:].reshape(-1, NUM_SIGNALS - 1), y[:, 1:].reshape(-1),
                    signals[..., list(START_SIGNALS)].reshape(-1, len(START_SIGNALS)),
                    y.reshape(-1), chosen, n)


def _rank_weights(look: np.ndarray, n: int) -> np.ndarray:
    """[rows, 1]: the lookahead's rank weights (as the kernels add them) over layers
    >= 1 of ``look`` [T, L, J], in _fit_data's row order."""
    t_len, n_layers, _ = look.shape
    out = np.zeros((t_len, n_layers - 1, n))
    for t in range(t_len):
        for layer in range(1, n_layers):
            add_rank_weights(out[t, layer - 1], np.ascontiguousarray(look[t, layer]), 1.0)
    return out.reshape(-1, 1)


def _logistic(x: np.ndarray, y: np.ndarray) -> list[float] | None:
    """Logistic regression of y on x with a small ridge penalty on standardised
    columns: the coefficients of x's columns, then the constant. None if it fails."""
    from scipy.optimize import minimize  # (scipy loads only when fitting)

    mean, std = x.mean(axis=0), x.std(axis=0)
    used = std > 1e-12
    xs = (x[:, used] - mean[used]) / std[used]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = xs @ theta[1:] + theta[0]
        grad_z = 1.0 / (1.0 + np.exp(-z)) - y
        ridge = FIT_L2 * theta[1:]
        value = float(np.sum(np.logaddexp(0.0, z) - y * z) + ridge @ theta[1:])
        return value, np.concatenate([[grad_z.sum()], xs.T @ grad_z + 2 * ridge])

    found = minimize(loss, np.zeros(1 + int(used.sum())), jac=True, method="L-BFGS-B")
    if not np.all(np.isfinite(found.x)):
        return None
    w = np.zeros(x.shape[1] + 1)
    w[:-1][used] = found.x[1:] / std[used]
    w[-1] = found.x[0] - float(np.sum(found.x[1:] * mean[used] / std[used]))
    if not np.all(np.abs(w) <= WEIGHT_MAX):  # a near-constant column: no usable fit
        return None
    return [float(v) for v in w]
