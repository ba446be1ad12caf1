"""Frozen model and hardware specs, loaded from TOML presets with clear errors.

Presets live in ``sim/data/*.toml`` with the source of every number; a user's own
TOML file (same keys) works wherever a preset name does (``spec_tables``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from stmoe.sim.spec_tables import SpecError, spec_table
from stmoe.sim.spec_tables import preset_names as preset_names  # (imported from here too)
from stmoe.util.config_names import NUM_EXPERTS, TOP_K


@dataclass(frozen=True)
class Dataflow:
    """PE-array utilisation when one expert serves n tokens: peak * n / (n + half)."""

    peak: float
    half: float

    def utilisation(self, tokens: float) -> float:
        return self.peak * tokens / (tokens + self.half)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    layers: int  # L MoE layers
    dense_layers: int  # dense layers before them (computed, never offloaded)
    hidden: int
    expert_intermediate: int
    num_experts: int  # N routed experts per layer
    top_k: int
    shared_intermediate: int  # total width of the always-resident shared experts (0 = none)
    attention_heads: int
    kv_heads: int
    dtype_bytes: int

    @property
    def expert_bytes(self) -> int:
        """One routed expert's weights: gate, up and down projections."""
        return 3 * self.hidden * self.expert_intermediate * self.dtype_bytes

    @property
    def expert_macs(self) -> int:
        """MACs of one routed expert for one token."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def shared_macs(self) -> int:
        return 3 * self.hidden * self.shared_intermediate

    @property
    def router_macs(self) -> int:
        return self.hidden * self.num_experts

    def attention_macs(self, context: float) -> float:
        """Q, K, V, O projections plus scores and weighted values over ``context`` tokens."""
        head_dim = self.hidden / self.attention_heads
        kv = self.kv_heads * head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 2 * self.hidden * context


@dataclass(frozen=True)
class HostSpec:
    """The offloading runtime's host pipeline (``sim/host/pipeline.py``): a CPU computing, a tier
    read by the compute thread's misses and ``workers`` prefetch threads. Written by
    ``stmoe calibrate`` as a ``[host]`` table; the expert compute rate is the spec's
    ``pe_macs_per_cycle * clock_hz``, the tier's single-reader speed its ``link_*``."""

    tier: str  # "disk" (concurrent reads share the device) or "emulated" (one FIFO link)
    workers: int  # prefetch threads
    read_parallel_bytes_per_s: float  # the tier's throughput with workers + 1 readers
    layer_s: float  # per decode token and MoE layer, outside the experts call
    token_s: float  # per decode token, outside the MoE decoder layers
    first_touch_s: float  # extra per read into cache memory never used before (page faults)
    chunk_bytes: int = 4 << 20  # a worker's read pieces (the runtime's; older presets: today's)
    measured_on: str = ""  # the model calibrated: "L layers x N experts of B bytes" (older: "")
    # [host.predictors]: each predictor's own time on the compute thread (none: 0 counted)
    predictors: dict[str, PredictorCost] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class PredictorCost:
    """A predictor's own seconds on the runtime's compute thread per decode layer call."""

    learn_s: float  # the planner's work but the predictor's answer (every call)
    predict_s: float  # the predictor asked for a set (not where admission has it off)
    admission_s: float  # admission's look at the layer's last set (where admission is on)


# the runtime's tiers a calibrated preset may describe (gpu: the pinned store's copies to
# the GPU; gpu-disk: the disk's reads through bounce buffers to it)
HOST_TIERS = ("disk", "emulated", "gpu", "gpu-disk")
BUFFER_FOR = ("all", "epu")  # HardwareSpec.buffer_for


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    description: str
    clock_hz: float
    pe_macs_per_cycle: float
    router_macs_per_cycle: float
    dataflow: str  # "reconfigurable" or the name of the one fixed dataflow
    link_bytes_per_s: float
    link_latency_s: float
    cache_experts_per_layer: int
    epu_cycles_per_candidate: float
    epu_fixed_cycles: float
    verify_cycles: float
    emu_stages_per_group: float
    pe_groups: int
    mac_pj: float
    sram_pj_per_byte: float
    dram_pj_per_byte: float
    link_pj_per_byte: float
    static_w: float
    epu_bits_per_slot: int
    dataflows: dict[str, Dataflow]
    # leakage of the expert buffer's SRAM, W per bit (0: not counted; a key a spec may omit)
    sram_leak_w_per_bit: float = 0.0
    # who keeps experts across steps (cache_experts_per_layer): "all" systems, or "epu":
    # only those with a prediction unit (its HT says what to keep) and the oracle, the
    # paper's baselines holding just the experts in use and those prefetched
    buffer_for: str = "all"
    host: HostSpec | None = None  # the runtime's host pipeline, where calibrated


