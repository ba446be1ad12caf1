"""All the figures of ``stmoe analyze`` as one JSON-ready dict (pure: no I/O).

Keys that are a contract: ``spatial.pairs_significant``, ``spatial.pairs_total``,
``temporal.overlap_ratio`` (mean over layers of observed overlap / (K^2/N)).
"""

from __future__ import annotations

import warnings
from itertools import combinations
from typing import Any

import numpy as np

from stmoe.analysis.stats import (
    ALPHA,
    batch_means_ci,
    consecutive_overlap,
    js_divergence,
    load_skew,
    reuse_distances,
    spatial_test,
)
from stmoe.errors import StmoeNote
from stmoe.evaluate.replay import replay
from stmoe.predictors import names_for, profile, rank_readers
from stmoe.trace.ranks import is_ranked
from stmoe.trace.schema import RoutingTrace
from stmoe.trace.select import select_domain, split_auto
from stmoe.trace.summary import expert_load, summarize

REUSE_MAX = 64  # reuse-distance histogram: 1..63 tokens, then one bin for >= 64


def spatial(trace: RoutingTrace) -> dict[str, Any]:
    """Independence tests for every adjacent layer pair."""
    experts = np.asarray(trace.experts)
    tests = [
        spatial_test(experts, layer, trace.num_experts) for layer in range(trace.num_layers - 1)
    ]
    empty = [layer for layer in range(trace.num_layers) if not (experts[:, layer] >= 0).any()]
    if empty and trace.num_layers > 1:
        warnings.warn(f"layer{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} "
                      "routed no token (every slot -1): the layer pairs with "
                      f"{'them' if len(empty) > 1 else 'it'} have nothing to test and count "
                      "as not significant", StmoeNote, stacklevel=2)
    return {
        "alpha": ALPHA,
        "pairs_total": len(tests),
        "pairs_significant": sum(t.significant for t in tests),
        "expected_false_positives": ALPHA * len(tests),
        "pairs": [t.to_dict() for t in tests],
    }


def temporal(trace: RoutingTrace) -> dict[str, Any]:
    """Consecutive-token overlap per layer against random routing, and reuse distances."""
    k, n = trace.top_k, trace.num_experts
    expected = k * k / n  # docs/method.md: E[overlap] = K^2 / N for random top-K routing
    overlap = consecutive_overlap(trace)  # [P, L]
    load = expert_load(trace)
    share = load / max(trace.num_tokens, 1)  # P(expert chosen) per layer
    # a layer that routed nothing has no overlap to compare (its ratios null) and stays out
    # of the headline's mean (it pulled "0.84x random" out of 1.0x layers: a review)
    routed = (np.asarray(trace.experts) >= 0).any(axis=(0, 2))
    per_layer = []
    for layer in range(trace.num_layers):
        ci = batch_means_ci(overlap[:, layer])
        per_layer.append({
            "layer": layer, "overlap": ci.mean, "ci": [ci.ci_low, ci.ci_high],
            "ratio": ci.mean / expected if routed[layer] else None,
            "ratio_vs_load": (ci.mean / float((share[layer] ** 2).sum()) if routed[layer]
                              else None),
        })
    kept = overlap[:, routed] if routed.any() else overlap
    overall = batch_means_ci(kept.mean(axis=1) if kept.size else kept[:, :0].sum(axis=1))
    hist = reuse_distances(trace, REUSE_MAX)
    p = k / n  # random routing: an expert returns after a geometric number of tokens
    geometric = p * (1 - p) ** np.arange(REUSE_MAX)
    geometric[-1] = (1 - p) ** (REUSE_MAX - 1)
    return {
        "expected_overlap": expected,
        "overlap": overall.mean,
        "overlap_ratio": overall.mean / expected,
        "overlap_ratio_ci": [overall.ci_low / expected, overall.ci_high / expected],
        "token_pairs": overall.pairs,
        "ci_method": "method of batch means (20 contiguous batches), 95%",
        "per_layer": per_layer,
        "reuse_distance": {
            "distance": list(range(1, REUSE_MAX + 1)),
            "count": hist[1:].tolist(),
            "random_expectation_share": geometric.tolist(),
            "last_bin_is_at_least": REUSE_MAX,
        },
    }


