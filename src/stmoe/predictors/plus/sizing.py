"""Compiled set sizing: how many experts a prediction gets, and which.

Shared by stmoe-plus, hybrid and stmoe-mix: a fixed budget (fractional budgets
realised by carrying the remainder) or an adaptive one (one probability threshold
over every prediction, steered so the mean set size is ``set_size``).
"""

from __future__ import annotations

import numpy as np

from stmoe.util.jit import njit

LOG_CUT_MIN = np.log(1e-12)  # the adaptive threshold's floor (a share of the scores)


@njit(cache=True)
def top_by_score(scores, size, out):  # pragma: no cover - compiled
    """The ``size`` best experts, highest score first, ties to the smaller id
    (insertion into a short sorted list: size is small next to N)."""
    m = 0
    if size <= 0:
        return 0
    for f in range(scores.shape[0]):
        s = scores[f]
        if m == size and s <= scores[out[m - 1]]:
            continue
        i = m if m < size else size - 1
        while i > 0 and scores[out[i - 1]] < s:
            out[i] = out[i - 1]
            i -= 1
        out[i] = f
        if m < size:
            m += 1
    return m


@njit(cache=True)
def set_size(scores, mean_size, adaptive, ctl, cap, target):  # pragma: no cover - compiled
    """How many experts this prediction gets; the mean over predictions is ``mean_size``.

    Fixed: ``budget`` itself, fractional budgets realised by carrying the remainder
    (5.5 gives 5, 6, 5, 6, ...). Adaptive (layers after the first): every expert
    whose share of the scores clears one common threshold, steered so the mean
    size stays ``mean_size``. The experts most likely to be picked anywhere are taken
    first (the choice that maximises expected hits for a mean set size): a
    prediction unsure between several plausible experts gets a larger set, a
    confident one little more than its K favourites, and one with no plausible
    expert at all (scores flat over all N) stays small, since no expert there is
    worth a transfer. ctl = [remainder, log threshold (0: not yet set)].
    """
    if adaptive and target > 0:
        total = 0.0
        for f in range(scores.shape[0]):
            total += scores[f]
        if total > 0.0:
            if ctl[1] == 0.0:  # start at this prediction's mean_size-th share
                ranked = np.sort(scores)[::-1]
                i = min(max(int(mean_size) - 1, 0), scores.shape[0] - 1)
                ctl[1] = np.log(max(ranked[i] / total, 1e-12))
            cut = np.exp(ctl[1]) * total
            b = 0
            for f in range(scores.shape[0]):
                if scores[f] >= cut and scores[f] > 0.0:  # never an expert scored 0
                    b += 1
            b = max(1 if mean_size >= 1 else 0, min(b, cap))
            # steer towards the mean; bounded, so predictions with fewer candidates
            # than the mean cannot wind the threshold down (or a mean < 1 up) forever
            step = 0.02 * (b - mean_size) / max(mean_size, 1e-9)
            ctl[1] = min(max(ctl[1] + step, LOG_CUT_MIN), -1e-9)
            return b
    ctl[0] += mean_size
    b = int(np.floor(ctl[0]))
    b = max(1 if mean_size >= 1 else 0, min(b, cap))
    ctl[0] -= b
    return b
