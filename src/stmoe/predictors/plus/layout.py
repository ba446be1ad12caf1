"""The layout of stmoe-plus's weight vectors: which position weighs which signal.

The compiled kernels, the fit and the predictor all index a weight vector (and
the fit's feature columns) by these names, so the order lives in one place. The
kernels see the members as compile-time constants (numba inlines IntEnum
members): changing a value here must come with clearing the numba cache of
this package (``__pycache__/*.nbi``, ``*.nbc``), since numba only notices edits
to a kernel's own file.
"""

from __future__ import annotations

from enum import IntEnum


class Signal(IntEnum):
    """The signals a score sums, each times its weight (see scoring.plus_scores)."""

    SPATIAL = 0  # pair counts from the token's nearest known layer
    SECOND = 1  # ... from the second nearest known layer
    THIRD = 2  # ... the third
    FOURTH = 3  # ... the fourth
    TEMPORAL = 4  # the sequence's previous token at the target layer
    PRIOR = 5  # the per-layer prior (how often each expert is chosen there)
    RECENT = 6  # recency: what the sequence chose at the target layer lately
    MEMORY = 7  # the token memory's vote at ``power``
    NARROW = 8  # the same vote at 4 * ``power`` (the nearest of the near)
    BIAS = 9  # a constant (logistic weights only)

    @property
    def knob(self) -> str:
        """The PlusConfig field (and fit parameter) that sets this weight."""
        return f"w_{self.name.lower()}"


NUM_SIGNALS = len(Signal)
SPATIAL_LAYERS = 4  # SPATIAL .. FOURTH: the token's last four known layers
# what exists before any of a token's layers: the logistic fit of a token with no
# known layer ("w_start") uses these alone
START_SIGNALS = (Signal.TEMPORAL, Signal.PRIOR, Signal.RECENT)


class WeightRow(IntEnum):
    """The rows of the [4, NUM_SIGNALS] weights a prediction picks from (weight_row)."""

    KNOWN = 0  # some of the token's layers known
    START = 1  # none known yet (layer 0, layers below the horizon)
    JOINT = 2  # hybrid: the lookahead joined to the log-odds (a joint logistic fit)
    FRESH = 3  # a sequence's first token before its layers: only the prior known
