"""Expert predictors: ST-MoE, its ablations and the field's baselines, one interface.

``make(name, shape, tables, **options)`` builds any registered predictor;
``names()`` lists them. Every predictor implements ``reset`` / ``predict`` /
``update`` (see ``base.Predictor``) and ``plan(trace)`` for replay.
"""

from __future__ import annotations

import inspect
from typing import Any

from stmoe.predictors import baselines as _baselines  # noqa: F401  (registers)
from stmoe.predictors import mix as _mix  # noqa: F401  (registers stmoe-mix)
from stmoe.predictors import plus as _plus  # noqa: F401  (registers stmoe-plus, hybrid, gate-lookahead)
from stmoe.predictors.base import (
    REGISTRY,
    ModelShape,
    Predictor,
    PredictorError,
    PrefetchPlan,
    register,
)
from stmoe.predictors.profiling import profile
from stmoe.predictors.st_moe import STMoEConfig, STMoEPredictor
from stmoe.predictors.tables import ProfiledTables, load_tables, save_tables
from stmoe.trace.ranks import is_ranked
from stmoe.trace.schema import RoutingTrace

DEFAULT_SET = ("stmoe", "ondemand", "previous-token", "cct-static", "cct-online", "frequency",
               "random", "oracle")


def names() -> list[str]:
    """Every registered predictor name, in a stable order (the defaults first)."""
    return [*DEFAULT_SET, *sorted(set(REGISTRY) - set(DEFAULT_SET))]


def names_for(trace: RoutingTrace) -> list[str]:
    """The predictors that can replay ``trace`` with ordinary tables (hybrid needs the
    trace's gate lookahead; stmoe-mix needs per-domain tables, so it is left out; where
    the rows are sets, the predictors that read rank are left out, ``needs_rank_order``)."""
    has_look = trace.lookahead is not None or trace.lookahead_late is not None
    ranked = is_ranked(trace)
    return [n for n in names()
            if (has_look or not REGISTRY[n].uses_lookahead)
            and not REGISTRY[n].needs_domain_tables
            and (ranked or not REGISTRY[n].needs_rank_order)]


def rank_readers() -> list[str]:
    """The predictors that read the order inside a row (``needs_rank_order``): a trace
    whose rows are sets is refused by them."""
    return [n for n in names() if REGISTRY[n].needs_rank_order]


def make(
    name: str, shape: ModelShape, tables: ProfiledTables | None = None, **options: Any
) -> Predictor:
    """Build the predictor ``name``; ``options`` are its knobs (``set_size``, ``seed``, ...)."""
    cls = _lookup(name)
    if cls.needs_tables and tables is None:
        raise PredictorError(f"predictor {name!r} needs profiled tables (stmoe profile, --tables)")
    accepted = accepted_options(name)
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise PredictorError(
            f"predictor {name!r} has no option {unknown[0]!r}; it takes {accepted}"
        )
    return cls(shape, tables, **options)


def _lookup(name: str) -> type[Predictor]:
    cls = REGISTRY.get(name)
    if cls is None:
        raise PredictorError(f"unknown predictor {name!r}; choose from {', '.join(names())}")
    return cls


def accepted_options(name: str) -> list[str]:
    """The keyword options predictor ``name`` takes (``**knobs`` are listed by ``knobs()``)."""
    cls = _lookup(name)
    params = inspect.signature(cls.__init__).parameters
    named = [p for p, v in params.items() if p not in ("self", "shape", "tables")
             and v.kind is not inspect.Parameter.VAR_KEYWORD]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        named += list(cls.knobs())
    return named


__all__ = [
    "DEFAULT_SET",
    "REGISTRY",
    "ModelShape",
    "Predictor",
    "PredictorError",
    "PrefetchPlan",
    "ProfiledTables",
    "STMoEConfig",
    "STMoEPredictor",
    "accepted_options",
    "load_tables",
    "make",
    "names",
    "names_for",
    "profile",
    "rank_readers",
    "register",
    "save_tables",
]
