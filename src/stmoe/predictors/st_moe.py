"""ST-MoE: the cross-layer correlation table (CCT) plus the history table (HT).

Implements docs/method.md's Algorithms 2 (predict) and 3 (online update) over tables
from Algorithm 1 (``profiling.profile``). The same class, configured, gives the
ablation baselines: HT only (previous-token), CCT only (static or online).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from stmoe.predictors import kernels
from stmoe.predictors.base import ModelShape, Predictor, PredictorError, PrefetchPlan, register
from stmoe.predictors.tables import ProfiledTables, check_cct
from stmoe.trace.schema import RoutingTrace


@dataclass(frozen=True)
class STMoEConfig:
    """Every knob docs/method.md lists for ST-MoE; defaults are the paper's."""

    use_cct: bool = True  # spatial signal: CCT rows of the experts chosen at l
    use_ht: bool = True  # temporal signal: the previous token's experts at l+1
    online: bool = True  # Algorithm 3 updates after every token (False: static tables)
    w_ht: float = 1.0  # score each HT expert adds (the paper's default 1)
    threshold: float = 2.0  # prefetch f when score[f] >= threshold (the paper's default 2)
    layer0: Literal["ht", "none"] = "ht"  # layer 0 prefetches all of HT[0], or nothing
    max_set_size: int = 0  # at most this many experts, highest score first; 0 = no cap

    def check(self) -> None:
        if not (self.use_cct or self.use_ht):
            raise PredictorError("ST-MoE needs the CCT, the HT or both")
        if self.layer0 not in ("ht", "none"):
            raise PredictorError(f"layer0 policy {self.layer0!r}: expected 'ht' or 'none'")
        if self.max_set_size < 0:
            raise PredictorError(f"max_set_size {self.max_set_size}: expected 0 (no cap) or a "
                                 "positive count")


@register
class STMoEPredictor(Predictor):
    """CCT + HT prediction with 2-bit online updates (docs/method.md Algorithms 2 and 3)."""

    name = "stmoe"
    config_class = STMoEConfig
    needs_tables = True
    # kernels.update_row: where a CCT row has fewer free slots than new experts, the
    # router's first-ranked ones take them (predict itself ranks by score, then id)
    needs_rank_order = ("Algorithm 3's online update gives a full CCT row's free slots to "
                        "the router's top-ranked experts first")

    def __init__(
        self,
        shape: ModelShape,
        tables: ProfiledTables | None,
        config: STMoEConfig | None = None,
        **knobs: Any,
    ) -> None:
        """``knobs`` override fields of ``config`` (e.g. ``threshold=3, max_set_size=8``)."""
        super().__init__(shape)
        self.config = self.configure(knobs, config)
        self.config.check()
        if tables is None:
            if self.config.use_cct:
                raise PredictorError(f"{self.name!r} needs profiled tables (stmoe profile)")
            ids = np.full((max(shape.num_layers - 1, 0), shape.num_experts, 1), -1, np.int16)
            conf = np.zeros(ids.shape, np.int8)
        else:
            tables.check_fits(shape)
            ids, conf = tables.cct_ids, tables.cct_conf
            check_cct(ids, conf, shape.num_experts)
        # Private copies: online learning must never write into the caller's tables.
        self.cct_ids = np.array(ids, dtype=np.int16, copy=True)  # [L-1, N, R]
        self.cct_conf = np.array(conf, dtype=np.int8, copy=True)  # [L-1, N, R]
        self._history: dict[int, np.ndarray] = {}  # slot -> HT [L, K]
        c = self.config
        scoring = kernels.Scoring(float(c.w_ht), float(c.threshold), bool(c.use_cct),
                                  bool(c.use_ht), int(c.max_set_size))
        # Plain tuples, built once: predict runs at every layer (kernels.Scoring says why).
        self._scoring = tuple(scoring)
        self._scoring0 = tuple(scoring.for_layer0())
        self._scratch = kernels.new_scratch(shape.num_experts)
        self._out = np.empty(shape.num_experts, dtype=np.int16)
        self._empty = np.full(shape.top_k, -1, dtype=np.int16)
        self._no_row_ids = np.full((1, 1), -1, dtype=np.int16)
        self._no_row_conf = np.zeros((1, 1), dtype=np.int8)

    def rank_order_reason(self) -> str:
        """Only the online CCT update reads rank: without it (HT only, static tables) every
        row counts as a set."""
        return self.needs_rank_order if self.config.online and self.config.use_cct else ""

    def reset(self, slot: int = 0) -> None:
        super().reset(slot)
        self._history.pop(slot, None)

    def predict_batch(
        self, layer: int, slots: Sequence[int], max_size: int | None = None
    ) -> np.ndarray:
        """The batch's union, cut to the configured cap unless one is given."""
        cap = self.config.max_set_size if max_size is None else max_size
        return super().predict_batch(layer, slots, cap)

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        self._check_layer(layer)
        c = self.config
        hist = self._history.get(slot)
        ht = self._empty if hist is None else hist[layer]
        if layer == 0:
            if c.layer0 != "ht" or not c.use_ht:
                return self._out[:0].copy()
            n = kernels.predict_next(self._no_row_ids, self._no_row_conf, self._empty, ht,
                                     self._scoring0, self._scratch, self._out)
            return self._out[:n].copy()
        cur = self.token_so_far(slot)
        chosen = self._empty if cur is None else cur[layer - 1]
        n = kernels.predict_next(self.cct_ids[layer - 1], self.cct_conf[layer - 1], chosen, ht,
                                 self._scoring, self._scratch, self._out)
        return self._out[:n].copy()

    def update(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        experts = np.asarray(experts, dtype=np.int16)
        super().update(layer, experts, slot)
        cur = self.token_so_far(slot)
        assert cur is not None
        if self.config.online and layer > 0:
            kernels.update_row(
                self.cct_ids[layer - 1], self.cct_conf[layer - 1], cur[layer - 1], cur[layer],
                self._scratch[2],
            )
        if layer == self.shape.num_layers - 1:  # token done: HT := its experts (docs/method.md)
            self._history[slot] = cur.copy()
            super().reset(slot)

    def plan(self, trace: RoutingTrace) -> PrefetchPlan:
        """Compiled replay (``kernels.plan_trace``); identical to the step-by-step path.

        Learns in place as the step path does, so tables carry over to later calls.
        """
        self.check_shape(ModelShape.of(trace))
        self.check_rows(trace)
        new_seq = np.zeros(trace.num_tokens, dtype=bool)
        new_seq[trace.seq_starts] = True
        c = self.config
        ptr, ids = kernels.plan_trace(
            np.ascontiguousarray(trace.experts, dtype=np.int16), new_seq, self.cct_ids,
            self.cct_conf, self._scoring, c.online, c.layer0 == "ht", self.shape.num_experts,
        )
        # The replay leaves slot 0 holding the last token as history, as the step path does.
        self._history[0] = np.asarray(trace.experts[-1], dtype=np.int16).copy()
        super().reset(0)
        return PrefetchPlan(ptr=ptr, ids=ids, num_layers=trace.num_layers)
