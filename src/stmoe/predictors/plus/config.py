"""stmoe-plus's knobs (``PlusConfig``): what ``make("stmoe-plus", ..., **knobs)`` takes.

Weights and settings left at None take the values fitted at profiling
(fitted.PlusFit), or the defaults where the tables hold no fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from stmoe.predictors.base import ModelShape, PredictorError
from stmoe.predictors.counting import D_MAX
from stmoe.predictors.lookahead_points import check_point


@dataclass(frozen=True)
class PlusConfig:
    """Knobs of stmoe-plus; None = the weights fitted at profiling (or the defaults)."""

    set_size: float = 0.0  # experts per prediction (the mean when adaptive); 0 = top-K
    adaptive: bool = False  # size each set by one probability threshold; mean size = set_size
    horizon: int = 1  # predict layer l+h from the token's layers <= l
    online: bool = True  # keep counting (with forgetting) while predicting
    decay: float = 0.999  # per-token weight of old counts (1 = never forget)
    w_spatial: float | None = None  # the weights, by layout.Signal (its ``knob``)
    w_second: float | None = None
    w_third: float | None = None
    w_fourth: float | None = None
    w_temporal: float | None = None
    w_prior: float | None = None
    w_recent: float | None = None
    w_memory: float | None = None
    w_narrow: float | None = None  # token memory at 4 * power
    w_bias: float | None = None  # a constant added to every score
    power: float | None = None  # token memory: similarity exponent
    sim_decay: float | None = None  # token memory: per-layer decay of the similarity (1: none)
    gamma: float | None = None  # recency: weight of the previous token in the moving average
    alpha: float | None = None  # smoothing towards the prior, in tokens
    beta: float | None = None  # hybrid only: weight of the gate lookahead
    lookahead: str = "auto"  # hybrid only: "early", "late", or "auto" (late where available)
    logistic: bool | None = None  # None: as fitted; False: the grid's linear pool

    def check(self, shape: ModelShape) -> None:
        if self.set_size < 0 or self.set_size > shape.num_experts:
            raise PredictorError(f"set_size {self.set_size}: expected 0 (top-K) .. "
                                 f"{shape.num_experts}")
        if not 1 <= self.horizon <= D_MAX - 1:
            raise PredictorError(f"horizon {self.horizon}: expected 1..{D_MAX - 1}")
        if not 1e-6 <= self.decay <= 1.0:
            raise PredictorError(f"decay {self.decay}: expected 1e-6 <= decay <= 1")
        if self.beta is not None and not 0.0 <= self.beta <= 1.0:
            raise PredictorError(f"beta {self.beta}: expected 0..1")
        if self.alpha is not None and not self.alpha > 0:  # (an uncounted expert: 0 / 0)
            raise PredictorError(f"alpha {self.alpha}: expected > 0")
        if self.power is not None and not self.power > 0:
            raise PredictorError(f"power {self.power}: expected > 0")
        if self.sim_decay is not None and not 0.0 < self.sim_decay <= 1.0:
            raise PredictorError(f"sim_decay {self.sim_decay}: expected 0 < sim_decay <= 1")
        check_point(self.lookahead)
