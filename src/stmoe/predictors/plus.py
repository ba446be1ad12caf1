"""stmoe-plus and hybrid: probabilistic table predictors (no neural network: counts,
a memory of routing, and ten weights fitted at profiling).

stmoe-plus scores every expert of the target layer with smoothed conditional
frequencies over the *full* co-occurrence counts (not just a top-K row):

* spatial: the experts chosen at the token's last four known layers;
* temporal: the previous token's experts at the target layer;
* a per-layer prior (how often each expert is chosen at that layer);
* recency: the experts the sequence chose at the target layer lately;
* a token memory: what the most similar of the last ``MEMORY_TOKENS`` tokens
  (profiled, then streamed) chose at the target layer, similarity being the
  overlap over every known layer (nearer layers weighing more, ``sim_decay``);
* the same vote narrowed to the nearest of the near (power x 4), and a constant;

weighted by ``w`` (fitted on held-back profiling data by ``fit``, never on the
evaluation trace: a grid search for a linear pool, then a logistic fit that
makes the scores each expert's log-odds of being chosen), learning online with
exponential forgetting (``decay`` per token). It returns the ``budget`` best
experts, or with ``adaptive`` every expert whose share of the scores (of the
probabilities, with logistic weights) clears one threshold, steered so the mean
set size is ``budget``. With ``horizon`` h it predicts layer l+h from layers <= l.

hybrid adds **gate lookahead**: the next layer's router applied ahead of time,
early (on this layer's MoE input: the trace's ``lookahead``) or late (on the
next layer's own input through its pre-MoE norm: ``lookahead_late``), recorded
by capture and computed live by the runtime, fused with the table scores by
weight ``beta`` or, where the fit found it better, joined to the log-odds as one
more signal of a joint logistic fit (``look_logit``; only where it is added).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stmoe._progress import progress
from stmoe.predictors import plus_kernels as pk
from stmoe.predictors.base import ModelShape, Predictor, PredictorError, PrefetchPlan, register
from stmoe.predictors.tables import ProfiledTables
from stmoe.trace.schema import RoutingTrace

# spatial from the last 4 known layers (nearest first), temporal, prior, recency, memory
# (at power, and narrow: at 4 * power), a constant (logistic weights only)
DEFAULT_W = (1.0, 0.5, 0.25, 0.0, 0.5, 0.25, 0.5, 1.0, 0.0, 0.0)
W_NAMES = ("w_spatial", "w_second", "w_third", "w_fourth", "w_temporal", "w_prior",
           "w_recent", "w_memory", "w_narrow", "w_bias")  # fmt: skip
MEMORY_TOKENS = 1024  # the token memory's ring size (the tables keep as many profiled tokens)
DEFAULT_POWER = 8.0
DEFAULT_SIM_DECAY = 1.0
DEFAULT_ALPHA = 1.0
DEFAULT_GAMMA = 0.8
FIT_HOLDOUT = 0.2  # share of the profiling tokens held back to choose the weights
FIT_MAX_TOKENS = 512  # held-back tokens used at most (the fit's cost)
FIT_BUDGET = 1.5  # the fit maximises recall at this many experts per prediction, times K
FIT_VERSION = 3  # fits of other versions are ignored (v3: logistic weights)
FIT_MAX_ROWS = 2_000_000  # (token, layer, expert) rows at most in the logistic fit
FIT_L2 = 0.01  # the logistic fit's ridge penalty (on standardised signals)


@dataclass(frozen=True)
class PlusConfig:
    """Knobs of stmoe-plus; None = the weights fitted at profiling (or the defaults)."""

    budget: float = 0.0  # experts per prediction (mean size when adaptive); 0 = top-K
    adaptive: bool = False  # size each set by one probability threshold; mean size = budget
    horizon: int = 1  # predict layer l+h from the token's layers <= l
    online: bool = True  # keep counting (with forgetting) while predicting
    decay: float = 0.999  # per-token weight of old counts (1 = never forget)
    w_spatial: float | None = None
    w_second: float | None = None
    w_third: float | None = None
    w_fourth: float | None = None
    w_temporal: float | None = None
    w_prior: float | None = None
    w_recent: float | None = None
    w_memory: float | None = None
    w_narrow: float | None = None  # token memory at 4 * power
    w_bias: float | None = None  # a constant added to every score
    power: float | None = None  # token memory: similarity exponent
    sim_decay: float | None = None  # token memory: per-layer decay of the similarity (1: none)
    gamma: float | None = None  # recency: weight of the previous token in the moving average
    alpha: float | None = None  # smoothing towards the prior, in tokens
    beta: float | None = None  # hybrid only: weight of the gate lookahead
    lookahead: str = "auto"  # hybrid only: "early", "late", or "auto" (late where available)
    logistic: bool | None = None  # None: as fitted; False: the grid's linear pool

    def check(self, shape: ModelShape) -> None:
        if self.budget < 0 or self.budget > shape.num_experts:
            raise PredictorError(f"budget {self.budget}: expected 0 (top-K) .. {shape.num_experts}")
        if not 1 <= self.horizon <= pk.D_MAX - 1:
            raise PredictorError(f"horizon {self.horizon}: expected 1..{pk.D_MAX - 1}")
        if not 1e-6 <= self.decay <= 1.0:
            raise PredictorError(f"decay {self.decay}: expected 1e-6 <= decay <= 1")
        if self.beta is not None and not 0.0 <= self.beta <= 1.0:
            raise PredictorError(f"beta {self.beta}: expected 0..1")
        if self.power is not None and not self.power > 0:
            raise PredictorError(f"power {self.power}: expected > 0")
        if self.sim_decay is not None and not 0.0 < self.sim_decay <= 1.0:
            raise PredictorError(f"sim_decay {self.sim_decay}: expected 0 < sim_decay <= 1")
        check_point(self.lookahead)


@dataclass
class _Counts:
    """The count arrays of plus_kernels (see there; co and tt float32, the rest float64),
    private to one predictor."""

    co: np.ndarray
    r: np.ndarray
    tt: np.ndarray
    rt: np.ndarray
    p: np.ndarray
    z: np.ndarray

    @classmethod
    def of(cls, tables: ProfiledTables) -> _Counts:
        if tables.pair_counts is None or tables.temporal is None:
            raise PredictorError("these tables predate stmoe-plus (no pair or temporal counts); "
                                 "profile the trace again with this stmoe")  # fmt: skip
        k = tables.shape.top_k
        co = np.array(tables.pair_counts, dtype=np.float32)
        tt = np.array(tables.temporal, dtype=np.float32)
        p = np.array(tables.layer_counts, dtype=np.float64)
        tokens = np.asarray(tables.info.get("layer_tokens", p.sum(axis=1) / k), dtype=np.float64)
        return cls(co, co.sum(axis=3, dtype=np.float64) / k, tt,
                   tt.sum(axis=2, dtype=np.float64) / k, p, tokens.copy())  # fmt: skip

    def copy(self) -> _Counts:
        return _Counts(*(np.array(a, copy=True) for a in dataclasses.astuple(self)))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.co, self.r, self.tt, self.rt, self.p, self.z


@dataclass
class _Memory:
    """The token memory of plus_kernels (a ring of recent tokens' routing)."""

    mcol: np.ndarray  # [L, N, W] uint8
    mset: np.ndarray  # [L, W, K] int16
    mstate: np.ndarray  # [filled, next slot] int64

    @classmethod
    def of_routing(cls, shape: ModelShape, recent: np.ndarray | None) -> _Memory:
        layers, n, k = shape.num_layers, shape.num_experts, shape.top_k
        mem = cls(np.zeros((layers, n, MEMORY_TOKENS), dtype=np.uint8),
                  np.full((layers, MEMORY_TOKENS, k), -1, dtype=np.int16),
                  np.zeros(2, dtype=np.int64))  # fmt: skip
        if recent is not None:
            for token in np.asarray(recent, dtype=np.int16)[-MEMORY_TOKENS:]:
                pk.memory_add(mem.mcol, mem.mset, mem.mstate, token)
        return mem

    @classmethod
    def of(cls, tables: ProfiledTables) -> _Memory:
        return cls.of_routing(tables.shape, tables.recent)

    def similarity(self, num_layers: int) -> np.ndarray:
        """A token's [L, W] similarity to every memory token (filled layer by layer)."""
        return np.zeros((num_layers, self.mset.shape[1]), dtype=np.float32)

    def copy(self) -> _Memory:
        return _Memory(self.mcol.copy(), self.mset.copy(), self.mstate.copy())


@register
class PlusPredictor(Predictor):
    """Smoothed conditional frequencies over several signals; see the module docstring."""

    name = "stmoe-plus"
    config_class = PlusConfig
    needs_tables = True

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None, **knobs: Any) -> None:
        super().__init__(shape)
        self.config = self.configure(knobs)
        self.config.check(shape)
        if tables is None:
            raise PredictorError(f"{self.name!r} needs profiled tables (stmoe profile)")
        tables.check_fits(shape)
        if self.config.lookahead != "auto" and not self.uses_lookahead:
            raise PredictorError(f"{self.name} takes no gate lookahead (lookahead="
                                 f"{self.config.lookahead!r}); hybrid does")  # fmt: skip
        self.counts = _Counts.of(tables)
        fitted = tables.info.get("plus", {})
        if fitted.get("version") != FIT_VERSION:
            fitted = {}  # fitted for an older stmoe-plus: its weights mean other things
        c = self.config
        # logistic weights make the scores log-odds (probabilities where sets are sized);
        # logistic=False takes the grid's linear pool instead (kept beside them)
        self.logistic = bool(fitted.get("logistic", False)) and c.logistic is not False
        if c.logistic and not self.logistic:
            raise PredictorError("these tables hold no logistic weights for stmoe-plus "
                                 "(fitted by an older stmoe, too few profiling tokens, or "
                                 "the linear pool recalled as much): profile again, or drop "
                                 "logistic=True")  # fmt: skip
        w = fitted.get("w", DEFAULT_W)
        if fitted.get("logistic") and not self.logistic:
            if "w_linear" not in fitted:
                raise PredictorError("these tables keep no linear weights beside the "
                                     "logistic ones; profile again")  # fmt: skip
            w = fitted["w_linear"]
        given = [getattr(c, n) for n in W_NAMES]
        self.w = np.array([w[i] if v is None else v for i, v in enumerate(given)])
        # where nothing of the token is known yet (layer 0; layers < horizon) the logistic
        # weights of the known-layer fit do not apply: their own fit ("w_start")
        self.w_start = np.array(fitted["w_start"]) if self.logistic else self.w
        # and at a sequence's first token, before its layers, only the prior is known
        self.w_fresh = np.array(fitted["w_fresh"]) if self.logistic else self.w
        self.gamma = float(fitted.get("gamma", DEFAULT_GAMMA) if c.gamma is None else c.gamma)
        self.power = float(fitted.get("power", DEFAULT_POWER) if c.power is None else c.power)
        self.sim_decay = float(fitted.get("sim_decay", DEFAULT_SIM_DECAY)
                               if c.sim_decay is None else c.sim_decay)  # fmt: skip
        self.memory = _Memory.of(tables)
        self.alpha = float(fitted.get("alpha", DEFAULT_ALPHA) if c.alpha is None else c.alpha)
        # the lookahead's weight, fitted per lookahead point (the late one when recorded)
        self._betas = {"early": float(fitted.get("beta", 0.5)),
                       "late": float(fitted.get("beta_late", fitted.get("beta", 0.5)))}  # fmt: skip
        # hybrid with logistic weights: table weights refitted with the lookahead as one
        # more signal (its weight in the log-odds: "w_look"), per lookahead point; used
        # only where the lookahead is added (the table weights elsewhere)
        self._look_fits = {"early": fitted.get("hybrid"), "late": fitted.get("hybrid_late")}
        self.lookahead_pref = c.lookahead
        self.beta = self._betas["early"] if c.beta is None else float(c.beta)
        self.use_lookahead_point(self.point)
        self.budget = float(c.budget) if c.budget > 0 else float(shape.top_k)
        self.ctl = np.zeros(2)  # set sizes: [remainder carried, log adaptive threshold]
        self.scale = 1.0
        n = shape.num_experts
        self._prev: dict[int, np.ndarray] = {}  # slot -> previous token's [L, K]
        self._recent: dict[int, np.ndarray] = {}  # slot -> recency [L, N] of its sequence
        self._sim: dict[int, np.ndarray] = {}  # slot -> [L, W] similarity to the memory
        self._votes = np.zeros((2, n))
        self._known: dict[int, int] = {}  # slot -> the last layer its token has reported
        self._no_look = np.full(1, -1, dtype=np.int16)
        self._look: dict[tuple[int, int], np.ndarray] = {}  # (slot, layer) -> lookahead ids
        self._prior = np.zeros(n)
        self._scores = np.zeros(n)
        self._out = np.zeros(n, dtype=np.int64)
        self._empty = np.full((shape.num_layers, shape.top_k), -1, dtype=np.int16)

    # ---- the protocol ---------------------------------------------------------------
    def reset(self, slot: int = 0) -> None:
        super().reset(slot)
        self._prev.pop(slot, None)
        self._recent.pop(slot, None)
        self._sim.pop(slot, None)
        self._known.pop(slot, None)

    def _similarity(self, slot: int) -> np.ndarray:
        sim = self._sim.get(slot)
        if sim is None:
            sim = self._sim[slot] = self.memory.similarity(self.shape.num_layers)
        return sim

    def _recency(self, slot: int) -> np.ndarray:
        rc = self._recent.get(slot)
        if rc is None:
            rc = self._recent[slot] = np.zeros((self.shape.num_layers, self.shape.num_experts))
        return rc

    def lookahead(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        """Gate lookahead for ``layer`` (ranked ids; -1 empty), used by the next predict."""
        self._look[(slot, layer)] = np.asarray(experts, dtype=np.int16)

    def use_lookahead_point(self, point: str) -> None:
        super().use_lookahead_point(point)
        fitted = self._look_fits.get(point) if self.uses_lookahead and self.logistic else None
        self.look_logit = fitted is not None and self.config.beta is None
        if self.look_logit:
            self.w_joint = np.array(fitted["w"])
            self.beta = float(fitted["w_look"])
        else:  # the fusion, with beta given or fitted for this point
            self.w_joint = self.w
            if self.config.beta is None:
                self.beta = self._betas[point]
        self._rows = np.stack([self.w, self.w_start, self.w_joint, self.w_fresh])

    def weight_rows(self) -> np.ndarray:
        """[4, 10]: the weight rows the kernels pick from per prediction, in
        ``pk.weight_row``'s order (layers known, none known, the lookahead joined to
        the log-odds, a sequence's first token)."""
        return self._rows

    def _args(self, layer: int, slot: int) -> tuple:
        """The kernels' arguments up to the votes buffer, for predicting ``layer``."""
        self._check_layer(layer)
        cur = self.token_so_far(slot)
        known = -1 if cur is None else min(layer - self.config.horizon, self._known.get(slot, -1))
        prev = self._prev.get(slot)
        return (*self.counts.arrays(), self._empty if cur is None else cur, known,
                self._empty if prev is None else prev, prev is not None, layer, self._rows,
                self.alpha, self.scale, self._prior, self._scores, self._recency(slot),
                self.memory.mset, self.memory.mstate, self._similarity(slot), self.power,
                self._votes)  # fmt: skip

    def _look_for(self, layer: int, slot: int) -> np.ndarray | None:
        """The lookahead for ``layer`` if it may take part (hybrid, horizon 1, layer > 0;
        the kernels skip one without ids)."""
        look = self._look.pop((slot, layer), None)
        if self.uses_lookahead and self.config.horizon == 1 and layer > 0:
            return look
        return None

    def scores(self, layer: int, slot: int = 0) -> np.ndarray:
        """Every expert's score for ``layer`` (higher: more likely), from what is known
        (probabilities with logistic weights)."""
        look = self._look_for(layer, slot)
        pk.scores_for(*self._args(layer, slot), self._no_look if look is None else look,
                      look is not None, self.beta, self.logistic, self.look_logit, True)
        return self._scores.copy()

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        look = self._look_for(layer, slot)
        b = pk.plus_predict(*self._args(layer, slot), self._no_look if look is None else look,
                            look is not None, self.beta, self.budget, self.config.adaptive,
                            self.ctl, self._cap(), self._out, self.logistic,
                            self.look_logit)  # fmt: skip
        return self._out[:b].astype(np.int16)

    def _cap(self) -> int:
        if not self.config.adaptive:
            return min(self.shape.num_experts, int(np.ceil(self.budget)))
        return min(self.shape.num_experts, max(1, int(np.ceil(3 * self.budget))))

    def update(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        experts = np.asarray(experts, dtype=np.int16)
        super().update(layer, experts, slot)
        cur = self.token_so_far(slot)
        assert cur is not None
        prev = self._prev.get(slot)
        pk.plus_learn(*self.counts.arrays(), cur, self._empty if prev is None else prev,
                      prev is not None, layer, self.scale, self._recency(slot), self.gamma,
                      self.memory.mcol, self._similarity(slot), self.sim_decay,
                      self.config.online)  # fmt: skip
        self._known[slot] = layer
        if layer == self.shape.num_layers - 1:
            self._known.pop(slot, None)
            self._prev[slot] = cur.copy()
            if self.config.online:
                pk.memory_add(self.memory.mcol, self.memory.mset, self.memory.mstate, cur)
                self._age()
            super().reset(slot)

    def _age(self) -> None:
        self.scale /= self.config.decay
        if self.scale > pk.RESCALE_AT:
            pk._rescale(*self.counts.arrays())  # (the kernel's own rounding, as in replay)
            self.scale *= pk.RESCALE_BY

    def predict_batch(self, layer: int, slots: Sequence[int], budget: int = 0) -> np.ndarray:
        """One budget for the batch: experts by the expected number of slots needing them."""
        slots = list(slots)
        if len(slots) <= 1:
            ids = self.predict(layer, slots[0] if slots else 0)
            return ids[:budget] if budget > 0 else ids
        total = np.zeros(self.shape.num_experts)
        for slot in slots:
            s = self.scores(layer, slot)
            total += s / max(s.sum(), 1e-300)
        want = budget if budget > 0 else min(self.shape.num_experts,
                                             round(self.budget * len(slots)))  # fmt: skip
        order = np.argsort(-total, kind="mergesort")[:want]
        return order.astype(np.int16)

    # ---- replay ------------------------------------------------------------------------
    def plan(self, trace: RoutingTrace) -> PrefetchPlan:
        """The compiled whole-trace replay (identical to stepping through the protocol)."""
        self.check_shape(ModelShape.of(trace))
        look = self.lookahead_array(trace) if self.uses_lookahead else None
        c = self.config
        seq_id = np.repeat(np.arange(trace.num_sequences), np.diff(
            np.append(trace.seq_starts, trace.num_tokens)))  # fmt: skip
        ptr, ids, self.scale = pk.plus_replay(
            *self.counts.arrays(), np.ascontiguousarray(trace.experts, dtype=np.int16),
            seq_id.astype(np.int64),
            look if look is not None else np.full((1, 1, 1), -1, np.int16), look is not None,
            self.weight_rows(), self.beta, self.alpha, c.decay, c.online, self.budget, c.adaptive,
            self.ctl, c.horizon, self._cap(), self.scale, self.gamma, self.memory.mcol,
            self.memory.mset, self.memory.mstate, self.power, self.sim_decay, self.logistic,
            self.look_logit, _NO_ROWS, _NO_FEATS,
        )  # fmt: skip
        return PrefetchPlan(ptr=ptr, ids=ids, num_layers=trace.num_layers)


@register
class HybridPredictor(PlusPredictor):
    """stmoe-plus fused with gate lookahead (layer l+1's router on layer l's state)."""

    name = "hybrid"
    uses_lookahead = True


_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_FEATS = np.zeros((1, 1, 1, 1), dtype=np.float32)


def check_point(point: str) -> None:
    if point not in ("auto", "early", "late"):
        raise PredictorError(f"lookahead {point!r}: expected auto, early or late")


# ---- fitting the weights on the profiling trace ---------------------------------------
_GRIDS: dict[str, tuple[float, ...]] = {
    "w_second": (0.0, 0.25, 0.5, 1.0, 2.0),
    "w_third": (0.0, 0.25, 0.5, 1.0),
    "w_fourth": (0.0, 0.25, 0.5, 1.0),
    "w_temporal": (0.0, 0.5, 1.0, 2.0, 4.0),
    "w_prior": (0.0, 0.25, 1.0),
    "w_recent": (0.0, 0.5, 1.0, 2.0, 4.0, 8.0),
    "alpha": (0.25, 1.0, 4.0, 16.0),
    "gamma": (0.5, 0.8, 0.9, 0.97),
    "w_memory": (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
    "power": (4.0, 8.0, 16.0, 32.0),
    "sim_decay": (0.5, 0.8, 1.0),
}
_START = {**dict(zip(W_NAMES, DEFAULT_W, strict=True)), "alpha": DEFAULT_ALPHA,
          "gamma": DEFAULT_GAMMA, "power": DEFAULT_POWER,
          "sim_decay": DEFAULT_SIM_DECAY}  # fmt: skip


def fit(trace: RoutingTrace, holdout: float = FIT_HOLDOUT) -> dict[str, Any]:
    """Choose the weights, smoothing and recency factor (and hybrid's beta) on the
    profiling trace's last ``holdout`` share of tokens, counting on the rest and
    learning online as the predictor does; never sees evaluation data.

    First two rounds of coordinate search over small grids (a linear pool, the
    objective: recall at 1.5K); then, with the smoothing, recency and memory found
    there, a logistic fit of all the weights to whether each expert is chosen
    (the log-odds: a weighted sum of the signals, so the best pool may subtract the
    prior, i.e. score lift over base rate). The logistic weights are kept when
    they recall more on the held-back tokens. Traces too small to hold any back
    keep the defaults."""
    from stmoe.predictors.tables import layer_tokens, pair_counts
    from stmoe.trace.select import _token_range
    from stmoe.trace.summary import expert_load

    cut = round(trace.num_tokens * (1 - holdout))
    held = min(trace.num_tokens - cut, FIT_MAX_TOKENS)
    if cut < 8 or held < 4:
        return {**_pack(_START), "fitted": False, "version": FIT_VERSION, "logistic": False}
    first, rest = _token_range(trace, 0, cut), _token_range(trace, cut, cut + held)
    k = trace.top_k
    co, tt = pair_counts(first)
    base = _Counts(co.astype(np.float32), co.sum(axis=3) / k, tt.astype(np.float32),
                   tt.sum(axis=2) / k, expert_load(first).astype(np.float64),
                   layer_tokens(first).astype(np.float64))  # fmt: skip
    experts = np.ascontiguousarray(rest.experts, dtype=np.int16)
    seq_id = np.repeat(np.arange(rest.num_sequences), np.diff(
        np.append(rest.seq_starts, rest.num_tokens))).astype(np.int64)  # fmt: skip
    no_look = np.full((1, 1, 1), -1, np.int16)

    memory = _Memory.of_routing(ModelShape.of(trace), np.asarray(first.experts))

    def replay(params: dict[str, Any], beta: float = 0.0, look: Any = None,
               rows: np.ndarray = _NO_ROWS, feats: np.ndarray = _NO_FEATS,
               look_logit: bool = False) -> float:  # fmt: skip
        counts, mem = base.copy(), memory.copy()
        ptr, ids, _ = pk.plus_replay(
            *counts.arrays(), experts, seq_id,
            no_look if look is None else np.ascontiguousarray(look, dtype=np.int16),
            look is not None, _rows(params), beta, params["alpha"],
            0.999, True, FIT_BUDGET * k, False, np.zeros(2), 1, int(np.ceil(FIT_BUDGET * k)),
            1.0, params["gamma"], mem.mcol, mem.mset, mem.mstate, params["power"],
            params["sim_decay"], bool(params.get("logistic", False)), look_logit, rows, feats,
        )  # fmt: skip
        return pk.plan_recall(experts, ptr, ids)

    params, best = dict(_START), replay(_START)
    trials = [(name, value) for name, grid in _GRIDS.items() for value in grid] * 2
    for name, value in progress(trials, len(trials), "fitting stmoe-plus's weights"):
        trial = {**params, name: value}
        score = replay(trial)
        if score > best + 1e-12:
            params, best = trial, score
    linear, linear_w = best, [params[n] for n in W_NAMES]
    data = _fit_data(replay, params, experts, trace.num_experts)
    weights = start = fresh = None
    if data is not None:
        prior = [START_SIGNALS.index(5)]
        weights, start, fresh = (_logistic(data["x"], data["y"]),
                                 _logistic(data["x_start"], data["y_start"]),
                                 _logistic(data["x_start"][:, prior], data["y_start"]))  # fmt: skip
    if weights is not None and start is not None and fresh is not None:
        w_start, w_fresh = [0.0] * len(W_NAMES), [0.0] * len(W_NAMES)
        for i, coef in zip(START_SIGNALS, start[:-1], strict=True):
            w_start[i] = coef
        w_start[-1], w_fresh[5], w_fresh[-1] = start[-1], fresh[0], fresh[1]
        trial = {**params, **dict(zip(W_NAMES, weights, strict=True)), "logistic": True,
                 "w_start": w_start, "w_fresh": w_fresh}  # fmt: skip
        score = replay(trial)
        if score > best:
            params, best = trial, score
    out: dict[str, Any] = {**_pack(params), "fitted": True, "version": FIT_VERSION,
                           "logistic": bool(params.get("logistic", False)),
                           "heldout_tokens": int(held), "heldout_recall": best,
                           "heldout_recall_linear": linear, "w_linear": linear_w}  # fmt: skip
    if out["logistic"]:
        out.update(w_start=params["w_start"], w_fresh=params["w_fresh"])
    for key, look in (("", rest.lookahead), ("_late", rest.lookahead_late)):
        if look is None:
            continue
        # hybrid's lookahead weight for the fusion, per lookahead point
        score, beta = max((replay(params, b, look), b) for b in (0.25, 0.5, 0.75, 0.9, 1.0))
        out.update({f"beta{key}": beta, f"heldout_recall_hybrid{key}": score})
        if out["logistic"] and data is not None:
            # or the lookahead's rank weights as one more signal of a joint logistic fit
            ranks = _rank_weights(np.asarray(look)[data["tokens"]], trace.num_experts)
            joint = _logistic(np.hstack([data["x"], ranks]), data["y"])
            if joint is not None:
                trial = {**params, "w_joint": joint[:-2] + joint[-1:]}
                joint_score = replay(trial, joint[-2], look, look_logit=True)
                if joint_score > score:
                    out.update({f"hybrid{key}": {"w": joint[:-2] + joint[-1:],
                                                 "w_look": joint[-2]},
                                f"heldout_recall_hybrid{key}": joint_score})  # fmt: skip
    return out


def _rows(params: dict[str, Any]) -> np.ndarray:
    """The kernels' [4, 10] weight rows (known layers, none known, lookahead joined,
    a first token) of a fit's trial parameters."""
    main = [params[n] for n in W_NAMES]
    return np.array([main, params.get("w_start", main), params.get("w_joint", main),
                     params.get("w_fresh", main)])  # fmt: skip


START_SIGNALS = (4, 5, 6)  # temporal, prior, recency: what exists before a token's layers


def _fit_data(replay: Any, params: dict[str, Any], experts: np.ndarray,
              n: int) -> dict[str, np.ndarray] | None:  # fmt: skip
    """The logistic fits' data from the fit's own replay, on the held-back tokens
    (at most FIT_MAX_ROWS rows of (token, layer, expert)): ``x`` the signals'
    scores at layers >= 1 (the terms the weights multiply, the constant left out)
    and ``y`` whether each expert was chosen; ``x_start``/``y_start`` the signals
    that exist before any of the token's layers (START_SIGNALS) at every layer;
    ``tokens`` the held-back tokens used. None when there is nothing to fit."""
    held, n_layers, _ = experts.shape
    if n_layers < 2:
        return None
    take = min(held, max(1, FIT_MAX_ROWS // (n_layers * n)))
    chosen = np.unique(np.linspace(0, held - 1, take).round().astype(np.int64))
    rows = np.full(held, -1, dtype=np.int64)
    rows[chosen] = np.arange(chosen.size)
    feats = np.zeros((chosen.size, n_layers, len(W_NAMES), n), dtype=np.float32)
    replay(params, rows=rows, feats=feats)
    y = np.zeros((chosen.size, n_layers, n))
    picks = experts[chosen].astype(np.int64)
    t_i, l_i, _ = np.nonzero(picks >= 0)
    y[t_i, l_i, picks[picks >= 0]] = 1.0
    if not 0 < y[:, 1:].sum() < y[:, 1:].size:
        return None
    signals = feats[:, :, :-1].transpose(0, 1, 3, 2).astype(np.float64)  # [T, L, N, 9]
    return {"x": signals[:, 1:].reshape(-1, len(W_NAMES) - 1), "y": y[:, 1:].reshape(-1),
            "x_start": signals[..., list(START_SIGNALS)].reshape(-1, len(START_SIGNALS)),
            "y_start": y.reshape(-1), "tokens": chosen}  # fmt: skip


def _rank_weights(look: np.ndarray, n: int) -> np.ndarray:
    """[rows, 1]: the lookahead's rank weights (as the kernels add them) over layers
    >= 1 of ``look`` [T, L, J], in _fit_data's row order."""
    t_len, n_layers, _ = look.shape
    out = np.zeros((t_len, n_layers - 1, n))
    for t in range(t_len):
        for layer in range(1, n_layers):
            pk.add_rank_weights(out[t, layer - 1], np.ascontiguousarray(look[t, layer]), 1.0)
    return out.reshape(-1, 1)


def _logistic(x: np.ndarray, y: np.ndarray) -> list[float] | None:
    """Logistic regression of y on x with a small ridge penalty on standardised
    columns: the coefficients of x's columns, then the constant. None if it fails."""
    from scipy.optimize import minimize

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
    return [float(v) for v in w]


def _pack(params: dict[str, Any]) -> dict[str, Any]:
    return {"w": [params[n] for n in W_NAMES], "alpha": params["alpha"],
            "gamma": params["gamma"], "power": params["power"],
            "sim_decay": params["sim_decay"]}  # fmt: skip


@register
class LookaheadPredictor(Predictor):
    """Gate lookahead alone: the next layer's router on this layer's hidden state.

    No tables: the ``budget`` best ids of the lookahead (K by default); nothing at
    layer 0 or when no lookahead was given. The runtime computes the lookahead
    live; replay reads the trace's ``lookahead`` array.
    """

    name = "gate-lookahead"
    uses_lookahead = True

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None = None,
                 budget: int = 0, lookahead: str = "auto") -> None:  # fmt: skip
        super().__init__(shape)
        if budget < 0:
            raise PredictorError(f"budget {budget}: expected 0 (K) or a positive count")
        check_point(lookahead)
        self.lookahead_pref = lookahead
        self.budget = budget or shape.top_k
        self._look: dict[tuple[int, int], np.ndarray] = {}

    def lookahead(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        self._look[(slot, layer)] = np.asarray(experts, dtype=np.int16)

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        self._check_layer(layer)
        look = self._look.pop((slot, layer), None)
        if look is None:
            return np.zeros(0, dtype=np.int16)
        return look[look >= 0][: self.budget].copy()
