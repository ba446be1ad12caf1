"""The systems compared on one trace, and what simulating them returns.

Every system runs on the same hardware spec and trace; they differ in what they
prefetch, whether a prediction unit sits in the pipeline, the PE array's
dataflow, and (Adaptive-Gating only) which experts run:

- ``gpu-baseline``: on-demand loading, one fixed dataflow (what a GPU-style
  engine does);
- ``adap-gating``: like the baseline, but a token keeps only its top experts
  until their normalised gate weights reach ``adap_threshold`` (LOSSY: the
  dropped gate mass is reported as its quality cost);
- ``pregated``: a trained pre-gate gives layer l+1's experts at layer l (as if
  from Pre-gated MoE), right with probability ``pregate_accuracy``; fixed dataflow;
- ``stmoe``: the ST-MoE predictor on the EPU, reconfigurable dataflow;
- any replay predictor name (``previous-token``, ``frequency``, ...): the same
  pipeline with that predictor;
- ``oracle``: the true next set, no prediction latency: the bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stmoe import cache_policy as cp
from stmoe.evaluate.metrics import scope_tokens
from stmoe.predictors import REGISTRY, ModelShape, PrefetchPlan, ProfiledTables, make
from stmoe.predictors.baselines import plan_from_sets
from stmoe.sim.accelerator import pipeline as pl
from stmoe.sim.specs import HardwareSpec, ModelSpec, SpecError
from stmoe.trace.schema import RoutingTrace

# the paper's baselines (docs/method.md), and what `stmoe simulate` runs by default
PAPER_BASELINES = ("gpu-baseline", "adap-gating", "pregated")
DEFAULT_SYSTEMS = (*PAPER_BASELINES, "stmoe", "oracle")
PAPER_SYSTEMS = DEFAULT_SYSTEMS  # the former name, for one release
ABLATION = (  # docs/method.md: dataflow -> + temporal HT -> + spatial CCT
    ("static dataflow", "gpu-baseline"),
    ("dynamic dataflow", "ondemand"),
    ("+ temporal (HT)", "previous-token"),
    ("+ spatial (CCT) = ST-MoE", "stmoe"),
)


@dataclass(frozen=True)
class RunOptions:
    """How the systems run, beyond the trace, model and hardware (``run_system``, ``simulate``)."""

    batch: int = 1  # sequences decoding together, one token each per step
    tables: ProfiledTables | None = None  # the predictors' profiled tables
    pregate_accuracy: float = 1.0  # pregated: the chance each pre-gated expert is right
    adap_threshold: float = 0.8  # adap-gating: the gate mass a token's kept experts reach
    seed: int = 0  # pregated's errors, the random predictor
    warm: bool = False  # the cache starts full
    predictor_options: Mapping[str, Any] | None = None  # knobs of the predictor (stmoe: threshold)
    policy: str = "lru"  # the cache's eviction (``stmoe.cache_policy``; ``none``: keep nothing)


@dataclass(frozen=True)
class SystemResult:
    """One system's simulated decode (and, apart, prefill) on the trace."""

    name: str
    counters: dict[str, float]  # raw kernel counters of the decode phase
    prefill_time: float
    energy: dict[str, float]  # joules by part
    quality: dict[str, float] = field(default_factory=dict)

    @property
    def time(self) -> float:
        return self.counters["time"]

    @property
    def total_energy(self) -> float:
        return float(sum(self.energy.values()))

    def to_dict(self, baseline_time: float) -> dict[str, Any]:
        c = self.counters
        return {
            "time": self.time,
            "normalized_time": self.time / baseline_time if baseline_time else None,
            "speedup_vs_baseline": baseline_time / self.time if self.time else None,
            "energy": self.total_energy,
            "edp": self.total_energy * self.time,
            "breakdown": {
                "compute": c["compute"],
                "stall": c["stall"],
                "communication": c["link"],
                "prediction": c["epu"],
            },
            "energy_breakdown": self.energy,
            "prefill_time": self.prefill_time,
            "experts_loaded": c["loaded"],
            "experts_prefetched": c["prefetched"],
            "experts_wasted": c["wasted"],
            "hit_rate": c["hits"] / c["demanded"] if c["demanded"] else 0.0,
            # average power of the EPU's table lookups over the decode (estimate)
            "epu_power_w": self.energy.get("epu", 0.0) / self.time if self.time else 0.0,
            "quality": self.quality,
        }


