"""The field's baselines, behind the same interface as ST-MoE.

- ``ondemand``: prefetch nothing; every expert loads when the router asks.
- ``previous-token``, ``cct-static``, ``cct-online``: ST-MoE's ablations (docs/method.md:
  HT-only uses threshold = w_ht).
- ``frequency``: the B experts each layer used most during profiling.
- ``random``: B experts drawn uniformly per (token, layer), seeded.
- ``oracle``: the true set; bounds what any predictor can reach.
"""

from __future__ import annotations

import numpy as np

from stmoe.predictors.base import ModelShape, Predictor, PredictorError, PrefetchPlan, register
from stmoe.predictors.st_moe import STMoEConfig, STMoEPredictor
from stmoe.predictors.tables import ProfiledTables
from stmoe.trace.schema import RoutingTrace


def plan_from_sets(sets: np.ndarray, keep: np.ndarray, num_layers: int) -> PrefetchPlan:
    """A plan from a [T, L, B] array of ids (rank order), keeping entries where ``keep``."""
    counts = keep.sum(axis=-1).reshape(-1)  # per (token, layer); an empty B is 0
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return PrefetchPlan(ptr=ptr, ids=sets[keep].astype(np.int16), num_layers=num_layers)


@register
class OnDemandPredictor(Predictor):
    """Prefetch nothing: the baseline every method is compared against."""

    name = "ondemand"
    prefetches = False

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        return np.zeros(0, dtype=np.int16)

    def plan(self, trace: RoutingTrace) -> PrefetchPlan:
        self.check_shape(ModelShape.of(trace))
        ptr = np.zeros(trace.num_tokens * trace.num_layers + 1, dtype=np.int64)
        return PrefetchPlan(ptr=ptr, ids=np.zeros(0, dtype=np.int16), num_layers=trace.num_layers)


@register
class PreviousTokenPredictor(STMoEPredictor):
    """HT only: prefetch the previous token's experts at the same layer."""

    name = "previous-token"
    needs_tables = False
    needs_rank_order = ""  # no online CCT update: rows are sets

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None = None, w_ht: float = 1.0,
                 max_set_size: int = 0) -> None:
        config = STMoEConfig(use_cct=False, online=False, w_ht=w_ht, threshold=w_ht,
                             max_set_size=max_set_size)
        super().__init__(shape, None, config)


@register
class CCTStaticPredictor(STMoEPredictor):
    """CCT only, as profiled: no history, no online learning."""

    name = "cct-static"
    needs_rank_order = ""  # no online CCT update: rows are sets

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None,
                 max_set_size: int = 0) -> None:
        super().__init__(shape, tables, STMoEConfig(use_ht=False, online=False,
                                                    max_set_size=max_set_size))


@register
class CCTOnlinePredictor(STMoEPredictor):
    """CCT only, with Algorithm 3's online updates."""

    name = "cct-online"

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None,
                 max_set_size: int = 0) -> None:
        super().__init__(shape, tables, STMoEConfig(use_ht=False, online=True,
                                                    max_set_size=max_set_size))


@register
class FrequencyPredictor(Predictor):
    """Per layer, the ``set_size`` experts most used in profiling (ties to the smaller id)."""

    name = "frequency"
    needs_tables = True

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None, set_size: int = 0) -> None:
        super().__init__(shape)
        if tables is None:
            raise PredictorError("'frequency' needs profiled tables (stmoe profile)")
        tables.check_fits(shape)
        b = set_size or shape.top_k
        order = np.argsort(-tables.layer_counts, axis=1, kind="stable")[:, :b]
        used = np.take_along_axis(tables.layer_counts, order, axis=1) > 0
        self.top = [order[layer][used[layer]].astype(np.int16) for layer in range(shape.num_layers)]

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        self._check_layer(layer)
        return self.top[layer].copy()

    def plan(self, trace: RoutingTrace) -> PrefetchPlan:
        self.check_shape(ModelShape.of(trace))
        width = max(len(s) for s in self.top)
        sets = np.full((trace.num_layers, width), -1, dtype=np.int64)
        for layer, s in enumerate(self.top):
            sets[layer, : len(s)] = s
        sets = np.broadcast_to(sets, (trace.num_tokens, *sets.shape))
        return plan_from_sets(sets, sets >= 0, trace.num_layers)


@register
class RandomPredictor(Predictor):
    """``set_size`` distinct experts drawn uniformly for every (token, layer), seeded.

    Draws N uniforms per call and keeps the ``set_size`` largest, so the compiled
    plan (which draws the same stream in blocks) gives the same sets.
    """

    name = "random"

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None = None, set_size: int = 0,
                 seed: int = 0) -> None:
        super().__init__(shape)
        self.set_size = min(set_size or shape.top_k, shape.num_experts)
        self.rng = np.random.default_rng(seed)

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        self._check_layer(layer)
        draw = self.rng.random(self.shape.num_experts)
        return np.argsort(-draw, kind="stable")[: self.set_size].astype(np.int16)

    def plan(self, trace: RoutingTrace) -> PrefetchPlan:
        self.check_shape(ModelShape.of(trace))
        n, n_layers = self.shape.num_experts, trace.num_layers
        per_token = n_layers * n
        block = max(1, (1 << 22) // per_token)  # ~32 MB of uniforms at a time
        sets = []
        for a in range(0, trace.num_tokens, block):
            count = min(block, trace.num_tokens - a)
            draw = self.rng.random((count, n_layers, n))  # same stream as per-call draws
            sets.append(np.argsort(-draw, axis=2, kind="stable")[:, :, : self.set_size])
        all_sets = np.concatenate(sets)
        return plan_from_sets(all_sets, np.ones(all_sets.shape, dtype=bool), n_layers)


@register
class OraclePredictor(Predictor):
    """The router's true set for the layer: recall 1 and no waste, by construction."""

    name = "oracle"
    sees_future = True

    def __init__(self, shape: ModelShape, tables: ProfiledTables | None = None) -> None:
        super().__init__(shape)
        self._revealed: dict[int, np.ndarray] = {}

    def reset(self, slot: int = 0) -> None:
        super().reset(slot)
        self._revealed.pop(slot, None)

    def reveal(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        self._revealed[slot] = np.asarray(experts, dtype=np.int16)

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        chosen = self._revealed.get(slot)
        if chosen is None:
            raise PredictorError("the oracle needs reveal(layer, experts) before predict: "
                                 "offloaded, it runs only in OffloadedModel.generate or "
                                 "measure (a second pass that knows the routing)")
        return chosen[chosen >= 0].copy()

    def plan(self, trace: RoutingTrace) -> PrefetchPlan:
        self.check_shape(ModelShape.of(trace))
        experts = np.asarray(trace.experts)
        return plan_from_sets(experts, experts >= 0, trace.num_layers)
