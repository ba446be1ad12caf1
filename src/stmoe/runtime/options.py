"""``stmoe.offload``'s options, checked and turned into what the engine takes.

The public ``offload(model, store, options, **overrides)`` takes them as one
``OffloadOptions`` and any of its fields by name. Here they are resolved against the model and
the store: the cache capacity from a count, a share or a total size in bytes, the router's
top-K from the model's config, and the predictor from its name (with the tables
shipped next to a model folder when none are given) or as a ready object.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stmoe.cache_policy import RUNTIME, policy_code
from stmoe.errors import OffloadError
from stmoe.models import SHIPPED_TABLES
from stmoe.predictors import make
from stmoe.predictors.base import ModelShape, Predictor
from stmoe.quant.formats import WeightFormat, parse_format
from stmoe.util.config_names import TOP_K, config_int
from stmoe.util.units import (
    LayerCapacity,
    UnitError,
    layer_capacities,
    parse_bytes,
    parse_seconds,
)
from stmoe.util.warn import warn

TIERS = ("disk", "emulated", "gpu", "gpu-disk")  # the names stmoe.offload's ``tier`` takes


@dataclass(frozen=True)
class OffloadOptions:
    """The options of ``stmoe.offload``, and the one place their defaults are written
    (``stmoe generate`` reads them).

    capacity: experts cached per layer: a count (8), a share of N (50%) or bytes for
        the whole model (64MB; a budget above all experts caches them all), alike at every
        layer; or one count per MoE layer ("48,60,12" or a list: a split sized by
        ``stmoe.evaluate.layer_capacity``).
    predictor: a registered name (stmoe, stmoe-plus, hybrid, ondemand, ...) or a ready
        ``Predictor``.
    tables: profiled tables; None: those shipped beside a model folder.
    policy: eviction (``stmoe.cache_policy``): lru, lfu, none (no reuse), or score (the
        expert the predictor scores lowest; a predictor that scores every expert).
    tier: disk (reads bypassing the page cache), emulated (host memory behind a link
        of ``bandwidth`` bytes/s and ``latency`` s, EMULATED), gpu (the store in pinned
        host memory, the cache in the GPU's) or gpu-disk (the disk's reads through pinned
        bounce buffers to the GPU's cache: a model bigger than host RAM).
    bandwidth, latency: the emulated link's (200MB, 50us); the emulated tier only.
    workers: prefetch threads; None: 2 for the disk and gpu-disk (a device serves reads
        in parallel), 1 for the single-link tiers (a second thread only queues another
        transfer ahead of the next miss).
    max_loads: loads one prediction may start per layer; None: the capacity.
    lookahead: hybrid and gate-lookahead: early (the next layer's router on this
        layer's MoE input, as this layer routes), late (on its own input through its
        pre-MoE norm, as that layer starts: closer to the router, less time to load),
        or auto (late where the model's norms are recognised).
    admission: decide per layer, from what the run measures, whether a prefetch is
        worth its bytes (``stmoe.admission``); False: every predicted load is made.
    format: the experts' weight format (``stmoe.quant``): native (the checkpoint's
        dtype, lossless), int8 or int4 (lossy, the user's choice); None: a given store's
        own, else native. group_size: int4's (None: the largest of 128, 64, 32 dividing
        the experts' input widths; given without format: int4 in groups of that size).
    quantize_resident: int8 or int4 for the resident linears too (attention, shared
        experts, lm_head; ``quant.linears``: gates stay native); None: native.
    memory: a budget for the whole process, page cache included ('10GB'): the cache is
        sized from it once the model is loaded (``runtime.memory.plan_memory``) in place of
        ``capacity`` (which must then stay at its default); on the gpu tiers the expert
        slots are sized from the GPU's free memory (``plan_device_memory``) and the host's
        share (the pinned store, or the bounce buffers) checked against it; None:
        ``capacity`` decides.
    in_place: read a model folder's native experts where its safetensors hold them
        (``runtime.store.in_place``: a small index made once, no second copy on disk);
        the disk and gpu-disk tiers and the native format only; False: a packed store.
    """

    capacity: LayerCapacity = "50%"
    predictor: str | Predictor = "stmoe-plus"
    tables: str | Path | None = None
    policy: str = "lru"
    tier: str = "disk"
    bandwidth: float | str | None = None
    latency: float | str = 0.0
    workers: int | None = None
    max_loads: int | None = None
    lookahead: str = "auto"
    admission: bool = True
    format: str | None = None
    group_size: int | None = None
    quantize_resident: str | None = None
    memory: str | None = None
    in_place: bool = False

    def memory_bytes(self) -> int | None:
        """``memory`` in bytes, checked (None: not given)."""
        if self.memory is None:
            return None
        if self.capacity != OffloadOptions.capacity:
            raise OffloadError("give capacity or memory, not both (memory sizes the cache)")
        if self.tier == "emulated":  # its link is emulated from a host copy of the store
            raise OffloadError("--memory budgets the disk and gpu tiers; the emulated tier "
                               "keeps the whole store in host memory, which no budget "
                               "bounds: use --tier disk, or --capacity")
        return int(_parsed("--memory", self.memory, parse_bytes))

    def resident_format(self) -> WeightFormat | None:
        """The resident linears' format, checked (None: native)."""
        if self.quantize_resident is None:
            return None
        fmt = parse_format(self.quantize_resident)
        if not fmt.quantized:
            raise OffloadError(f"quantize_resident {self.quantize_resident!r}: expected int8 "
                               "or int4 (leave it unset for native)")
        return fmt

    def weight_format(self) -> WeightFormat | None:
        """The format asked for, checked (None: whatever the store holds). A group size
        alone asks for int4 in groups of that size: only int4 has one, so an int4 store
        packed with it is taken and any other refused, naming both."""
        if self.format is None and self.group_size is None:
            return None
        return parse_format(self.format or "int4", self.group_size)

    def check(self) -> None:
        """Refuse an unknown tier or cache policy, a link setting the tier does not take or
        an absurd one, and a negative count, before anything is loaded."""
        if self.tier not in TIERS:
            raise OffloadError(f"unknown tier {self.tier!r}; choose from {', '.join(TIERS)}")
        policy_code(self.policy, RUNTIME, OffloadError)
        check_link(self.tier, self.bandwidth, self.latency)
        for name, value in (("workers", self.workers), ("max_loads", self.max_loads)):
            if value is not None and (isinstance(value, bool) or value < 0):
                raise OffloadError(f"{name} must be >= 0, got {value!r}")
        weights = self.weight_format()
        self.resident_format()
        self.memory_bytes()
        if self.in_place and (self.tier not in ("disk", "gpu-disk")
                              or (weights is not None and weights.quantized)):
            raise OffloadError("in_place reads the checkpoint's own bytes from the disk: "
                               "tier disk or gpu-disk and format native only (a quantized or "
                               "in-memory store is packed)")

    def worker_count(self) -> int:
        """Prefetch threads: a disk serves reads in parallel; on a single link a second
        thread only queues another transfer ahead of the next miss."""
        if self.workers is not None:
            return self.workers
        return 2 if self.tier in ("disk", "gpu-disk") else 1


# The emulated link's sane range: below 1 KB/s, or above a minute per transfer, one expert
# would take hours to arrive and a run would look hung.
MIN_BANDWIDTH = 1e3
MAX_LATENCY = 60.0


def check_link(name: str, bandwidth: float | str | None,
               latency: float | str) -> tuple[float | None, float]:
    """The emulated link's (bandwidth bytes/s, latency s), parsed and checked; other tiers
    take neither (a bandwidth given to the disk would be ignored, so it is refused)."""
    lat = _parsed("--latency", latency, parse_seconds)
    if name != "emulated":
        if bandwidth is not None:
            raise OffloadError(f"--bandwidth applies to --tier emulated only, not --tier {name}")
        if lat != 0:
            raise OffloadError(f"--latency applies to --tier emulated only, not --tier {name}")
        return None, 0.0
    if bandwidth is None:
        raise OffloadError("the emulated tier needs a bandwidth: --bandwidth (bandwidth= in "
                           "offload()), bytes/s, e.g. 200MB")
    bw = _parsed("--bandwidth", bandwidth, parse_bytes)
    if not (math.isfinite(bw) and bw >= MIN_BANDWIDTH):
        raise OffloadError(f"--bandwidth {bandwidth}: expected at least 1KB (bytes/s), and finite")
    if not (math.isfinite(lat) and 0 <= lat <= MAX_LATENCY):
        raise OffloadError(f"--latency {latency}: expected 0 to {MAX_LATENCY:g} s")
    return bw, lat


def _parsed(option: str, value: float | str, parse: Callable[[str], float]) -> float:
    """A link setting as a number; a refused text names its option."""
    if not isinstance(value, str):
        return float(value)
    try:
        return parse(value)
    except UnitError as exc:
        raise OffloadError(f"{option} {exc}") from None



# the measurement's bounds (the CLI checks the same ones: ``stmoe calibrate --help``)
MAX_SECONDS = 600.0  # a read measurement longer than 10 minutes is a typo
TOKENS = (1, 1000)  # decode tokens of the compute measurement

CALIBRATED_TIERS = ("disk", "emulated", "gpu", "gpu-disk")


@dataclass(frozen=True)
class CalibrateOptions:
    """What to measure and for how long (``calibrate``)."""

    tier: str = OffloadOptions.tier
    bandwidth: float | str | None = OffloadOptions.bandwidth  # the emulated link's (bytes/s)
    latency: float | str = OffloadOptions.latency  # the emulated link's (s)
    seconds: float = 4.0  # reading time of each read measurement
    tokens: int = 12  # decode tokens of the compute measurement
    threads: int = 1  # torch compute threads
    workers: int | None = None  # prefetch threads (default: the runtime's for the tier)
    # the cache the preset describes (its cache_experts_per_layer)
    capacity: str | int = OffloadOptions.capacity
    seed: int = 0
    routing: Path | None = None  # a trace whose decode misses the reads follow (else random)
    # the predictors whose own time per decode layer call is measured, with ``tables``
    # (default: the model folder's shipped tables; none there: not measured)
    predictors: tuple[str, ...] = ("stmoe", "stmoe-plus")
    tables: Path | None = None


def check_options(o: CalibrateOptions) -> None:
    """Refuse what cannot be measured, in one line, before anything loads."""
    if o.tier not in CALIBRATED_TIERS:
        raise OffloadError(f"calibrate measures --tier {', '.join(CALIBRATED_TIERS)}, not "
                           f"{o.tier!r}")
    if not (o.seconds > 0 and o.seconds <= MAX_SECONDS):
        raise OffloadError(f"--seconds {o.seconds}: expected more than 0 and at most "
                           f"{MAX_SECONDS:g}")
    if not TOKENS[0] <= o.tokens <= TOKENS[1]:
        raise OffloadError(f"--tokens {o.tokens}: expected {TOKENS[0]} to {TOKENS[1]} decode "
                           "tokens")
    if o.threads < 1 or (o.workers is not None and o.workers < 0):
        raise OffloadError("--threads must be >= 1 and --workers >= 0")


def with_overrides(options: OffloadOptions, overrides: dict[str, Any]) -> OffloadOptions:
    """``options`` with the named fields replaced; an unknown name is one clear error."""
    if not isinstance(options, OffloadOptions):
        raise OffloadError(f"options: expected an OffloadOptions, got {type(options).__name__} "
                           "(pass single options by name, e.g. capacity='25%')")
    valid = [f.name for f in dataclasses.fields(OffloadOptions)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise OffloadError(f"unknown offload option {', '.join(map(repr, unknown))}; valid: "
                           f"{', '.join(valid)}")
    return dataclasses.replace(options, **overrides)


def top_k_of(config: object) -> int:
    """The router's K from a transformers config (text sub-config included), read under the
    names of ``util.config_names.TOP_K``."""
    top_k = config_int(config, TOP_K)
    if top_k is None:
        raise OffloadError(f"cannot tell the router's top-k from the {type(config).__name__}; "
                           f"expected one of {', '.join(TOP_K)}")
    return top_k


def resolve_capacities(capacity: LayerCapacity, num_layers: int, num_experts: int,
                       top_k: int, expert_bytes: int) -> tuple[int, ...]:
    """Each MoE layer's experts from a count (8), a share of the experts ('50%') or a byte
    budget for the whole model ('64MB'), alike at every layer, or one count per layer:
    ``util.units.layer_capacities`` (its grammar, bounds and message), refused as the
    runtime's ``OffloadError``."""
    out = layer_capacities(capacity, num_experts, top_k, num_layers=num_layers,
                           expert_bytes=expert_bytes, error=OffloadError)
    assert out is not None  # (expert_bytes given)
    return out


def resolve_predictor(options: OffloadOptions, shape: ModelShape,
                      model_dir: Path | None) -> Predictor:
    """The predictor of ``options``: the object given (its lookahead option applied), or
    one made by name for ``shape``."""
    lookahead = options.lookahead
    if isinstance(options.predictor, Predictor):
        pred = options.predictor
        own = pred.shape  # (one of more layers predicts the first ones: the demo's cut)
        if (own.num_experts, own.top_k) != (shape.num_experts, shape.top_k) or \
                own.num_layers < shape.num_layers:  # (it failed at the first generate)
            raise OffloadError(f"predictor {pred.name!r} was made for {own.describe()}; this "
                               f"model has {shape.describe()}")
        if lookahead != "auto":
            _check_lookahead_option(pred.name, pred.uses_lookahead, lookahead)
            pred.lookahead_pref = lookahead
    else:
        pred = _predictor(options.predictor, shape, options.tables, model_dir, lookahead)
    if options.policy == "score" and not pred.scores_experts:
        raise OffloadError(f"cache policy 'score' evicts the expert the predictor scores "
                           f"lowest, and predictor {pred.name!r} scores none; use stmoe-plus, "
                           "hybrid or stmoe-mix, or policy lru")
    return pred


def shipped_tables(model_dir: Path) -> Path | None:
    """The model folder's own profiled tables (the shipped model's), or None: the tables a
    predictor takes when none are given."""
    path = model_dir / SHIPPED_TABLES
    return path if path.is_file() else None


def _predictor(name: str, shape: ModelShape, tables: str | Path | None,
               model_dir: Path | None, lookahead: str) -> Predictor:
    from stmoe.predictors import REGISTRY
    from stmoe.predictors.tables import load_tables

    cls = REGISTRY.get(name)
    options = {}
    if lookahead != "auto":
        _check_lookahead_option(name, cls is not None and cls.uses_lookahead, lookahead)
        options["lookahead"] = lookahead
    loaded = None
    if cls is not None and not cls.needs_tables and tables is not None:
        from stmoe.errors import StmoeNote

        warn(f"predictor {name!r} takes no profiled tables: {tables} is not used", StmoeNote)
    if cls is not None and cls.needs_tables:
        if tables is None and model_dir is not None:
            tables = shipped_tables(model_dir)
        if tables is None:
            raise OffloadError(f"predictor {name!r} needs profiled tables: pass --tables "
                               "(write them with `stmoe capture` then `stmoe profile`)")
        loaded = load_tables(tables)
    return make(name, shape, loaded, **options)


def _check_lookahead_option(name: str, uses_lookahead: bool, lookahead: str) -> None:
    from stmoe.predictors.plus import check_point

    if not uses_lookahead:
        raise OffloadError(f"lookahead {lookahead!r} applies to predictors that use the gate "
                           f"lookahead (hybrid, gate-lookahead), not {name!r}")
    check_point(lookahead)