def _load(kind: str, name_or_path: str, cls: type) -> Any:
    name, table = spec_table(kind, name_or_path)
    fields = {f.name for f in dataclasses.fields(cls)} - {"name"}  # a model has no tables
    optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    missing = sorted(fields - optional - set(table) - {"description", "source"})
    if missing:
        raise SpecError(f"{kind} spec {name_or_path!r} lacks {', '.join(missing)}")
    unknown = sorted(set(table) - fields - {"description", "source"})
    if unknown:
        raise SpecError(f"{kind} spec {name_or_path!r} has unknown keys {', '.join(unknown)}")
    values: dict[str, Any] = {"name": name}
    for f in dataclasses.fields(cls):
        if f.name in table and f.name not in ("dataflows", "host"):
            values[f.name] = _typed(kind, name_or_path, f.name, table[f.name], f.type)
    for text in ("description", "source"):
        if text in {f.name for f in dataclasses.fields(cls)}:
            values.setdefault(text, "")
    if cls is HardwareSpec:
        values["dataflows"] = _dataflows(name_or_path, table)
        values["host"] = _host(name_or_path, table)
    spec = cls(**values)
    _check_positive(kind, name_or_path, spec)
    if getattr(spec, "buffer_for", "all") not in BUFFER_FOR:
        raise SpecError(f"{kind} spec {name_or_path!r}: buffer_for is {spec.buffer_for!r}, "
                        f"expected {' or '.join(BUFFER_FOR)}")
    return spec


def _typed(kind: str, where: str, key: str, value: Any, annotation: Any) -> Any:
    want = {"int": int, "float": float, "str": str}.get(str(annotation))
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
        raise SpecError(f"{kind} spec {where!r}: {key} is {value!r}, expected {want.__name__}")
    return value


def _dataflows(where: str, table: dict[str, Any]) -> dict[str, Dataflow]:
    flows = table.get("dataflows")
    if not isinstance(flows, dict) or not flows:
        raise SpecError(f"hardware spec {where!r} needs a [dataflows] table")
    out = {}
    for name, d in flows.items():
        if not isinstance(d, dict) or set(d) != {"peak", "half"}:  # a typo is not ignored
            raise SpecError(f"hardware spec {where!r}: dataflow {name} is {d!r}; it needs "
                            "peak and half, nothing else")
        out[name] = Dataflow(*(_typed("hardware", where, f"{name}.{k}", d[k], "float")
                               for k in ("peak", "half")))
        if not (0 < out[name].peak <= 1 and 0 <= out[name].half < math.inf):  # nan fails too
            raise SpecError(f"hardware spec {where!r}: dataflow {name} is {d!r}; expected "
                            "0 < peak <= 1 and a finite half >= 0")
    if table.get("dataflow") not in (*out, "reconfigurable"):
        raise SpecError(f"hardware spec {where!r}: dataflow {table.get('dataflow')!r} is neither "
                        f"'reconfigurable' nor one of {', '.join(out)}")
    return out


def _host(where: str, table: dict[str, Any]) -> HostSpec | None:
    """The optional ``[host]`` table: every key present, typed, in range."""
    host = table.get("host")
    if host is None:
        return None
    if not isinstance(host, dict):
        raise SpecError(f"hardware spec {where!r}: host must be a table ([host])")
    names = [f.name for f in dataclasses.fields(HostSpec)]
    required = [f.name for f in dataclasses.fields(HostSpec)
                if dataclasses.MISSING is f.default and dataclasses.MISSING is f.default_factory]
    missing, unknown = sorted(set(required) - set(host)), sorted(set(host) - set(names))
    if missing or unknown:
        what = "; ".join(
            ([f"lacks {', '.join(missing)}"] if missing else [])
            + ([f"has unknown keys {', '.join(unknown)}"] if unknown else [])
        )
        raise SpecError(f"hardware spec {where!r}: [host] {what}")
    values = {f.name: _typed("hardware", where, f"host.{f.name}", host[f.name], f.type)
              for f in dataclasses.fields(HostSpec) if f.name in host and f.name != "predictors"}
    values["predictors"] = _predictor_costs(where, host.get("predictors", {}))
    spec = HostSpec(**values)
    if spec.tier not in HOST_TIERS:
        raise SpecError(f"hardware spec {where!r}: host.tier is {spec.tier!r}, expected "
                        f"{' or '.join(HOST_TIERS)}")
    if not spec.chunk_bytes >= 4096:
        raise SpecError(f"hardware spec {where!r}: host.chunk_bytes is {spec.chunk_bytes}, "
                        "expected >= 4096 (one page)")
    for key in ("workers", "layer_s", "token_s", "first_touch_s"):
        if not 0 <= getattr(spec, key) < math.inf:
            raise SpecError(f"hardware spec {where!r}: host.{key} is {getattr(spec, key)}, "
                            "expected a finite number >= 0")
    if not (spec.read_parallel_bytes_per_s > 0 and math.isfinite(spec.read_parallel_bytes_per_s)):
        raise SpecError(f"hardware spec {where!r}: host.read_parallel_bytes_per_s must be "
                        "positive and finite")
    return spec


