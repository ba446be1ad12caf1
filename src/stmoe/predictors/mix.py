"""stmoe-mix: per-domain stmoe-plus tables weighted online by their recent hit rate.

One server may take code and chat at once; tables profiled on one domain
predict another worse (the cross-domain matrix shows it). stmoe-mix keeps one
stmoe-plus member per profiled domain (``stmoe profile --by-domain``); each
scores the experts, and the mixture weighs the members' normalised scores by
``exp(eta * h_d)``, where ``h_d`` is member d's hit rate on the slot's recent
steps (an exponential moving average with factor ``memory``). Every member keeps
learning online. Each slot (sequence) keeps its own weights, so a batch can mix
domains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stmoe.predictors.base import ModelShape, Predictor, PredictorError, register
from stmoe.predictors.plus import PlusPredictor
from stmoe.predictors.plus import sizing as pk
from stmoe.predictors.tables import ProfiledTables


@dataclass(frozen=True)
class MixConfig:
    set_size: float = 0.0  # experts per prediction (0 = K); fractional means alternate
    eta: float = 8.0  # sharpness of the weighting by recent hit rate
    memory: float = 0.9  # per-step weight of the past in each member's hit rate


@register
class MixPredictor(Predictor):
    """A mixture of per-domain stmoe-plus members; see the module docstring."""

    name = "stmoe-mix"
    scores_experts = True
    config_class = MixConfig
    needs_tables = True
    needs_domain_tables = True

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None, **knobs: Any) -> None:
        super().__init__(shape)
        self.config = self.configure(knobs)
        if tables is None or not tables.per_domain:
            raise PredictorError("stmoe-mix needs per-domain tables: profile with "
                                 "`stmoe profile --by-domain` (2 or more domains)")
        tables.check_fits(shape)
        self.domains = list(tables.per_domain)
        self.members = [PlusPredictor(shape, t) for t in tables.per_domain.values()]
        self.mean_set_size = (float(self.config.set_size) if self.config.set_size > 0
                              else float(shape.top_k))
        self._hit: dict[int, np.ndarray] = {}  # slot -> [D] recent hit rate per member
        self._last: dict[tuple[int, int], list[np.ndarray]] = {}  # (slot, layer) -> sets
        self._ctl = np.zeros(2)
        self._out = np.zeros(shape.num_experts, dtype=np.int64)

    def reset(self, slot: int = 0) -> None:
        super().reset(slot)
        for m in self.members:
            m.reset(slot)
        self._hit.pop(slot, None)

    def weights(self, slot: int = 0) -> np.ndarray:
        """The members' current mixture weights for ``slot`` (sum to 1)."""
        h = self._hit.get(slot)
        if h is None:
            return np.full(len(self.members), 1.0 / len(self.members))
        w = np.exp(self.config.eta * (h - h.max()))
        return w / w.sum()

    def scores(self, layer: int, slot: int = 0) -> np.ndarray:
        mixed = np.zeros(self.shape.num_experts)
        sets = []
        k = self.shape.top_k
        for w, m in zip(self.weights(slot), self.members, strict=True):
            s = m.scores(layer, slot)
            sets.append(np.argsort(-s, kind="stable")[:k])  # the member's own top-K guess
            mixed += w * s / max(s.sum(), 1e-300)
        self._last[(slot, layer)] = sets
        return mixed

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        return self.predict_scored(layer, slot)[0]

    def predict_scored(self, layer: int, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        scores = self.scores(layer, slot)
        b = pk.set_size(scores, self.mean_set_size, False, self._ctl,
                        min(self.shape.num_experts, int(np.ceil(self.mean_set_size))),
                        layer)
        pk.top_by_score(scores, b, self._out)
        return self._out[:b].astype(np.int16), scores.astype(np.float32)

    def update(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        experts = np.asarray(experts, dtype=np.int16)
        super().update(layer, experts, slot)
        sets = self._last.pop((slot, layer), None)
        if sets is not None:
            chosen = set(experts[experts >= 0].tolist())
            hits = np.array([len(chosen.intersection(s.tolist())) / max(len(chosen), 1)
                             for s in sets])
            h = self._hit.get(slot)
            a = self.config.memory
            self._hit[slot] = hits if h is None else a * h + (1 - a) * hits
        for m in self.members:
            m.update(layer, experts, slot)
        if layer == self.shape.num_layers - 1:
            super().reset(slot)