def kernel_params(model: ModelSpec, hw: HardwareSpec, use_predictor_row_width: int) -> np.ndarray:
    """The parameter vector of ``pipeline.simulate_steps`` for this model and hardware."""
    p = np.zeros(pl.N_PARAMS)
    p[pl.P_PE] = hw.pe_macs_per_cycle * hw.clock_hz
    p[pl.P_ROUTER] = hw.router_macs_per_cycle * hw.clock_hz
    p[pl.P_BW] = hw.link_bytes_per_s
    p[pl.P_LAT] = hw.link_latency_s
    candidates = model.top_k * use_predictor_row_width + model.top_k  # CCT rows + HT
    p[pl.P_EPU] = (hw.epu_fixed_cycles + hw.epu_cycles_per_candidate * candidates) / hw.clock_hz
    p[pl.P_VERIFY] = hw.verify_cycles / hw.clock_hz
    p[pl.P_EMU] = hw.emu_stages_per_group * np.log2(max(hw.pe_groups, 1)) / hw.clock_hz
    p[pl.P_EXPERT_MACS] = model.expert_macs
    p[pl.P_EXPERT_BYTES] = model.expert_bytes
    p[pl.P_SHARED_MACS] = model.shared_macs
    p[pl.P_ROUTER_MACS] = model.router_macs
    p[pl.P_ATTN_FIXED] = model.attention_macs(0)
    p[pl.P_ATTN_CTX] = model.attention_macs(1) - model.attention_macs(0)
    return p


