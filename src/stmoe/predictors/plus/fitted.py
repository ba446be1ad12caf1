"""The values the stmoe-plus fit chose, typed: what ``tables.info["plus"]`` holds.

The tables file keeps the fit in its JSON header as a plain dict (``to_dict``);
``PlusFit.from_dict`` reads it back, checks every value (numeric, finite, in the
range its knob takes, the right number of weights) and names what is wrong, so
the predictor never reads loose keys; ``of_tables`` names the tables' file too.
(Loading checks only that the fit holds numbers and flags, ``tables_check``: the
tables module may not import stmoe-plus, which imports it.) A fit of another
``FIT_VERSION`` is ignored (its weights mean other things): the predictor then
takes the defaults, as for tables profiled without a fit. The layout of the dict
(keys, order, version 3) is the file format.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stmoe.errors import StmoeNote
from stmoe.predictors.base import PredictorError
from stmoe.predictors.plus.layout import NUM_SIGNALS

if TYPE_CHECKING:
    from stmoe.predictors.tables import ProfiledTables

_WHERE = "the tables' stmoe-plus fit (info['plus'])"
FIT_VERSION = 3  # fits of other versions are ignored (v3: logistic weights)
# by Signal: spatial from the last 4 known layers (nearest first), temporal, prior,
# recency, memory (at power, and narrow: at 4 * power), a constant (logistic only)
DEFAULT_W = (1.0, 0.5, 0.25, 0.0, 0.5, 0.25, 0.5, 1.0, 0.0, 0.0)
DEFAULT_POWER = 8.0
DEFAULT_SIM_DECAY = 1.0
DEFAULT_ALPHA = 1.0
DEFAULT_GAMMA = 0.8
DEFAULT_BETA = 0.5  # hybrid's lookahead weight where none was fitted

Weights = tuple[float, ...]  # NUM_SIGNALS weights, indexed by Signal
# A fitted weight is tens at most (the grid's go to 16, the logistic fit's ridge keeps
# them small); one of 1e308 is finite but overflows the scores to inf, so a file holding
# a weight beyond this is refused, and the fit never keeps one (plus.fitting).
WEIGHT_MAX = 1e6
# a setting's range, as PlusConfig.check takes the same knobs: (test, what it expects)
Range = tuple[Callable[[float], bool], str]
_ANY: Range = (lambda v: True, "a finite number")
_POSITIVE: Range = (lambda v: v > 0, "a finite number > 0")
_FRACTION: Range = (lambda v: 0 <= v <= 1, "a number 0..1")
_DECAY: Range = (lambda v: 0 < v <= 1, "a number 0 < x <= 1")
_WEIGHT: Range = (lambda v: abs(v) <= WEIGHT_MAX, f"a number within +-{WEIGHT_MAX:g}")


@dataclass(frozen=True)
class JointFit:
    """hybrid's joint logistic fit at one lookahead point: the table weights refitted
    with the lookahead's rank weights as one more signal of the log-odds."""

    w: Weights
    w_look: float  # the lookahead's weight in the log-odds


@dataclass(frozen=True)
class LookaheadFit:
    """hybrid's fit at one lookahead point (early or late)."""

    beta: float  # the lookahead's weight in the fusion with the table scores
    heldout_recall: float | None  # on the held-back tokens (the joint fit's if kept)
    joint: JointFit | None = None  # kept where it recalled more than the fusion


