r"""Every reading of "prediction accuracy" the field uses, on one trace and one plan.

Why: the paper reports "prediction accuracy" of 80-89% without a definition public to
this project, and papers on expert prefetching mean different things by the phrase.
These readings put each one side by side on the same (token, layer) steps, so a
figure can be matched to a definition rather than to a guess (docs/method.md,
"Prediction accuracy as the paper may define it").

Per step with routed set A, prefetch set P (ranked, most confident first) and H,
the experts the previous token of the same sequence routed at the same layer (the
HT's contents, on chip from the previous token; empty at a sequence's first token):

- recall = sum |P ∩ A| / sum |A| (stmoe's headline, ``PredictionScore.recall``);
- hit rate with previous = sum |(P ∪ H) ∩ A| / sum |A|;
- precision = sum |P ∩ A| / sum |P|;
- top-K overlap = sum |top_K(P) ∩ A| / sum |A|, top_K(P) the plan's K first ids;
- top-1 covered = share of steps whose router top-1 expert is in P (rank-ordered
  traces only);
- set size = mean |P|.

Pure numpy (no compiled kernel, no torch), in chunks of tokens so memory stays
bounded on long traces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from stmoe.evaluate.metrics import describe_scope, scope_mask, scope_tokens
from stmoe.predictors.base import PrefetchPlan
from stmoe.trace.ranks import is_ranked
from stmoe.trace.schema import RoutingTrace

CHUNK_STEPS = 1 << 16  # (token, layer) steps per chunk: [steps, N] bool masks stay small


@dataclass(frozen=True)
class Readings:
    """The readings over one group of (token, layer) steps, with the counts behind them."""

    recall: float
    hit_rate_with_previous: float
    precision: float
    top_k_overlap: float
    top1_covered: float | None  # None: the trace does not keep router rank order
    set_size: float
    steps: int  # (token, layer) steps in the group
    actual: int  # sum |A|
    predicted: int  # sum |P|
    hits: int  # sum |P ∩ A|
    hits_with_previous: int  # sum |(P ∪ H) ∩ A|
    hits_top_k: int  # sum |top_K(P) ∩ A|

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Accuracy:
    """The readings over the project's scope and, beside it, with layer 0 included."""

    scope: Readings  # decode tokens (all if none marked), layers 1..L-1
    with_layer0: Readings  # the same tokens, every layer
    scope_text: str

    def to_dict(self) -> dict[str, Any]:
        return {"scope": self.scope.to_dict(), "with_layer0": self.with_layer0.to_dict(),
                "scope_text": self.scope_text}


