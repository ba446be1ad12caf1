"""The stmoe-plus and hybrid predictors: the protocol (reset / predict / update /
lookahead) and replay over the compiled kernels, with the fitted values and knobs
resolved once at construction.

Per slot (sequence) a predictor keeps the previous token, the recency of each
layer's experts and the current token's similarity to the token memory; the
counts and the memory are shared by every slot and learn online. The step path
and the replay run the same kernels, so they give the same sets.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stmoe.predictors.base import ModelShape, Predictor, PredictorError, PrefetchPlan, register
from stmoe.predictors.plus.config import PlusConfig
from stmoe.predictors.plus.fitted import PlusFit
from stmoe.predictors.plus.layout import Signal, WeightRow
from stmoe.predictors.plus.scoring import scores_for
from stmoe.predictors.plus.state import NO_FEATURES, Buffers, Counts, Settings, Stream
from stmoe.predictors.plus.steps import (
    RESCALE_AT,
    RESCALE_BY,
    memory_add,
    memory_of,
    plus_learn,
    plus_predict,
    plus_replay,
    rescale,
)
from stmoe.predictors.tables import ProfiledTables
from stmoe.trace.schema import RoutingTrace


@register
class PlusPredictor(Predictor):
    """Smoothed conditional frequencies over several signals; see the package docstring."""

    name = "stmoe-plus"
    scores_experts = True
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
                                 f"{self.config.lookahead!r}); hybrid does")
        self.counts = Counts.of(tables)
        # a fit of an older stmoe-plus is ignored (its weights mean other things)
        self.fitted = PlusFit.of_tables(tables) or PlusFit()
        fit, c = self.fitted, self.config
        # logistic weights make the scores log-odds (probabilities where sets are sized);
        # logistic=False takes the grid's linear pool instead (kept beside them)
        self.logistic = fit.logistic and c.logistic is not False
        if c.logistic and not self.logistic:
            raise PredictorError("these tables hold no logistic weights for stmoe-plus "
                                 "(fitted by an older stmoe, too few profiling tokens, or "
                                 "the linear pool recalled as much): profile again, or drop "
                                 "logistic=True")
        w = fit.w
        if fit.logistic and not self.logistic:
            if fit.w_linear is None:
                raise PredictorError("these tables keep no linear weights beside the "
                                     "logistic ones; profile again")
            w = fit.w_linear
        given = [getattr(c, s.knob) for s in Signal]
        self.w = np.array([w[i] if v is None else v for i, v in enumerate(given)])
        # where nothing of the token is known yet (layer 0; layers < horizon) the logistic
        # weights of the known-layer fit do not apply: their own fit (w_start)
        self.w_start = np.array(fit.w_start) if self.logistic else self.w
        # and at a sequence's first token, before its layers, only the prior is known
        self.w_fresh = np.array(fit.w_fresh) if self.logistic else self.w
        self.gamma = float(fit.gamma if c.gamma is None else c.gamma)
        self.power = float(fit.power if c.power is None else c.power)
        self.sim_decay = float(fit.sim_decay if c.sim_decay is None else c.sim_decay)
        self.memory = memory_of(tables.shape, tables.recent)
        self.alpha = float(fit.alpha if c.alpha is None else c.alpha)
        self.lookahead_pref = c.lookahead
        # the lookahead's weight, fitted per lookahead point (the late one when recorded)
        self.beta = float(fit.beta("early")) if c.beta is None else float(c.beta)
        self.mean_set_size = float(c.set_size) if c.set_size > 0 else float(shape.top_k)
        self.scale = 1.0
        n = shape.num_experts
        self.buffers = Buffers.new(n)
        # the kernels take each group as a plain tuple (see state.py); the arrays are
        # updated in place, so these stay valid
        self._counts_arg, self._memory_arg = tuple(self.counts), tuple(self.memory)
        self._buffers_arg = tuple(self.buffers)
        self.use_lookahead_point(self.point)
        self._prev: dict[int, np.ndarray] = {}  # slot -> previous token's [L, K]
        self._recent: dict[int, np.ndarray] = {}  # slot -> recency [L, N] of its sequence
        self._sim: dict[int, np.ndarray] = {}  # slot -> [L, W] similarity to the memory
        self._known: dict[int, int] = {}  # slot -> the last layer its token has reported
        self._no_look = np.full(1, -1, dtype=np.int16)
        self._look: dict[tuple[int, int], np.ndarray] = {}  # (slot, layer) -> lookahead ids
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
        # hybrid with logistic weights: table weights refitted with the lookahead as one
        # more signal (its weight in the log-odds: w_look), per lookahead point; used
        # only where the lookahead is added (the table weights elsewhere)
        joint = self.fitted.joint(point) if self.uses_lookahead and self.logistic else None
        self.look_logit = joint is not None and self.config.beta is None
        if joint is not None and self.look_logit:
            self.w_joint = np.array(joint.w)
            self.beta = float(joint.w_look)
        else:  # the fusion, with beta given or fitted for this point
            self.w_joint = self.w
            if self.config.beta is None:
                self.beta = float(self.fitted.beta(point))
        rows = {WeightRow.KNOWN: self.w, WeightRow.START: self.w_start,
                WeightRow.JOINT: self.w_joint, WeightRow.FRESH: self.w_fresh}
        self._rows = np.stack([rows[r] for r in WeightRow])
        c = self.config
        self.settings = Settings(
            self._rows, self.alpha, self.gamma, self.power, self.sim_decay, self.beta,
            self.logistic, self.look_logit, self.mean_set_size, c.adaptive, self._cap(), c.horizon,
            c.decay, c.online)
        self._settings_arg = tuple(self.settings)

    def weight_rows(self) -> np.ndarray:
        """[4, 10]: the weight rows the kernels pick from per prediction, by
        layout.WeightRow (layers known, none known, the lookahead joined to the
        log-odds, a sequence's first token)."""
        return self._rows

    def _token(self, layer: int, slot: int, look: np.ndarray | None) -> tuple:
        """What the kernels know of the slot's token when predicting ``layer``: a plain
        tuple in state.Token's order."""
        self._check_layer(layer)
        cur = self.token_so_far(slot)
        known = -1 if cur is None else min(layer - self.config.horizon, self._known.get(slot, -1))
        prev = self._prev.get(slot)
        return (self._empty if cur is None else cur, known,
                self._empty if prev is None else prev, prev is not None, self._recency(slot),
                self._similarity(slot), self._no_look if look is None else look,
                look is not None)

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
        scores_for(self._counts_arg, self._memory_arg, self._token(layer, slot, look), layer,
                   self._settings_arg, self.scale, self._buffers_arg, True)
        return self.buffers.scores.copy()

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        look = self._look_for(layer, slot)
        b = plus_predict(self._counts_arg, self._memory_arg, self._token(layer, slot, look),
                         layer, self._settings_arg, self.scale, self._buffers_arg)
        return self.buffers.top[:b].astype(np.int16)

    def predict_scored(self, layer: int, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        ids = self.predict(layer, slot)
        return ids, self.buffers.scores.astype(np.float32)  # what the set was ranked from

    def _cap(self) -> int:
        if not self.config.adaptive:
            return min(self.shape.num_experts, int(np.ceil(self.mean_set_size)))
        return min(self.shape.num_experts, max(1, int(np.ceil(3 * self.mean_set_size))))

    def update(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        experts = np.asarray(experts, dtype=np.int16)
        super().update(layer, experts, slot)
        cur = self.token_so_far(slot)
        assert cur is not None
        prev = self._prev.get(slot)
        token = (cur, layer, self._empty if prev is None else prev, prev is not None,
                 self._recency(slot), self._similarity(slot), self._no_look, False)
        plus_learn(self._counts_arg, self.memory.chose, token, layer, self.gamma, self.sim_decay,
                   self.config.online, self.scale)
        self._known[slot] = layer
        if layer == self.shape.num_layers - 1:
            self._known.pop(slot, None)
            self._prev[slot] = cur.copy()
            if self.config.online:
                memory_add(self._memory_arg, cur)
                self._age()
            super().reset(slot)

    def _age(self) -> None:
        self.scale /= self.config.decay
        if self.scale > RESCALE_AT:
            rescale(self._counts_arg)  # (the kernel's own rounding, as in replay)
            self.scale *= RESCALE_BY

    # ---- replay ------------------------------------------------------------------------
    def plan(self, trace: RoutingTrace) -> PrefetchPlan:
        """The compiled whole-trace replay (identical to stepping through the protocol)."""
        self.check_shape(ModelShape.of(trace))
        look = self.lookahead_array(trace) if self.uses_lookahead else None  # (sets the point)
        stream = Stream.of(trace.experts, trace.seq_starts, look)
        ptr, ids, self.scale = plus_replay(self.counts, self.memory, stream, self.settings,
                                           self.scale, self.buffers, NO_FEATURES)
        return PrefetchPlan(ptr=ptr, ids=ids, num_layers=trace.num_layers)


@register
class HybridPredictor(PlusPredictor):
    """stmoe-plus fused with gate lookahead (layer l+1's router on layer l's state)."""

    name = "hybrid"
    uses_lookahead = True
