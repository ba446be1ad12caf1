"""Predictors compared at equal set size (pure, no torch).

Recall grows with the number of experts a prediction names, so a predictor that names
more experts looks better by recall alone: ST-MoE's rules name 5.5 experts a layer where
stmoe-plus names K = 4 by default. The fair comparison reads every predictor's recall at
one mean set size S (ST-MoE's own, the reference) off its recall-versus-budget curve:
each prediction cut to its B highest-scored experts, B = 1..4K, recall read at mean set
size S (linear between budgets). Predictors whose set size is a knob are replayed with
sets of 4K so that their curves reach S; those whose rules size their sets keep their
own curve and get no figure where their sets never reach S. ``stmoe eval`` prints this
first; the demo's report shows it per domain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from stmoe.evaluate.replay import replay
from stmoe.predictors import ProfiledTables, accepted_options
from stmoe.trace.schema import RoutingTrace

REFERENCE = "stmoe"  # the set size compared at: ST-MoE's own mean
METHOD = ("each predictor's recall at the reference's mean set size, read off its "
          "recall-versus-budget curve (predictions cut to their B best experts; predictors "
          "whose set size is a knob replayed with sets of 4K)")


def recall_at_set_size(curve: Mapping[str, Sequence[float]], size: float) -> float | None:
    """A predictor's recall at mean set size ``size``, read off its budget curve (linear
    between budgets, from (0, 0)); None when its sets never get that large."""
    xs, ys = np.asarray(curve["set_size"], float), np.asarray(curve["recall"], float)
    if xs.size == 0 or size > xs.max() + 1e-9 or size < 0:
        return None
    sizes = np.unique(xs)  # the budgets' mean set sizes never shrink; a plateau: its best
    best = np.array([ys[xs == x].max() for x in sizes])
    return float(np.interp(size, np.r_[0.0, sizes], np.r_[0.0, best]))


def sized(name: str) -> bool:
    """Whether ``name``'s set size is a knob (it ranks experts and takes ``set_size``)."""
    return "set_size" in accepted_options(name)


def equal_set_size(trace: RoutingTrace, evaluated: Mapping[str, Any],
                   tables: ProfiledTables | None,
                   options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Every predictor of ``evaluated`` (``ReplayResult.to_dict()["predictors"]`` of
    ``trace``) at the reference's mean set size; None without the reference.

    Returns {"reference", "set_size", "method", "recall": {name: recall or None},
    "own_set_size": {name: its default mean set size}}; a predictor that names nothing
    (ondemand) is left out."""
    ref = evaluated.get(REFERENCE)
    if ref is None or ref["set_size"] is None or ref["recall"] is None:  # (nothing routed)
        return None
    size = float(ref["set_size"])
    curves = {n: e["budget_curve"] for n, e in evaluated.items()}
    wide = [n for n in evaluated if sized(n)]
    if wide:
        full = min(4 * trace.top_k, trace.num_experts)
        again = replay(trace, wide, tables, options={**(options or {}), "set_size": full})
        curves.update({n: e["budget_curve"] for n, e in again.to_dict()["predictors"].items()})
    names = [n for n in evaluated if max(curves[n]["set_size"], default=0.0) > 0]
    names.sort(key=lambda n: n != REFERENCE)  # the reference first, then in replay order
    recall = {n: recall_at_set_size(curves[n], size) for n in names}
    recall[REFERENCE] = float(ref["recall"])  # at its own size (sets past 4K not cut)
    return {"reference": REFERENCE, "set_size": size, "method": METHOD, "recall": recall,
            "own_set_size": {n: float(evaluated[n]["set_size"]) for n in names}}
