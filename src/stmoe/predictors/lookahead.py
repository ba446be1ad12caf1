"""gate-lookahead: the next layer's router applied ahead of time, alone.

Capture records it (the trace's ``lookahead``: early, on this layer's MoE input;
``lookahead_late``: late, on the next layer's own input through its pre-MoE
norm) and the runtime computes it live; hybrid fuses it with stmoe-plus's
tables. This module holds the predictor that takes nothing else.
"""

from __future__ import annotations

import numpy as np

from stmoe.predictors.base import ModelShape, Predictor, PredictorError, register
from stmoe.predictors.lookahead_points import check_point
from stmoe.predictors.tables import ProfiledTables


@register
class LookaheadPredictor(Predictor):
    """Gate lookahead alone: the next layer's router on this layer's hidden state.

    No tables: the ``set_size`` best ids of the lookahead (K by default); nothing at
    layer 0 or when no lookahead was given. The runtime computes the lookahead
    live; replay reads the trace's ``lookahead`` array.
    """

    name = "gate-lookahead"
    uses_lookahead = True

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None = None,
                 set_size: int = 0, lookahead: str = "auto") -> None:
        super().__init__(shape)
        if set_size < 0:
            raise PredictorError(f"set_size {set_size}: expected 0 (K) or a positive count")
        check_point(lookahead)
        self.lookahead_pref = lookahead
        self.set_size = set_size or shape.top_k
        self._look: dict[tuple[int, int], np.ndarray] = {}

    def lookahead(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        self._look[(slot, layer)] = np.asarray(experts, dtype=np.int16)

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        self._check_layer(layer)
        look = self._look.pop((slot, layer), None)
        if look is None:
            return np.zeros(0, dtype=np.int16)
        return look[look >= 0][: self.set_size].copy()
