"""``simulate``: every requested system on one trace, model and hardware, as JSON-ready data.

Also the ablation (docs/method.md: static dataflow, dynamic dataflow, + temporal HT,
+ spatial CCT), the EPU's storage and area estimate, and parameter sweeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from stmoe.predictors import ProfiledTables, profile
from stmoe.sim.accelerator.systems import (
    ABLATION,
    DEFAULT_SYSTEMS,
    RunOptions,
    buffer_bits,
    run_system,
)
from stmoe.sim.specs import HardwareSpec, ModelSpec, SpecError
from stmoe.trace.schema import RoutingTrace
from stmoe.trace.select import split_auto
from stmoe.util.progress import progress

# 40 nm SRAM: 6T bitcell ~0.25 um^2 (published 40 nm processes), x2 for periphery (assumption).
SRAM_UM2_PER_BIT_40NM = 0.5


def check_model_fits(trace: RoutingTrace, model: ModelSpec) -> None:
    """A trace can only be simulated with the dims of the model it was recorded from."""
    want = (model.layers, model.num_experts, model.top_k)
    have = (trace.num_layers, trace.num_experts, trace.top_k)
    if want != have:
        raise SpecError(
            f"the trace has L={have[0]} MoE layers, N={have[1]} experts, top-{have[2]} but model "
            f"{model.name!r} has L={want[0]}, N={want[1]}, top-{want[2]}; simulate a trace with "
            "the model it was recorded from (or give a .toml model spec with its dims)"
        )


def epu_storage(model: ModelSpec, hw: HardwareSpec, row_width: int) -> dict[str, float]:
    """Bits the EPU holds for this model (CCT + HT) and an area estimate at 40 nm."""
    id_bits = max(1, int(np.ceil(np.log2(model.num_experts))))
    cct = (model.layers - 1) * model.num_experts * row_width * (id_bits + 2)
    ht = model.layers * model.top_k * id_bits
    return {
        "cct_bits": cct,
        "ht_bits": ht,
        "kib": (cct + ht) / 8 / 1024,
        "area_mm2_estimate": (cct + ht) * SRAM_UM2_PER_BIT_40NM / 1e6,
        "area_source": "40 nm 6T SRAM bitcell ~0.25 um^2, x2 periphery (estimate)",
    }


def buffer_mm2(model: ModelSpec, experts_per_layer: int) -> float:
    """The expert buffer's area estimate at 40 nm (the EPU's bitcell and periphery)."""
    return buffer_bits(model, experts_per_layer) * SRAM_UM2_PER_BIT_40NM / 1e6


def buffer_storage(model: ModelSpec, hw: HardwareSpec) -> dict[str, Any]:
    """The expert buffer kept across steps: its size and an area estimate at 40 nm (the
    EPU's bitcell), for comparison with what a chip can hold."""
    bits = buffer_bits(model, hw.cache_experts_per_layer)
    return {
        "experts_per_layer": hw.cache_experts_per_layer,
        "for": hw.buffer_for,
        "mib": bits / 8 / 2**20,
        "area_mm2_estimate": buffer_mm2(model, hw.cache_experts_per_layer),
        "leak_w": bits * hw.sram_leak_w_per_bit,
    }


def needs_plus_fit(systems: Sequence[str]) -> bool:
    """Whether any of ``systems`` runs a predictor that reads stmoe-plus's fitted weights
    (the fit is the slow part of profiling: done only then)."""
    return any(s.startswith(("stmoe-plus", "hybrid", "stmoe-mix")) for s in systems)


def prepare_tables(
    trace: RoutingTrace, tables: ProfiledTables | None, systems: Sequence[str] = ()
) -> tuple[RoutingTrace, ProfiledTables, str]:
    """The trace to simulate and the tables: given ones, or profiled on the first half
    of the trace with the held-out second half simulated (stmoe-plus's weights fitted
    only when one of ``systems`` needs them)."""
    if tables is not None:
        tables.check_trace(trace)
        return trace, tables, "given"
    first, rest = split_auto(trace, 0.5)
    return (
        rest,
        profile(first, fit_plus=needs_plus_fit(systems)),
        "profiled on the first half of the trace; the second half simulated",
    )


def simulate(
    trace: RoutingTrace,
    model: ModelSpec,
    hw: HardwareSpec,
    systems: Sequence[str] = DEFAULT_SYSTEMS,
    options: RunOptions | None = None,
    *,
    ablation: bool = True,
) -> dict[str, Any]:
    """Simulate ``systems`` (the GPU baseline is always run: it normalises the rest)
    with ``options`` (default ``RunOptions()``; without tables, ``prepare_tables``'s)."""
    options = options or RunOptions()
    check_model_fits(trace, model)
    if options.batch < 1:
        raise SpecError(f"batch {options.batch}: expected >= 1")
    trace, tables, note = prepare_tables(trace, options.tables, systems)
    if options.batch > trace.num_sequences:  # (sequences decode together: more is not a batch)
        raise SpecError(f"batch {options.batch}: the simulated routing holds "
                        f"{trace.num_sequences} sequence(s); expected at most "
                        f"{trace.num_sequences} (a batch decodes that many sequences "
                        "together; without tables, only the trace's held-out part is "
                        "simulated)")
    run = dataclasses.replace(options, tables=tables)
    names = list(dict.fromkeys(["gpu-baseline", *systems]))
    results = {n: run_system(n, trace, model, hw, run)
               for n in progress(names, len(names), "simulating the systems")}
    for n, r in results.items():  # finite figures whose products overflow: no inf or nan out
        if not (np.isfinite(r.time) and np.isfinite(r.total_energy)):
            raise SpecError(f"model {model.name!r} on hardware {hw.name!r}: {n}'s time "
                            f"({r.time:g} s) or energy ({r.total_energy:g} J) is not finite; "
                            "a figure of the specs is out of any real range")
    base = results["gpu-baseline"].time
    out: dict[str, Any] = {
        "model": model.name,
        "hardware": hw.name,
        "trace": {
            "model": trace.meta.model,
            "synthetic": trace.meta.synthetic,
            "tokens": trace.num_tokens,
            "decode_tokens": int(np.count_nonzero(trace.is_decode)),
        },
        "batch": run.batch,
        "cache_policy": run.policy,
        "tables": note,
        "systems": {n: r.to_dict(base) for n, r in results.items() if n in systems},
        "epu": epu_storage(model, hw, tables.row_width),
        "buffer": buffer_storage(model, hw),
    }
    if ablation:
        steps = {}
        for label, name in ABLATION:
            r = results.get(name) or run_system(name, trace, model, hw, run)
            steps[label] = r.to_dict(base)
        out["ablation"] = steps
    _check_finite(out, f"model {model.name!r} on hardware {hw.name!r}")
    return out


def _check_finite(figures: object, what: str, at: str = "") -> None:
    """Every figure out finite: products of finite figures (an energy-delay product, a
    ratio to the baseline) overflow where a spec's figure is out of any real range; `inf`
    was printed and `Infinity` written to JSON with exit 0."""
    if isinstance(figures, dict):
        for key, value in figures.items():
            _check_finite(value, what, f"{at}.{key}" if at else str(key))
    elif isinstance(figures, list | tuple):
        for i, value in enumerate(figures):
            _check_finite(value, what, f"{at}[{i}]")
    elif isinstance(figures, float) and not np.isfinite(figures):
        raise SpecError(f"{what}: {at} is {figures:g}; a figure of the specs is out of any real "
                        "range")


SWEEPABLE = ("link_bytes_per_s", "cache_experts_per_layer", "pe_macs_per_cycle")


def sweep(
    trace: RoutingTrace,
    model: ModelSpec,
    hw: HardwareSpec,
    systems: Sequence[str],
    parameter: str,
    values: Sequence[float],
    options: RunOptions | None = None,
) -> dict[str, Any]:
    """Normalized time of ``systems`` as one hardware or run parameter varies."""
    options = options or RunOptions()
    trace, tables, _ = prepare_tables(trace, options.tables, systems)  # once, not per point
    options = dataclasses.replace(options, tables=tables)
    table: dict[str, list[float]] = {n: [] for n in systems}
    for value in progress(values, len(values), f"sweeping {parameter}"):
        spec, opts = hw, options
        if parameter == "batch":
            opts = dataclasses.replace(options, batch=int(value))
        elif parameter in SWEEPABLE:
            cast = int if parameter == "cache_experts_per_layer" else float
            spec = dataclasses.replace(hw, **{parameter: cast(value)})
        else:
            raise SpecError(f"cannot sweep {parameter!r}")
        data = simulate(trace, model, spec, systems, opts, ablation=False)
        for n in systems:
            table[n].append(data["systems"][n]["normalized_time"])
    return {"parameter": parameter, "values": list(values), "normalized_time": table}
