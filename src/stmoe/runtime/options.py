"""``stmoe.offload``'s options, checked and turned into what the engine takes.

The public ``offload(...)`` call takes its options as keywords; they travel
together as one ``OffloadOptions``. Here they are resolved against the model and
the store: the cache capacity from a count, a share or a total size in bytes, the router's
top-K from the model's config, and the predictor from its name (with the tables
shipped next to a model folder when none are given) or as a ready object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stmoe.cache_policy import RUNTIME, policy_code
from stmoe.models import SHIPPED_TABLES
from stmoe.predictors import make
from stmoe.predictors.base import ModelShape, Predictor
from stmoe.runtime.store import StoreError
from stmoe.runtime.tiers import TIERS, check_link, parse_bytes

_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k",
                "experts_per_token", "n_activated_experts")  # fmt: skip


@dataclass(frozen=True)
class OffloadOptions:
    """The keyword options of ``stmoe.offload`` (its docstring says what each does)."""

    capacity: int | str = "50%"
    predictor: str | Predictor = "stmoe"
    tables: str | Path | None = None
    policy: str = "lru"
    tier: str = "disk"
    bandwidth: float | str | None = None
    latency: float | str = 0.0
    workers: int | None = None  # None: 2 for the disk, 1 for the single-link tiers
    max_loads: int | None = None
    lookahead: str = "auto"

    def check(self) -> None:
        """Refuse an unknown tier or cache policy, a link setting the tier does not take or
        an absurd one, and a negative count, before anything is loaded."""
        if self.tier not in TIERS:
            raise StoreError(f"unknown tier {self.tier!r}; choose from {', '.join(TIERS)}")
        policy_code(self.policy, RUNTIME, StoreError)
        check_link(self.tier, self.bandwidth, self.latency)
        for name, value in (("workers", self.workers), ("max_loads", self.max_loads)):
            if value is not None and (isinstance(value, bool) or value < 0):
                raise StoreError(f"{name} must be >= 0, got {value!r}")

    def worker_count(self) -> int:
        """Prefetch threads: a disk serves reads in parallel; on a single link a second
        thread only queues another transfer ahead of the next miss."""
        if self.workers is not None:
            return self.workers
        return 2 if self.tier == "disk" else 1


def top_k_of(config: Any) -> int:
    """The router's K from a transformers config (text sub-config included)."""
    for cfg in (config, getattr(config, "text_config", None)):
        for name in _TOP_K_NAMES:
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    raise StoreError(f"cannot tell the router's top-k from the {type(config).__name__}; "
                     f"expected one of {', '.join(_TOP_K_NAMES)}")  # fmt: skip


def resolve_capacity(capacity: int | str, num_layers: int, num_experts: int, top_k: int,
                     expert_bytes: int) -> int:  # fmt: skip
    """Experts per layer from a count (8), a share of the experts ('50%'), or a byte
    budget for the whole model ('64MB'). Below top-K is an error, and so are a count
    above N and a share above 100%; a byte budget above what all experts take caches
    them all (a budget is a ceiling, not a request)."""
    text = str(capacity).strip()
    expected = ("expected experts per layer (8), a share of the experts (50%) or a size in "
                "bytes (64MB)")  # fmt: skip
    if isinstance(capacity, bool):
        raise StoreError(f"capacity {capacity!r}: {expected}")
    try:
        if isinstance(capacity, int) or text.isdigit():
            count = int(text)
            if count > num_experts:
                raise StoreError(f"capacity {capacity!r}: the model has {num_experts} experts "
                                 f"per layer, so at most {num_experts} (or 100%)")  # fmt: skip
        elif text.endswith("%"):
            share = float(text[:-1])
            if not (math.isfinite(share) and 0 <= share <= 100):
                raise StoreError(f"capacity {capacity!r}: expected a share from 0% to 100%")
            count = round(share / 100 * num_experts)
        else:
            budget = _parse_budget(text, expected) // (expert_bytes * num_layers)
            count = int(min(budget, num_experts))
    except ValueError:
        raise StoreError(f"capacity {capacity!r}: {expected}") from None
    if count < top_k:
        raise StoreError(f"capacity {capacity!r} gives {count} experts per layer, below the "
                         f"router's top-{top_k}; one token's experts must fit, so use at least "
                         f"{top_k} (of {num_experts})")  # fmt: skip
    return count


def _parse_budget(text: str, expected: str) -> float:
    try:
        return parse_bytes(text)
    except StoreError as exc:
        raise StoreError(f"capacity {text!r}: {expected} ({exc})") from None


def resolve_predictor(options: OffloadOptions, shape: ModelShape,
                      model_dir: Path | None) -> Predictor:  # fmt: skip
    """The predictor of ``options``: the object given (its lookahead option applied), or
    one made by name for ``shape``."""
    lookahead = options.lookahead
    if isinstance(options.predictor, Predictor):
        pred = options.predictor
        if lookahead != "auto":
            _check_lookahead_option(pred.name, pred.uses_lookahead, lookahead)
            pred.lookahead_pref = lookahead
        return pred
    return _predictor(options.predictor, shape, options.tables, model_dir, lookahead)


def _predictor(name: str, shape: ModelShape, tables: str | Path | None,
               model_dir: Path | None, lookahead: str = "auto") -> Predictor:  # fmt: skip
    from stmoe.predictors import REGISTRY
    from stmoe.predictors.tables import load_tables

    cls = REGISTRY.get(name)
    options = {}
    if lookahead != "auto":
        _check_lookahead_option(name, cls is not None and cls.uses_lookahead, lookahead)
        options["lookahead"] = lookahead
    loaded = None
    if cls is not None and not cls.needs_tables and tables is not None:
        import warnings

        from stmoe.errors import StmoeNote

        # stacklevel: the line that called offload()
        warnings.warn(f"predictor {name!r} takes no profiled tables: {tables} is not used",
                      StmoeNote, stacklevel=5)  # fmt: skip
    if cls is not None and cls.needs_tables:
        if tables is None and model_dir is not None and (model_dir / SHIPPED_TABLES).is_file():
            tables = model_dir / SHIPPED_TABLES
        if tables is None:
            raise StoreError(f"predictor {name!r} needs profiled tables: pass --tables "
                             "(write them with `stmoe capture` then `stmoe profile`)")  # fmt: skip
        loaded = load_tables(tables)
    return make(name, shape, loaded, **options)


def _check_lookahead_option(name: str, uses_lookahead: bool, lookahead: str) -> None:
    from stmoe.predictors.plus import check_point

    if not uses_lookahead:
        raise StoreError(f"lookahead {lookahead!r} applies to predictors that use the gate "
                         f"lookahead (hybrid, gate-lookahead), not {name!r}")  # fmt: skip
    check_point(lookahead)