@dataclass(frozen=True)
class PlusFit:
    """The weights, smoothing, recency and memory settings of stmoe-plus (and hybrid's
    lookahead weights), as fitted on held-back profiling tokens or the defaults."""

    w: Weights = DEFAULT_W
    alpha: float = DEFAULT_ALPHA  # smoothing towards the prior, in tokens
    gamma: float = DEFAULT_GAMMA  # recency: weight of the previous token
    power: float = DEFAULT_POWER  # token memory: similarity exponent
    sim_decay: float = DEFAULT_SIM_DECAY  # token memory: per-layer decay of the similarity
    fitted: bool = False  # False: the defaults (too few profiling tokens to hold any back)
    logistic: bool = False  # True: ``w`` are logistic weights (scores are log-odds)
    heldout_tokens: int | None = None
    heldout_recall: float | None = None
    heldout_recall_linear: float | None = None  # of the grid's linear pool
    w_linear: Weights | None = None  # the grid's linear pool, kept beside logistic weights
    w_start: Weights | None = None  # logistic: a token with no known layer (its own fit)
    w_fresh: Weights | None = None  # logistic: a sequence's first token (the prior alone)
    early: LookaheadFit | None = None  # hybrid, where the trace recorded the early lookahead
    late: LookaheadFit | None = None  # ... the late one
    version: int = field(default=FIT_VERSION, init=False)

    def beta(self, point: str) -> float:
        """The fusion's lookahead weight at ``point``; the late one falls back to the early."""
        found = self.late if point == "late" else None
        found = found or self.early
        return found.beta if found is not None else DEFAULT_BETA

    def joint(self, point: str) -> JointFit | None:
        found = self.late if point == "late" else self.early
        return found.joint if found is not None else None

    # ---- the tables file's JSON form ------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"w": list(self.w), "alpha": self.alpha, "gamma": self.gamma,
                               "power": self.power, "sim_decay": self.sim_decay,
                               "fitted": self.fitted, "version": self.version,
                               "logistic": self.logistic}
        for key in ("heldout_tokens", "heldout_recall", "heldout_recall_linear", "w_linear",
                    "w_start", "w_fresh"):
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        for suffix, look in (("", self.early), ("_late", self.late)):
            if look is None:
                continue
            out[f"beta{suffix}"] = look.beta
            if look.heldout_recall is not None:
                out[f"heldout_recall_hybrid{suffix}"] = look.heldout_recall
            if look.joint is not None:
                out[f"hybrid{suffix}"] = {"w": list(look.joint.w), "w_look": look.joint.w_look}
        return out

    @classmethod
    def of_tables(cls, tables: ProfiledTables) -> PlusFit | None:
        """The fit ``tables`` hold (``from_dict``), errors naming the tables' file."""
        where = f"{tables.source}: info['plus']" if tables.source else _WHERE
        return cls.from_dict(tables.info.get("plus"), where)

    @classmethod
    def from_dict(cls, data: Any, where: str = _WHERE) -> PlusFit | None:
        """The fit a tables file holds; None for a fit of another version (or none).
        A damaged entry (or a setting out of its range) is a PredictorError naming the key:
        the kernels would compute NaN from it, or index by it."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise PredictorError(f"{where}: expected a JSON object, found {type(data).__name__}")
        if data.get("version") != FIT_VERSION:  # said, not silent: the defaults then apply
            warnings.warn(f"{where} is a fit of version {data.get('version')!r}; this stmoe "
                          f"reads version {FIT_VERSION}, so stmoe-plus uses its default weights "
                          "(profile again to fit them)", StmoeNote, stacklevel=2)
            return None
        r = _Reader(data, where)
        logistic = r.flag("logistic")
        return cls(w=r.weights("w", DEFAULT_W), alpha=r.number("alpha", DEFAULT_ALPHA, _POSITIVE),
                   gamma=r.number("gamma", DEFAULT_GAMMA, _FRACTION),
                   power=r.number("power", DEFAULT_POWER, _POSITIVE),
                   sim_decay=r.number("sim_decay", DEFAULT_SIM_DECAY, _DECAY),
                   fitted=r.flag("fitted"), logistic=logistic,
                   heldout_tokens=r.count("heldout_tokens"),
                   heldout_recall=r.number("heldout_recall", None, _FRACTION),
                   heldout_recall_linear=r.number("heldout_recall_linear", None, _FRACTION),
                   w_linear=r.weights("w_linear"), w_start=r.weights("w_start", required=logistic),
                   w_fresh=r.weights("w_fresh", required=logistic),
                   early=r.lookahead(""), late=r.lookahead("_late"))


class _Reader:
    """Checked reads of a fit's JSON dict; every failure names the key."""

    def __init__(self, data: dict[str, Any], where: str = _WHERE) -> None:
        self.data, self.where = data, where

    def _fail(self, key: str, expected: str) -> PredictorError:
        return PredictorError(f"{self.where}: {key!r} is {self.data[key]!r}, expected {expected}; "
                              "profile the trace again")

    def number(self, key: str, default: float | None = None, within: Range = _ANY) -> Any:
        if key not in self.data:
            return default
        v, (test, expected) = self.data[key], within
        if isinstance(v, bool) or not isinstance(v, int | float) or not _finite(v) or not test(v):
            raise self._fail(key, expected)
        return v

    def count(self, key: str) -> int | None:
        v = self.number(key)
        if v is not None and (not isinstance(v, int) or v < 0):
            raise self._fail(key, "a token count")
        return v

    def flag(self, key: str) -> bool:
        v = self.data.get(key, False)
        if not isinstance(v, bool):
            raise self._fail(key, "true or false")
        return v

    def weights(self, key: str, default: Weights | None = None,
                required: bool = False) -> Weights | None:
        if key not in self.data:
            if required:
                raise PredictorError(f"{self.where}: no {key!r}; profile the trace again")
            return default
        v = self.data[key]
        if not (isinstance(v, list) and len(v) == NUM_SIGNALS and all(
                not isinstance(x, bool) and isinstance(x, int | float) and _finite(x)
                and abs(x) <= WEIGHT_MAX for x in v)):
            raise self._fail(key, f"{NUM_SIGNALS} finite numbers within +-{WEIGHT_MAX:g}")
        return tuple(v)

    def lookahead(self, suffix: str) -> LookaheadFit | None:
        beta = self.number(f"beta{suffix}", None, _FRACTION)
        recall = self.number(f"heldout_recall_hybrid{suffix}", None, _FRACTION)
        joint = self.data.get(f"hybrid{suffix}")
        if beta is None:
            if recall is not None or joint is not None:
                raise PredictorError(f"{self.where}: hybrid's fit{suffix} without 'beta{suffix}'")
            return None
        if joint is not None:
            if not isinstance(joint, dict):
                raise self._fail(f"hybrid{suffix}", "an object with 'w' and 'w_look'")
            inner = _Reader(joint, f"{self.where}['hybrid{suffix}']")
            w = inner.weights("w", required=True)
            w_look = inner.number("w_look", None, _WEIGHT)
            if w_look is None:
                raise PredictorError(f"{inner.where}: no 'w_look'")
            joint = JointFit(w, w_look)  # type: ignore[arg-type]
        return LookaheadFit(beta, recall, joint)


def _finite(v: int | float) -> bool:
    """Finite, and within float64 (the kernels' type): JSON integers have no bound."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False
