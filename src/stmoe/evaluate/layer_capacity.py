"""Each layer's cache size from hit-rate curves: the same total, spent where it buys hits.

Why: a cache of the same size at every layer (``--capacity 50%``) spends as many slots on
a layer whose experts the predictor names well, which needs few beyond its prefetch set,
as on one it cannot, which needs many. Every layer's cache is its own and the prefetch
plan does not depend on what is cached, so a layer's hits at capacity ``c`` are the same
whatever the other layers hold: curves measured one capacity at a time (``layer_hits``)
price every split of a total exactly, and ``allocate`` picks one greedily.

The curves must come from routing other than the one judged (the tables' own routing
makes later layers look predictable that are not): benchmarks/bench_layer_capacity.py
measures them cross-fitted and judges the split held out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stmoe.evaluate.cache_replay import replay_cache
from stmoe.evaluate.metrics import scope_tokens
from stmoe.predictors import ModelShape, make, profile
from stmoe.predictors.base import PredictorError, PrefetchPlan
from stmoe.trace.schema import RoutingTrace
from stmoe.trace.select import held_out_tail, select_sequences

# a trace of one sequence (one long prompt's routing): its first 60% of tokens profiled, the
# rest replayed after the 8 tokens before them (as the GPU check splits its sample)
ONE_SEQUENCE_AT, TAIL_PROMPT = 0.6, 8


def default_grid(num_experts: int, top_k: int, steps: int = 32) -> list[int]:
    """Capacities to measure: top-k, then multiples of ``num_experts / steps`` above it, up
    to every expert."""
    step = max(1, num_experts // steps)
    return sorted({top_k, *range(step * (top_k // step + 1), num_experts + 1, step)})


def layer_hits(trace: RoutingTrace, plan: PrefetchPlan, grid: Sequence[int],
               policy: str = "lru", count_mask: np.ndarray | None = None,
               scores: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([L, G] hits of each layer at each capacity of ``grid``, [L] uses demanded): one
    cache replay per capacity (``replay_cache``'s arguments)."""
    hits = np.zeros((trace.num_layers, len(grid)), dtype=np.int64)
    demanded = np.zeros(trace.num_layers, dtype=np.int64)
    for i, c in enumerate(grid):
        s = replay_cache(trace, plan, int(c), policy, count_mask, scores)
        hits[:, i] = s.layer_hits
        demanded = np.asarray(s.layer_demanded, dtype=np.int64)
    return hits, demanded


def allocate(hits: np.ndarray, grid: Sequence[int], total: int,
             num_experts: int | None = None) -> np.ndarray:
    """[L] experts per layer summing to ``total`` (at most every expert of every layer):
    each layer starts at ``grid[0]``, then the budget goes, a grid step or several at a
    time, to the layer whose hits (``hits``: [L, G], summed over any number of curves) rise
    most per slot; several steps are weighed at once, so a curve flat before a rise still
    wins its rise. What no step can buy is spread a slot at a time over the layers the
    last step would have helped most (ties: the lower layer)."""
    grid = [int(c) for c in grid]
    if list(grid) != sorted(set(grid)) or not grid:
        raise PredictorError(f"capacity grid {grid}: expected distinct increasing sizes")
    curves = np.asarray(hits, dtype=np.float64)
    layers = curves.shape[0]
    if curves.shape != (layers, len(grid)):
        raise PredictorError(f"hit curves of shape {curves.shape} for a grid of {len(grid)}")
    top = grid[-1] if num_experts is None else num_experts
    if total < grid[0] * layers:
        raise PredictorError(f"{total} cache slots cannot give {layers} layers {grid[0]} each")
    at = np.zeros(layers, dtype=np.int64)  # each layer's index into grid
    left = total - grid[0] * layers
    while True:
        best, pick = 0.0, None
        for layer in range(layers):
            i = at[layer]
            for j in range(i + 1, len(grid)):
                cost = grid[j] - grid[i]
                if cost > left:
                    break
                gain = (curves[layer, j] - curves[layer, i]) / cost
                if gain > best:
                    best, pick = gain, (layer, j)
        if pick is None:
            break
        layer, j = pick
        left -= grid[j] - grid[at[layer]]
        at[layer] = j
    caps = np.asarray(grid, dtype=np.int64)[at]
    nxt = np.minimum(at + 1, len(grid) - 1)  # what one more step would have bought
    rise = curves[np.arange(layers), nxt] - curves[np.arange(layers), at]
    order = sorted(range(layers), key=lambda layer: (-rise[layer], layer))
    while left > 0 and (caps < top).any():
        for layer in order:
            if left and caps[layer] < top:
                caps[layer] += 1
                left -= 1
    return caps


