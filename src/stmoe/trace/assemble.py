"""Helpers the text importers share: layer numbering and router rank order."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


def layer_numbering(layer_ids: Iterable[int]) -> tuple[dict[int, int], dict[str, Any]]:
    """Map the layer ids a file uses onto MoE layers 0..L-1.

    Files written with model layer numbers (e.g. DeepSeek's MoE layers 1..26 after
    a dense layer 0) keep their order; the original ids go into the metadata so
    nothing is lost.
    """
    ids = sorted(set(layer_ids))
    mapping = {lid: i for i, lid in enumerate(ids)}
    extra = {} if ids == list(range(len(ids))) else {"model_layer_ids": ids}
    return mapping, extra


def order_by_weight(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Put each routing's slots in router rank order (highest gate weight first).

    SPEC.md defines a trace's slot order as router rank order; some tracers write
    ascending weights. The sort is stable, so equal weights keep their file order.
    Returns the reordered arrays and how many routings changed.
    """
    order = np.argsort(-weights, axis=-1, kind="stable")
    changed = int(np.count_nonzero(np.any(order != np.arange(weights.shape[-1]), axis=-1)))
    if not changed:
        return experts, weights, 0
    return (
        np.take_along_axis(experts, order, axis=-1),
        np.take_along_axis(weights, order, axis=-1),
        changed,
    )