def _predictor_costs(where: str, table: Any) -> dict[str, PredictorCost]:
    """``[host.predictors]``: predictor name = { learn_s = S, predict_s = S }."""
    from stmoe.predictors import REGISTRY

    said = f"hardware spec {where!r}: [host.predictors]"
    if not isinstance(table, dict):
        raise SpecError(f"{said} must be a table of predictor = {{ learn_s, predict_s }}")
    out = {}
    for name, cost in table.items():
        if name not in REGISTRY:
            raise SpecError(f"{said}: unknown predictor {name!r}; choose from "
                            f"{', '.join(REGISTRY)}")
        if not isinstance(cost, dict) or set(cost) != {"learn_s", "predict_s", "admission_s"}:
            raise SpecError(f"{said}: {name} is {cost!r}, expected {{ learn_s = SECONDS, "
                            "predict_s = SECONDS, admission_s = SECONDS }")
        for key, value in cost.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    0 <= value < math.inf):
                raise SpecError(f"{said}: {name}.{key} is {value!r}, expected a finite number "
                                "of seconds >= 0")
        out[name] = PredictorCost(float(cost["learn_s"]), float(cost["predict_s"]),
                                  float(cost["admission_s"]))
    return out


def _check_positive(kind: str, where: str, spec: Any) -> None:
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if type(value) in (int, float) and not 0 <= value < math.inf:  # nan, inf; not a bool
            raise SpecError(f"{kind} spec {where!r}: {f.name} is {value}, expected finite >= 0")
    for must in ("layers", "hidden", "num_experts", "top_k", "clock_hz", "pe_macs_per_cycle",
                 "link_bytes_per_s", "expert_intermediate", "attention_heads", "kv_heads",
                 "dtype_bytes", "router_macs_per_cycle", "pe_groups"):  # divisors, or sizes
        if hasattr(spec, must) and getattr(spec, must) <= 0:
            raise SpecError(f"{kind} spec {where!r}: {must} must be positive")
    if isinstance(spec, ModelSpec) and (spec.top_k > spec.num_experts  # or GQA groups:
                                        or spec.attention_heads % spec.kv_heads):
        raise SpecError(f"{kind} spec {where!r}: top_k {spec.top_k}, kv_heads {spec.kv_heads}: "
                        "expected top_k <= num_experts and kv_heads dividing attention_heads")


def model_preset(name_or_path: str) -> ModelSpec:
    """A model preset by name, or a TOML file with the same keys."""
    return _load("models", name_or_path, ModelSpec)


def hardware_preset(name_or_path: str) -> HardwareSpec:
    """A hardware preset by name, or a TOML file with the same keys."""
    return _load("hardware", name_or_path, HardwareSpec)


def model_spec_from_config(
    config: Any, moe_layers: int, name: str, dtype_bytes: int = 4
) -> ModelSpec:
    """A ModelSpec from a transformers MoE config (Qwen-MoE-style field names, with the
    usual alternatives; the experts' and top-k's from ``util.config_names``), for
    simulating a model that has no preset."""

    def first(*keys: str, default: Any = None) -> Any:
        for key in keys:
            value = getattr(config, key, None)
            if value is not None:
                return value
        if default is None:
            raise SpecError(f"config of {name} lacks {' / '.join(keys)}")
        return default

    return ModelSpec(
        name=name,
        source=f"config.json of {name}",
        layers=moe_layers,
        dense_layers=int(first("num_hidden_layers")) - moe_layers,
        hidden=int(first("hidden_size")),
        expert_intermediate=int(first("moe_intermediate_size", "intermediate_size")),
        num_experts=int(first(*NUM_EXPERTS)),
        top_k=int(first(*TOP_K)),
        shared_intermediate=int(first("shared_expert_intermediate_size", default=0)),
        attention_heads=int(first("num_attention_heads")),
        kv_heads=int(first("num_key_value_heads", "num_attention_heads")),
        dtype_bytes=dtype_bytes,
    )


# the former names, for one release (they load presets, not models)
load_model = model_preset
load_hardware = hardware_preset
