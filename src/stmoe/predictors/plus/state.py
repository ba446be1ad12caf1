"""stmoe-plus's state, grouped as the compiled kernels take it.

Each group is a NamedTuple of arrays (and settings) that numba passes by
reference, so the kernels update the arrays in place. From Python the kernels
take each group as a plain ``tuple(group)`` and name it on entry: numba types a
plain tuple in C but a namedtuple in Python (~0.7 us a call, a tenth of a step).

Counts keep one *scale*: every new observation adds ``scale`` instead of 1, and
the scale grows by ``1/decay`` per token, so older counts weigh less without
touching them (exponential forgetting at O(K^2) per update).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from stmoe.predictors.base import ModelShape, PredictorError
from stmoe.predictors.tables import ProfiledTables

MEMORY_TOKENS = 1024  # the token memory's ring size (the tables keep as many profiled tokens)


class Counts(NamedTuple):
    """The learned counts, private to one predictor (``arrays()``: this order)."""

    pairs: np.ndarray  # [D, L-1, N, N] float32: tokens with e at layer l and f at l+d
    pair_totals: np.ndarray  # [D, L-1, N]: tokens with e at l (and a layer l+d); row sums / K
    temporal: np.ndarray  # [L, N, N] float32: e at l, then f at l in the sequence's next token
    temporal_totals: np.ndarray  # [L, N]: tokens with e at l followed in their sequence
    expert_counts: np.ndarray  # [L, N]: tokens choosing f at l (the prior)
    layer_tokens: np.ndarray  # [L]: tokens seen at l

    @classmethod
    def of(cls, tables: ProfiledTables) -> Counts:
        if tables.pair_counts is None or tables.temporal is None:
            raise PredictorError(f"{tables.source or 'these tables'}: no pair or temporal counts "
                                 "(profiled before stmoe-plus existed); profile the trace "
                                 "again with this stmoe")
        k = tables.shape.top_k
        co = np.array(tables.pair_counts, dtype=np.float32)
        tt = np.array(tables.temporal, dtype=np.float32)
        p = np.array(tables.layer_counts, dtype=np.float64)
        tokens = np.asarray(tables.info.get("layer_tokens", p.sum(axis=1) / k), dtype=np.float64)
        return cls(co, co.sum(axis=3, dtype=np.float64) / k, tt,
                   tt.sum(axis=2, dtype=np.float64) / k, p, tokens.copy())

    def copy(self) -> Counts:
        return Counts(*(np.array(a, copy=True) for a in self))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(self)


class TokenMemory(NamedTuple):
    """A ring of the last MEMORY_TOKENS tokens' routing (profiled, then streamed),
    for the nearest-neighbour vote."""

    chose: np.ndarray  # [L, N, W] uint8: 1 if memory token j chose e at layer l
    experts: np.ndarray  # [L, W, K] int16: memory token j's experts at layer l (-1 empty)
    ring: np.ndarray  # [2] int64: [tokens filled, next slot]

    @classmethod
    def empty(cls, shape: ModelShape) -> TokenMemory:
        """An empty ring (steps.memory_of fills one with profiled tokens)."""
        layers, n, k = shape.num_layers, shape.num_experts, shape.top_k
        return cls(np.zeros((layers, n, MEMORY_TOKENS), dtype=np.uint8),
                   np.full((layers, MEMORY_TOKENS, k), -1, dtype=np.int16),
                   np.zeros(2, dtype=np.int64))

    def similarity(self, num_layers: int) -> np.ndarray:
        """A token's [L, W] similarity to every memory token (filled layer by layer)."""
        return np.zeros((num_layers, self.experts.shape[1]), dtype=np.float32)

    def copy(self) -> TokenMemory:
        return TokenMemory(self.chose.copy(), self.experts.copy(), self.ring.copy())


class Token(NamedTuple):
    """What is known of the token being predicted (one slot's sequence)."""

    experts: np.ndarray  # [L, K] int16: its experts so far (-1: not yet)
    known: int  # its last layer the prediction may use (-1: none)
    previous: np.ndarray  # [L, K] int16: the sequence's previous token
    has_previous: bool
    recency: np.ndarray  # [L, N]: moving average of "f chosen at l" over the sequence
    similarity: np.ndarray  # [L, W] float32: to every memory token over its layers so far
    lookahead: np.ndarray  # [J] int16: the gate lookahead's ranked ids (-1 empty)
    use_lookahead: bool  # the lookahead may take part (hybrid, horizon 1, layer > 0)


class Settings(NamedTuple):
    """The fitted values and knobs one prediction needs (fixed while predicting)."""

    rows: np.ndarray  # [4, NUM_SIGNALS] weights by WeightRow, then Signal
    alpha: float  # smoothing towards the prior, in tokens
    gamma: float  # recency: weight of the previous token in the moving average
    power: float  # token memory: similarity exponent
    sim_decay: float  # token memory: per-layer decay of the similarity
    beta: float  # hybrid: the lookahead's weight (in the log-odds with look_logit)
    logistic: bool  # the weights are logistic (scores are log-odds)
    look_logit: bool  # hybrid: the lookahead joins the log-odds (a joint logistic fit)
    set_size: float  # experts per prediction (the mean when adaptive)
    adaptive: bool  # size each set by one probability threshold
    cap: int  # the largest set
    horizon: int  # predict layer l+h from the token's layers <= l
    decay: float  # per-token weight of old counts
    online: bool  # keep counting while predicting


class Buffers(NamedTuple):
    """Scratch arrays of one predictor, and its set-size controller."""

    prior: np.ndarray  # [N] the target layer's smoothed prior
    scores: np.ndarray  # [N] the scores a set is chosen from
    votes: np.ndarray  # [2, N] the token memory's votes (at power, at 4 * power)
    top: np.ndarray  # [N] int64: the chosen experts, best first
    sizing: np.ndarray  # [2] set sizes: [remainder carried, log adaptive threshold]

    @classmethod
    def new(cls, n: int, sizing: np.ndarray | None = None) -> Buffers:
        return cls(np.zeros(n), np.zeros(n), np.zeros((2, n)), np.zeros(n, dtype=np.int64),
                   np.zeros(2) if sizing is None else sizing)


class Stream(NamedTuple):
    """A trace as the replay takes it."""

    experts: np.ndarray  # [T, L, K] int16
    seq_id: np.ndarray  # [T] int64: each token's sequence
    lookahead: np.ndarray  # [T, L, J] int16 ranked ids, or [1, 1, 1] when none
    has_lookahead: bool

    @classmethod
    def of(cls, experts: np.ndarray, seq_starts: np.ndarray,
           lookahead: np.ndarray | None = None) -> Stream:
        t_len = experts.shape[0]
        seq_id = np.repeat(np.arange(len(seq_starts)), np.diff(np.append(seq_starts, t_len)))
        look = np.full((1, 1, 1), -1, np.int16) if lookahead is None else lookahead
        return cls(np.ascontiguousarray(experts, dtype=np.int16), seq_id.astype(np.int64),
                   np.ascontiguousarray(look, dtype=np.int16), lookahead is not None)


class FitFeatures(NamedTuple):
    """What the fit records during a replay: for tokens t with rows[t] >= 0,
    feats[rows[t], l, i] := signal i's scores for layer l."""

    rows: np.ndarray  # [T] int64 (empty: record nothing)
    feats: np.ndarray  # [rows, L, NUM_SIGNALS, N] float32


NO_FEATURES = FitFeatures(np.zeros(0, dtype=np.int64), np.zeros((1, 1, 1, 1), dtype=np.float32))
