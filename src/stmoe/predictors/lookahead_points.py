"""The gate lookahead's points and their check, shared by every predictor that takes
a lookahead (gate-lookahead, hybrid) and by the runtime.

"early": the next layer's router on this layer's MoE input (the trace's
``lookahead``); "late": on the next layer's own input through its pre-MoE norm
(``lookahead_late``); "auto": late where recorded. Kept apart from the
predictors so that none imports another to check an option.
"""

from __future__ import annotations

from stmoe.predictors.base import PredictorError

LOOKAHEAD_POINTS = ("auto", "early", "late")


def check_point(point: str) -> None:
    """Refuse a lookahead point other than "auto", "early" or "late"."""
    if point not in LOOKAHEAD_POINTS:
        raise PredictorError(f"lookahead {point!r}: expected auto, early or late")