def steps_of(trace: RoutingTrace, tokens: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR steps over ``tokens`` (bool [T]): batches of ``batch`` consecutive sequences
    advance together, step j holding the j-th selected token of each."""
    sel = np.flatnonzero(tokens)
    seq = trace.sequence_of_token()[sel]
    first_of_seq = np.searchsorted(seq, seq, side="left")  # sel is in trace order
    rank = np.arange(len(sel)) - first_of_seq
    group = seq // batch
    order = np.lexsort((seq, rank, group))
    key_group, key_rank = group[order], rank[order]
    new = np.r_[True, (key_group[1:] != key_group[:-1]) | (key_rank[1:] != key_rank[:-1])]
    ptr = np.r_[np.flatnonzero(new), len(sel)].astype(np.int64)
    return ptr, sel[order].astype(np.int64)


def run_system(
    name: str,
    trace: RoutingTrace,
    model: ModelSpec,
    hw: HardwareSpec,
    options: RunOptions | None = None,
) -> SystemResult:
    """Simulate one system on ``trace`` (``options``: default ``RunOptions()``)."""
    o = options or RunOptions()
    code = cp.policy_code(o.policy, cp.SIMULATOR, SpecError)
    predictor_name, use_predictor, dynamic = _system(name)
    capacity = buffer_capacity(hw, keeps=use_predictor or name == "oracle")
    cache = pl.Cache(0 if code == cp.NONE else capacity, code, o.warm)
    experts = np.ascontiguousarray(trace.experts, dtype=np.int16)
    quality: dict[str, float] = {}
    if name == "adap-gating":
        experts, quality = adaptive_gating(trace, o.adap_threshold)
    if name == "pregated":
        plan = pregate_plan(trace, o.pregate_accuracy, o.seed)
    else:
        knobs: dict[str, Any] = {"seed": o.seed} if predictor_name == "random" else {}
        knobs.update(o.predictor_options or {})
        plan = make(predictor_name, ModelShape.of(trace), o.tables, **knobs).plan(trace)
    decode = scope_tokens(trace)  # decode tokens, or all when none is marked
    row_width = o.tables.row_width if o.tables is not None else model.top_k
    params = kernel_params(model, hw, row_width)
    machine = pl.Machine(params, np.array([d.peak for d in hw.dataflows.values()]),
                         np.array([d.half for d in hw.dataflows.values()]),
                         _fixed_dataflow(hw, dynamic), model.num_experts)
    pos = _positions(trace)
    out = pl.simulate_steps(pl.Steps(experts, pos, *steps_of(trace, decode, o.batch)),
                            pl.Prefetch(plan.ptr, plan.ids, use_predictor), machine,
                            cache)
    prefill_time = 0.0
    if (~decode).any():  # prefill: each prompt as one step, on demand
        none = np.zeros(trace.num_tokens * trace.num_layers + 1, dtype=np.int64)
        prefill = pl.simulate_steps(
            pl.Steps(experts, pos, *_one_step_per_sequence(trace, ~decode)),
            pl.Prefetch(none, np.zeros(0, np.int16), False), machine, cache,
        )
        prefill_time = float(prefill[pl.C_TIME])
    counters = {k: float(out[i]) for i, k in enumerate(
        ("time", "compute", "stall", "link", "epu", "macs", "sram", "loaded", "prefetched",
         "wasted", "demanded", "hits", "predicted_hits"))}
    counters["epu_per_lookup"] = float(params[pl.P_EPU])
    counters["buffer_experts"] = float(cache.capacity)
    return SystemResult(name, counters, prefill_time, energy(counters, model, hw), quality)


def buffer_capacity(hw: HardwareSpec, *, keeps: bool) -> int:
    """Experts per layer a system keeps across steps: the hardware's buffer, or none for
    a system outside ``hw.buffer_for`` (``keeps``: it has an EPU, or is the oracle)."""
    return hw.cache_experts_per_layer if hw.buffer_for == "all" or keeps else 0


def energy(c: dict[str, float], model: ModelSpec, hw: HardwareSpec) -> dict[str, float]:
    """Joules by part: MACs, on-chip SRAM, off-chip DRAM, link, EPU lookups, static, and
    the expert buffer's leakage (0 without one).

    An EPU lookup reads K CCT rows plus the HT entry (docs/method.md) from its SRAM. The
    buffer's reads are the ``sram`` part; its writes of loaded experts are not counted
    (as the staging buffer's are not at capacity 0: 2.5 of the 160 pJ a byte costs)."""
    pj = 1e-12
    moved = c["loaded"] * model.expert_bytes
    lookups = c["epu"] / c["epu_per_lookup"] if c.get("epu_per_lookup") else 0.0
    lookup_bytes = model.top_k * (model.top_k + 1) * hw.epu_bits_per_slot / 8
    return {
        "epu": lookups * lookup_bytes * hw.sram_pj_per_byte * pj,
        "mac": c["macs"] * hw.mac_pj * pj,
        "sram": c["sram"] * hw.sram_pj_per_byte * pj,
        "dram": moved * hw.dram_pj_per_byte * pj,
        "link": moved * hw.link_pj_per_byte * pj,
        "static": hw.static_w * c["time"],
        "buffer": buffer_bits(model, c.get("buffer_experts", 0.0)) * hw.sram_leak_w_per_bit
        * c["time"],
    }


def buffer_bits(model: ModelSpec, experts_per_layer: float) -> float:
    """Bits of an expert buffer keeping ``experts_per_layer`` experts at every MoE layer."""
    return experts_per_layer * model.layers * model.expert_bytes * 8


def adaptive_gating(trace: RoutingTrace, threshold: float) -> tuple[np.ndarray, dict[str, float]]:
    """Keep each token's top experts until their normalised gate weights reach
    ``threshold`` (at least one): the stated AdapMoE-style rule, and its cost."""
    if trace.weights is None:
        raise SpecError("adap-gating needs gate weights in the trace (this trace has none)")
    if not 0 < threshold <= 1:
        raise SpecError(f"adap threshold {threshold}: expected 0 < t <= 1")
    w = np.asarray(trace.weights, dtype=np.float64)
    w = w / np.maximum(w.sum(axis=-1, keepdims=True), 1e-12)
    before = np.cumsum(w, axis=-1) - w  # mass of the higher-ranked experts
    keep = (before < threshold) & (np.asarray(trace.experts) >= 0)
    keep[..., 0] = True
    experts = np.where(keep, trace.experts, -1).astype(np.int16)
    dropped = float((w * ~keep).sum(axis=-1).mean())
    return experts, {"adap_threshold": threshold, "dropped_gate_mass": dropped,
                     "experts_per_token_layer": float(keep.sum(axis=-1).mean())}


def pregate_plan(trace: RoutingTrace, accuracy: float, seed: int) -> PrefetchPlan:
    """Layer l+1's true experts known at layer l; each wrong with prob 1 - accuracy."""
    if not 0 <= accuracy <= 1:
        raise SpecError(f"pre-gate accuracy {accuracy}: expected 0..1")
    ex = np.asarray(trace.experts, dtype=np.int64).copy()
    rng = np.random.default_rng(seed)
    wrong = (rng.random(ex.shape) >= accuracy) & (ex >= 0)
    for t, layer, k in np.argwhere(wrong):  # a random expert outside the true set
        taken = np.union1d(np.asarray(trace.experts[t, layer]), ex[t, layer])
        others = np.setdiff1d(np.arange(trace.num_experts), taken)  # never a true expert
        if len(others):
            ex[t, layer, k] = rng.choice(others)
    ex[:, 0] = -1  # layer 0 has no earlier layer to pre-gate it
    return plan_from_sets(ex, ex >= 0, trace.num_layers)


def _system(name: str) -> tuple[str, bool, bool]:
    """(predictor behind it, EPU in the pipeline, reconfigurable dataflow)."""
    if name in ("gpu-baseline", "adap-gating", "pregated"):
        return "ondemand", False, False
    if name == "oracle":
        return "oracle", False, True
    if name == "ondemand":
        return "ondemand", False, True
    if name in REGISTRY:
        return name, True, True
    valid = ", ".join([*DEFAULT_SYSTEMS, *(n for n in REGISTRY if n not in DEFAULT_SYSTEMS)])
    raise SpecError(f"unknown system {name!r}; choose from {valid}")


def _fixed_dataflow(hw: HardwareSpec, dynamic: bool) -> int:
    names = list(hw.dataflows)
    if hw.dataflow == "reconfigurable" and dynamic:
        return -1
    if hw.dataflow != "reconfigurable":
        return names.index(hw.dataflow)
    return names.index("weight_stationary") if "weight_stationary" in names else 0


def _positions(trace: RoutingTrace) -> np.ndarray:
    """[T] position of every token in its sequence (its attention context length)."""
    starts = np.repeat(np.asarray(trace.seq_starts), trace.seq_lengths)
    return (np.arange(trace.num_tokens) - starts).astype(np.int64)


def _one_step_per_sequence(
    trace: RoutingTrace, tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """CSR steps holding all selected tokens of one sequence each (prefill as one batch)."""
    sel = np.flatnonzero(tokens)
    seq = trace.sequence_of_token()[sel]
    new = np.r_[True, seq[1:] != seq[:-1]]
    return np.r_[np.flatnonzero(new), len(sel)].astype(np.int64), sel.astype(np.int64)
