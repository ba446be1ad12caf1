"""Replay evaluation: run predictors over a trace and measure them (pure: no I/O).

Order (docs/method.md): tokens one at a time in trace order, prefill included, so online
tables learn from the prompt too; within a token, layer by layer. Headline
figures cover decode tokens (when the trace marks them) at layers 1..L-1.
A trace whose rows are sets (``trace.ranks``) is replayed in their canonical order,
so every result is a function of the sets; a predictor that reads rank refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.evaluate.cache_replay import CacheStats, replay_cache
from stmoe.evaluate.metrics import (
    PredictionScore,
    describe_scope,
    scope_layers,
    scope_mask,
    scope_tokens,
    score,
)
from stmoe.predictors import (
    ModelShape,
    Predictor,
    ProfiledTables,
    accepted_options,
    make,
    profile,
)
from stmoe.predictors.kernels import plan_hits
from stmoe.trace.ranks import as_sets
from stmoe.trace.schema import RoutingTrace
from stmoe.trace.select import select_domain, split_auto


@dataclass(frozen=True, eq=False)
class PredictorResult:
    """One predictor's replay: per-step counts and what they sum to."""

    name: str
    hits: np.ndarray  # [T, L] int32, |P ∩ A|
    sizes: np.ndarray  # [T, L] int32, |P|
    actual: np.ndarray  # [T, L] int32, |A|
    budgets: np.ndarray  # [B] int64
    curve_hits: np.ndarray  # [B] int64, over the scope, sets cut to each budget
    curve_sizes: np.ndarray  # [B] int64
    scope: np.ndarray  # [T, L] bool
    cache: CacheStats | None = None
    bound: CacheStats | None = None  # the same prefetches under belady (cache_replay): the
    # most hits any eviction could make, beside the cache's policy

    @property
    def overall(self) -> PredictionScore:
        return score(self.hits, self.sizes, self.actual, self.scope)

    def over(self, mask: np.ndarray) -> PredictionScore:
        return score(self.hits, self.sizes, self.actual, mask)

    def curve(self) -> dict[str, list[float]]:
        actual = max(int(self.actual[self.scope].sum()), 1)
        steps = max(int(np.count_nonzero(self.scope)), 1)
        return {
            "budget": self.budgets.tolist(),
            "recall": (self.curve_hits / actual).tolist(),
            "set_size": (self.curve_sizes / steps).tolist(),
        }


@dataclass(frozen=True, eq=False)
class ReplayResult:
    """Every predictor's result on one trace, and the groupings to report them by."""

    trace: RoutingTrace
    results: dict[str, PredictorResult]
    cross_domain: dict[str, Any] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of ``stmoe eval --json``."""
        tr = self.trace
        tokens, layers = scope_tokens(tr), scope_layers(tr)
        decode = np.asarray(tr.is_decode, dtype=bool)
        seq = tr.sequence_of_token()
        out: dict[str, Any] = {
            "trace": {
                "model": tr.meta.model,
                "synthetic": tr.meta.synthetic,
                "tokens": tr.num_tokens,
                "layers": tr.num_layers,
                "top_k": tr.top_k,
                "num_experts": tr.num_experts,
                "decode_tokens": int(decode.sum()),
            },
            "scope": describe_scope(tr),
            "predictors": {},
        }
        for name, r in self.results.items():
            entry: dict[str, Any] = r.overall.to_dict()
            entry["per_layer"] = [
                r.over(tokens[:, None] & (np.arange(tr.num_layers) == layer)[None, :]).to_dict()
                for layer in range(tr.num_layers)
            ]
            entry["per_domain"] = {
                d: r.over(np.isin(seq, [i for i, x in enumerate(tr.domains) if x == d])[:, None]
                          & tokens[:, None] & layers[None, :]).to_dict()
                for d in dict.fromkeys(tr.domains)
            }
            entry["decode"] = r.over(decode[:, None] & layers[None, :]).to_dict()
            entry["prefill"] = r.over(~decode[:, None] & layers[None, :]).to_dict()
            entry["budget_curve"] = r.curve()
            if r.cache is not None:
                entry["cache"] = r.cache.to_dict()
            if r.bound is not None:
                entry["cache"]["bound_hit_rate"] = r.bound.hit_rate
            out["predictors"][name] = entry
        if self.cross_domain is not None:
            out["cross_domain"] = self.cross_domain
        return out


def default_budgets(trace: RoutingTrace) -> np.ndarray:
    """1..4K experts (capped at N): from well under to well over one token's need."""
    return np.arange(1, min(4 * trace.top_k, trace.num_experts) + 1, dtype=np.int64)