@dataclass(frozen=True)
class Split:
    """A split of ``total`` slots (``capacities``, one per layer) and what it and the same
    size everywhere (``uniform``) hit on the curves it was chosen from (``hit_rate``,
    ``uniform_hit_rate``: an estimate that favours the split, which was fitted to them)."""

    capacities: tuple[int, ...]
    uniform: int
    hit_rate: float
    uniform_hit_rate: float
    folds: int


def cross_fitted_hits(trace: RoutingTrace, predictor: str, policy: str, grid: Sequence[int],
                      folds: int = 5,
                      progress: Callable[[int, int], None] | None = None,
                      options: Mapping[str, Any] | None = None
                      ) -> tuple[np.ndarray, np.ndarray, int]:
    """``layer_hits`` of ``predictor`` (made with ``options``; its prefetches, cache
    ``policy``: ``lru`` where it scores no expert) with each of ``folds`` parts of the
    sequences replayed with tables profiled on the others (held out: why, the module
    docstring; one sequence: its tail with tables of its head, ``_parts``); summed over the
    parts, and how many parts there were. ``progress(done,
    of)`` after each part."""
    n = trace.num_sequences
    parts = min(folds, n)
    shape = ModelShape.of(trace)
    hits = np.zeros((trace.num_layers, len(grid)), dtype=np.int64)
    demanded = np.zeros(trace.num_layers, dtype=np.int64)
    for part in range(parts):
        held, rest = _parts(trace, part, parts)
        p = make(predictor, shape, profile(rest), **(options or {}))
        use = "lru" if policy == "score" and not p.scores_experts else policy
        plan, scores = p.scored_plan(held) if use == "score" else (p.plan(held), None)
        h, d = layer_hits(held, plan, grid, use, scope_tokens(held), scores)
        hits, demanded = hits + h, demanded + d
        if progress is not None:
            progress(part + 1, parts)
    return hits, demanded, parts


def _parts(trace: RoutingTrace, part: int, parts: int) -> tuple[RoutingTrace, RoutingTrace]:
    """(replayed, profiled) of fold ``part``: every ``parts``-th sequence against the
    others; a trace of one sequence is cut by tokens instead (``held_out_tail``: from
    ``ONE_SEQUENCE_AT`` of its tokens, or its first decoded one if later, replayed after the
    ``TAIL_PROMPT`` tokens before them, with tables of the tokens before)."""
    n = trace.num_sequences
    if n > 1:
        return (select_sequences(trace, [i for i in range(n) if i % parts == part]),
                select_sequences(trace, [i for i in range(n) if i % parts != part]))
    decode = np.flatnonzero(np.asarray(trace.is_decode))
    if not len(decode):
        raise PredictorError(f"sizing a split from one sequence of {trace.num_tokens} tokens, "
                             "all of them prompt: the split is judged on generated tokens, "
                             "replayed with tables of the tokens before them (a trace with "
                             "generated tokens, or more sequences)")
    at = max(round(ONE_SEQUENCE_AT * trace.num_tokens), int(decode[0]))
    prompt = min(TAIL_PROMPT, at - 1)
    if prompt < 1 or trace.num_tokens - at < 2:
        raise PredictorError(f"sizing a split from one sequence ({trace.num_tokens} tokens, "
                             f"{len(decode)} of them generated): too short to replay its decode "
                             "tail with tables of the rest (a longer one, or more sequences)")
    head, tail = held_out_tail(trace, at, prompt)
    return tail, head


def size_split(trace: RoutingTrace, uniform: int, predictor: str = "stmoe-plus",
               policy: str = "lru", folds: int = 5,
               progress: Callable[[int, int], None] | None = None,
               options: Mapping[str, Any] | None = None) -> Split:
    """The split of ``uniform`` slots a layer (the same total) that ``allocate`` picks from
    ``trace``'s cross-fitted curves (``cross_fitted_hits``)."""
    grid = default_grid(trace.num_experts, trace.top_k)
    if uniform not in grid:
        grid = sorted({*grid, uniform})
    hits, demanded, parts = cross_fitted_hits(trace, predictor, policy, grid, folds, progress,
                                              options)
    caps = allocate(hits, grid, uniform * trace.num_layers, trace.num_experts)
    # the split's own points may lie between the grid's: its hits read at the point below
    at = [max(i for i, c in enumerate(grid) if c <= cap) for cap in caps]
    total = max(int(demanded.sum()), 1)
    return Split(tuple(int(c) for c in caps), uniform,
                 float(sum(hits[layer, i] for layer, i in enumerate(at))) / total,
                 float(hits[:, grid.index(uniform)].sum()) / total, parts)