def load(trace: RoutingTrace) -> dict[str, Any]:
    counts = expert_load(trace)
    return {"per_layer_counts": counts.tolist(), **load_skew(counts)}


def domains(trace: RoutingTrace) -> dict[str, Any] | None:
    """Per-domain headline figures and how differently domains use the experts."""
    labels = list(dict.fromkeys(trace.domains))
    if len(labels) < 2:
        return None
    parts = {d: select_domain(trace, d) for d in labels}
    loads = {d: expert_load(p) for d, p in parts.items()}
    per_domain = {}
    for d, part in parts.items():
        s, t = spatial(part), temporal(part)
        skew = load_skew(loads[d])
        per_domain[d] = {
            "tokens": part.num_tokens,
            "pairs_significant": s["pairs_significant"],
            "pairs_total": s["pairs_total"],
            "overlap_ratio": t["overlap_ratio"],
            "overlap_ratio_ci": t["overlap_ratio_ci"],
            "max_over_mean": skew["max_over_mean"],
            "top10_share": skew["top10_share"],
        }
    js = {
        f"{a} vs {b}": js_divergence(loads[a], loads[b]).tolist()
        for a, b in combinations(labels, 2)
    }
    return {"labels": labels, "per_domain": per_domain, "js_divergence_per_layer": js}


# predictors whose ``set_size`` sets how many experts they rank (not a cap on a rule's set)
SIZED_PREDICTORS = ("stmoe-plus", "hybrid", "gate-lookahead", "frequency", "random")


def predictability(trace: RoutingTrace, fraction: float = 0.5) -> dict[str, Any] | None:
    """Recall-versus-budget curves: profile on the first part, replay on the rest."""
    if trace.num_tokens < 4:
        return None
    prof, held_out = split_auto(trace, fraction)
    names, tables = names_for(held_out), profile(prof)
    unranked = [] if is_ranked(held_out) else rank_readers()
    if unranked:
        warnings.warn(f"predictability: {', '.join(unranked)} not replayed: they read the "
                      "router's rank order inside a row, and this trace's rows are sets "
                      "(rank_order: false)", StmoeNote, stacklevel=2)
    result = replay(held_out, names, tables, options={"seed": 0}).to_dict()
    curves = {n: e["budget_curve"] for n, e in result["predictors"].items()}
    # predictors whose set size is a knob rank every expert: their curves run to 4K
    # (a second replay; the recall and set size reported stay those of their defaults)
    sized = [n for n in names if n in SIZED_PREDICTORS]
    if sized:
        wide = min(4 * held_out.top_k, held_out.num_experts)
        longer = replay(held_out, sized, tables, options={"seed": 0, "set_size": wide}).to_dict()
        curves.update({n: e["budget_curve"] for n, e in longer["predictors"].items()})
    return {
        "profiled_tokens": prof.num_tokens,
        "evaluated_tokens": held_out.num_tokens,
        "scope": result["scope"],
        "curves": curves,
        "recall": {n: e["recall"] for n, e in result["predictors"].items()},
        "set_size": {n: e["set_size"] for n, e in result["predictors"].items()},
        "skipped_rank_order": unranked,  # predictors left out: they read rank, rows are sets
    }


def analyze(trace: RoutingTrace) -> dict[str, Any]:
    """Every figure of the report for ``trace``."""
    return {
        "trace": summarize(trace),
        "spatial": spatial(trace),
        "temporal": temporal(trace),
        "load": load(trace),
        "domains": domains(trace),
        "predictability": predictability(trace),
    }