def evaluate(
    trace: RoutingTrace,
    predictor: Predictor,
    name: str | None = None,
    *,
    budgets: np.ndarray | None = None,
    capacity: int | None = None,
    policy: str = "lru",
) -> PredictorResult:
    """Replay one predictor over ``trace`` (the predictor learns as it goes). With policy
    ``score``, a predictor that scores no expert runs its cache as ``lru`` (its
    ``cache.policy`` says so)."""
    trace = as_sets(trace)  # (itself where ranked; a predictor reading rank refuses in plan)
    scored = capacity is not None and policy == "score"
    scores = None
    if scored and predictor.scores_experts:
        plan, scores = predictor.scored_plan(trace)
    else:
        plan = predictor.plan(trace)
        policy = "lru" if scored else policy
    budgets = default_budgets(trace) if budgets is None else np.asarray(budgets, dtype=np.int64)
    mask = scope_mask(trace)
    hits, sizes, actual, curve_hits, curve_sizes = plan_hits(
        np.ascontiguousarray(trace.experts, dtype=np.int16), plan.ptr, plan.ids,
        trace.num_experts, budgets, mask,
    )
    cache = bound = None
    if capacity is not None:
        cache = replay_cache(trace, plan, capacity, policy, scope_tokens(trace), scores)
        bound = cache if policy == "belady" else replay_cache(trace, plan, capacity, "belady",
                                                              scope_tokens(trace))
    return PredictorResult(
        name=name or predictor.name, hits=hits, sizes=sizes, actual=actual, budgets=budgets,
        curve_hits=curve_hits, curve_sizes=curve_sizes, scope=mask, cache=cache, bound=bound,
    )


def replay(
    trace: RoutingTrace,
    predictors: Sequence[str] | Mapping[str, Predictor],
    tables: ProfiledTables | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    capacity: int | None = None,
    policy: str = "lru",
    budgets: np.ndarray | None = None,
) -> ReplayResult:
    """Replay several predictors (names, built with ``tables`` and ``options``, or
    ready instances) over ``trace``, each from a fresh start."""
    shape = ModelShape.of(trace)
    if tables is not None:
        tables.check_trace(trace)
    if not isinstance(predictors, Mapping):
        predictors = {
            n: make(n, shape, tables, **_options_for(n, options or {})) for n in predictors
        }
    for p in predictors.values():  # every refusal before any replay runs
        p.check_rows(trace)
    results = {
        name: evaluate(trace, p, name, budgets=budgets, capacity=capacity, policy=policy)
        for name, p in predictors.items()
    }
    return ReplayResult(trace=trace, results=results)


def _options_for(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Shared options (set_size, max_set_size, seed) go to the predictors taking them."""
    accepted = accepted_options(name)
    return {k: v for k, v in options.items() if k in accepted}


def cross_domain_matrix(
    trace: RoutingTrace, predictor: str = "stmoe", fraction: float = 0.5, **options: Any
) -> dict[str, Any]:
    """Profile on domain A, evaluate on domain B, for every pair of domains present.

    Each domain is split into a profiling part (its first ``fraction``, by sequence
    when it has several, else by token) and an evaluation part, so the diagonal is
    measured on held-out data too. Every cell covers the same tokens as the
    headline recall of the whole trace (decode tokens when it marks any) at layers
    1..L-1; a cell is None when a domain is too small to split or has no such
    token. ``options`` go to the predictor (e.g. ``set_size``).
    """
    domains = list(dict.fromkeys(trace.domains))
    decode_scope = bool(np.asarray(trace.is_decode).any())
    parts: dict[str, tuple[RoutingTrace, RoutingTrace] | None] = {}
    for d in domains:
        try:
            parts[d] = split_auto(select_domain(trace, d), fraction)
        except TraceError:
            parts[d] = None  # too small to hold out anything
    shape = ModelShape.of(trace)
    options = _options_for(predictor, options)
    recall: list[list[float | None]] = []
    for a in domains:
        tables = profile(parts[a][0]) if parts[a] else None
        row: list[float | None] = []
        for b in domains:
            if tables is None or parts[b] is None:
                row.append(None)
                continue
            held_out = parts[b][1]
            result = evaluate(held_out, make(predictor, shape, tables, **options))
            tokens = (
                np.asarray(held_out.is_decode)
                if decode_scope
                else np.ones(held_out.num_tokens, bool)
            )
            s = result.over(tokens[:, None] & scope_layers(held_out)[None, :])
            row.append(s.recall if s.actual else None)
        recall.append(row)
    return {"predictor": predictor, "profiled_on": domains, "evaluated_on": domains,
            "scope": describe_scope(trace), "recall": recall}