def step_counts(trace: RoutingTrace, plan: PrefetchPlan) -> dict[str, np.ndarray]:
    """Per (token, layer) [T, L] counts: |A|, |P|, |P∩A|, |(P∪H)∩A|, |top_K(P)∩A|,
    whether the top-1 expert exists and whether it is in P."""
    experts = np.asarray(trace.experts)
    t_count, n_layers, k = experts.shape
    n = trace.num_experts
    ptr = np.asarray(plan.ptr, dtype=np.int64)
    ids = np.asarray(plan.ids, dtype=np.int64)
    if plan.num_layers != n_layers or len(ptr) != t_count * n_layers + 1:
        raise ValueError(f"the plan has {len(ptr) - 1} steps of {plan.num_layers} layers; "
                         f"the trace {t_count * n_layers} of {n_layers}")
    # H: the previous token's experts at the same layer, none at a sequence's first token
    prev = np.full_like(experts, -1)
    prev[1:] = experts[:-1]
    prev[np.asarray(trace.seq_starts, dtype=np.int64)] = -1
    valid = experts >= 0
    in_prev = ((experts[..., :, None] == prev[..., None, :]) & (prev[..., None, :] >= 0)).any(-1)
    flat_a = experts.reshape(-1, k)
    out = {name: np.zeros(t_count * n_layers, dtype=np.int64)
           for name in ("actual", "predicted", "hits", "hits_prev", "hits_top_k",
                        "has_top1", "top1_in")}
    out["actual"][:] = valid.reshape(-1, k).sum(1)
    out["predicted"][:] = np.diff(ptr)
    out["has_top1"][:] = flat_a[:, 0] >= 0
    for lo in range(0, t_count * n_layers, CHUNK_STEPS):
        hi = min(lo + CHUNK_STEPS, t_count * n_layers)
        sizes = np.diff(ptr[lo : hi + 1])
        step = np.repeat(np.arange(hi - lo), sizes)
        chunk_ids = ids[ptr[lo] : ptr[hi]]
        rank = np.arange(len(chunk_ids)) - (ptr[lo:hi] - ptr[lo])[step]
        in_p = np.zeros((hi - lo, n), dtype=bool)
        in_p[step, chunk_ids] = True
        in_top = np.zeros((hi - lo, n), dtype=bool)
        in_top[step[rank < k], chunk_ids[rank < k]] = True
        a = flat_a[lo:hi]
        ok = a >= 0
        a_safe = np.where(ok, a, 0)
        rows = np.arange(hi - lo)[:, None]
        p_hit = in_p[rows, a_safe] & ok
        out["hits"][lo:hi] = p_hit.sum(1)
        out["hits_prev"][lo:hi] = (p_hit | (in_prev.reshape(-1, k)[lo:hi] & ok)).sum(1)
        out["hits_top_k"][lo:hi] = (in_top[rows, a_safe] & ok).sum(1)
        out["top1_in"][lo:hi] = p_hit[:, 0]
    return {name: v.reshape(t_count, n_layers) for name, v in out.items()}


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def readings_over(counts: dict[str, np.ndarray], mask: np.ndarray, rank_order: bool) -> Readings:
    """Sum ``step_counts`` where ``mask`` ([T, L] bool) holds, into the readings."""
    s = {name: int(v[mask].sum()) for name, v in counts.items()}
    steps = int(np.count_nonzero(mask))
    return Readings(
        recall=_ratio(s["hits"], s["actual"]),
        hit_rate_with_previous=_ratio(s["hits_prev"], s["actual"]),
        precision=_ratio(s["hits"], s["predicted"]),
        top_k_overlap=_ratio(s["hits_top_k"], s["actual"]),
        top1_covered=_ratio(s["top1_in"], s["has_top1"]) if rank_order else None,
        set_size=_ratio(s["predicted"], steps),
        steps=steps, actual=s["actual"], predicted=s["predicted"], hits=s["hits"],
        hits_with_previous=s["hits_prev"], hits_top_k=s["hits_top_k"],
    )


def accuracy(trace: RoutingTrace, plan: PrefetchPlan) -> Accuracy:
    """Every reading of ``plan`` on ``trace``: over stmoe's scope (decode tokens, layers
    1..L-1, docs/method.md) and over the same tokens with layer 0 included."""
    counts = step_counts(trace, plan)
    rank_order = is_ranked(trace)
    every_layer = np.broadcast_to(scope_tokens(trace)[:, None], counts["actual"].shape)
    return Accuracy(
        scope=readings_over(counts, scope_mask(trace), rank_order),
        with_layer0=readings_over(counts, every_layer, rank_order),
        scope_text=describe_scope(trace),
    )


def null_readings(num_experts: int, top_k: int, set_size: float) -> dict[str, float]:
    """What a uniformly random prefetch set of ``set_size`` experts scores when routing is
    uniform random top-K of N (the null model of docs/method.md), independent of P and H:
    the floor any reading of a real predictor should be set against."""
    n, k = float(num_experts), float(top_k)
    s = min(max(float(set_size), 0.0), n)
    p_in = s / n
    h_in = k / n
    return {
        "recall": p_in,
        "hit_rate_with_previous": 1.0 - (1.0 - p_in) * (1.0 - h_in),
        "precision": k / n if s > 0 else 0.0,
        "top_k_overlap": min(s, k) / n,
        "top1_covered": p_in,
        "set_size": s,
    }
