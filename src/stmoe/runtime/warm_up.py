"""Compile before timing: the numba kernels a run calls (the predictor's, the cache's
victim choice) compiled, or loaded from numba's on-disk cache, before `stmoe generate`
(or serve, or the vLLM plugin) times or serves anything.

numba compiles a kernel on its first call: in a fresh environment the first stmoe-plus
run compiled its kernels inside the timed decode (measured: 4.0 tokens/s against 67
once compiled, issue 45). The kernels are cached on disk (``cache=True``: compiled once
per install), and even loading them takes the first call. The warm-up drives a copy of
the run's predictor through the runtime's protocol on made-up routing (one sequence,
then two, as a batch), so the run's own predictor and cache keep their state.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING

import numpy as np

from stmoe import cache_policy as cp

if TYPE_CHECKING:
    from stmoe.predictors.base import Predictor
    from stmoe.runtime.api import OffloadedModel

_TOKENS = 2  # tokens of made-up routing per pass: the second sees the first's history


def warm_up(om: OffloadedModel) -> float:
    """Compile the kernels ``om``'s runs call; the seconds it took."""
    return warm_kernels(om.engine.predictor, max(om.engine.capacities),
                        int(om.config["num_experts"]))


def warm_kernels(predictor: Predictor, capacity: int, n: int) -> float:
    """Compile the kernels an engine with ``predictor`` and ``capacity`` of ``n`` experts
    per layer calls (the vLLM plugin's too); the seconds it took."""
    start = time.perf_counter()
    warm_predictor(predictor, capacity)
    flags, counts = np.zeros(n, dtype=np.bool_), np.zeros(n, dtype=np.int64)
    # the cache's victim choice (runtime.cache), with the argument types it passes: one
    # compiled signature serves every policy, with or without a prediction's scores
    cp.choose_victim(flags, flags, counts, counts, np.zeros(0, dtype=np.int64),
                     np.zeros(n, dtype=np.float32), cp.policy_code("score", cp.RUNTIME))
    return time.perf_counter() - start


def warm_predictor(predictor: Predictor, capacity: int) -> None:
    """Drive a copy of ``predictor`` as the runtime does (reset, lookahead, predict_batch,
    update with int64 router ids) for one sequence and for a batch of two."""
    if not predictor.prefetches or predictor.sees_future:
        return  # ondemand predicts nothing; the oracle replays a first pass
    p = copy.deepcopy(predictor)
    shape, rng = p.shape, np.random.default_rng(0)
    width = min(2 * shape.top_k, shape.num_experts)
    for slots in ([0], [0, 1]):
        for slot in slots:
            p.reset(slot)
        for _ in range(_TOKENS):
            for layer in range(shape.num_layers):
                if p.uses_lookahead:
                    for slot in slots:
                        p.lookahead(layer, rng.permutation(shape.num_experts)[:width], slot)
                p.predict_batch(layer, slots, max_size=capacity)
                for slot in slots:
                    p.update(layer, rng.permutation(shape.num_experts)[: shape.top_k], slot)
