"""`stmoe simulate`: what would ST-MoE (or another system) save on this hardware?"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from stmoe.cli.common import (
    check_inputs,
    check_range,
    clean_label,
    err,
    json_to_stdout,
    out,
    path_argument,
    path_option,
    print_json,
    write_json,
)
from stmoe.errors import StmoeError
from stmoe.runtime.options import OffloadOptions
from stmoe.sim.specs import preset_names
from stmoe.util.units import capacity_per_layer, layer_capacities

RUNTIME_CAPACITY = str(OffloadOptions.capacity)  # the runtime's own default cache size


def simulate_cmd(
    trace_path: Annotated[Path, path_argument(metavar="TRACE", help="Trace of the model.")],
    model: Annotated[str, typer.Option(
        help=f"Model preset ({', '.join(preset_names('models'))}) or a .toml.")],
    hardware: Annotated[str, typer.Option(
        help=f"Hardware preset ({', '.join(preset_names('hardware'))}) or a .toml (`stmoe "
        "calibrate` writes one of this machine).")] = "stmoe-asic",
    system: Annotated[
        list[str] | None,
        typer.Option(
            help="System to simulate (repeat; default: gpu-baseline, adap-gating, "
            "pregated, stmoe, oracle). Any replay predictor name works too."
        ),
    ] = None,
    tables: Annotated[
        Path | None,
        path_option(
            help="ST-MoE tables (stmoe profile). Default: profile on the first half of "
            "the trace and simulate the second half; with --pipeline runtime, profiled on "
            "the whole trace simulated (IN-SAMPLE, said so: give tables profiled on other "
            "routing for a held-out figure)."
        ),
    ] = None,
    batch: Annotated[int, typer.Option(help="Sequences decoding together (>= 1).")] = 1,
    policy: Annotated[
        str, typer.Option(help="Expert cache eviction: lru, lfu or none (stmoe.cache_policy).")
    ] = "lru",
    buffer: Annotated[
        str | None,
        typer.Option(
            help="Expert buffer kept across tokens, overriding the hardware's "
            "cache_experts_per_layer: experts per layer (4), a share of them (10%) or bytes "
            "per layer (64MiB, rounded down to whole experts)."
        ),
    ] = None,
    buffer_for: Annotated[
        str | None,
        typer.Option(
            help="Who keeps experts in that buffer: all (every system) or epu (the systems "
            "with a prediction unit, and the oracle; the paper's baselines keep none). "
            "Default: the hardware's buffer_for."
        ),
    ] = None,
    pregate_accuracy: Annotated[
        float, typer.Option(help="Accuracy of the pre-gated system's pre-gate, 0 to 1.")
    ] = 1.0,
    adap_threshold: Annotated[
        float, typer.Option(help="Adaptive-Gating: gate mass a token keeps (lossy), 0 to 1.")
    ] = 0.8,
    pipeline: Annotated[
        str,
        typer.Option(
            help="accelerator: the paper's pipeline; runtime: the offloading runtime on this "
            "host (needs a `stmoe calibrate` hardware .toml; systems on-demand, lru-only, "
            "stmoe, stmoe-plus, stmoe-plus-score (its score eviction), oracle, with the "
            "runtime's prefetch admission; NAME-all, e.g. stmoe-all: admission off, every "
            "predicted load)."
        ),
    ] = "accelerator",
    capacity: Annotated[
        str, typer.Option(help="Runtime pipeline: experts cached per layer (8), a share (50%), "
                          "or one count per MoE layer (48,60,12: `stmoe split-capacity`'s).")
    ] = RUNTIME_CAPACITY,
    layers: Annotated[
        int | None, typer.Option(help="Only the first N MoE layers (a make-model --layers model).")
    ] = None,
    decode_tokens: Annotated[
        int | None, typer.Option(help="Runtime pipeline: decode tokens replayed (default: all).")
    ] = None,
    sequence: Annotated[int, typer.Option(help="Runtime pipeline: the sequence replayed.")] = 0,
    json_out: Annotated[
        Path | None, path_option("--json", help="Write the results as JSON ('-': stdout).")
    ] = None,
    output_dir: Annotated[
        Path | None,
        path_option(
            "--output",
            "-o",
            help="Folder for the figures (normalized time, ablation, "
            "and sweeps over bandwidth, cache capacity and batch size).",
        ),
    ] = None,
) -> None:
    """Simulate the ST-MoE pipeline and the systems it is compared with on a real trace.

    Prints each system's execution time normalized to the GPU baseline (= 1) with a
    breakdown (compute, stall waiting for weights, link and prediction time), energy
    and energy-delay product. See docs/simulator.md for the model and its limits.
    """
    from stmoe.cli.table_notes import note_tables
    from stmoe.predictors import load_tables
    from stmoe.predictors.base import ModelShape
    from stmoe.sim.accelerator import plots
    from stmoe.sim.accelerator.simulate import check_model_fits, prepare_tables, simulate, sweep
    from stmoe.sim.accelerator.systems import DEFAULT_SYSTEMS, RunOptions
    from stmoe.sim.specs import hardware_preset, model_preset
    from stmoe.trace import import_files
    from stmoe.trace.select import first_layers

    check_inputs("a trace file", trace_path)
    for spec in (model, hardware):
        if spec.endswith(".toml"):
            check_inputs("a .toml spec file", Path(spec))
    check_range("--batch", batch, 1)
    check_range("--pregate-accuracy", pregate_accuracy, 0.0, 1.0)
    check_range("--adap-threshold", adap_threshold, 0.0, 1.0)
    check_range("--layers", layers, 1)
    check_range("--decode-tokens", decode_tokens, 1)
    check_range("--sequence", sequence, 0)
    if pipeline not in ("accelerator", "runtime"):
        raise StmoeError(f"--pipeline {clean_label(pipeline)}: expected accelerator or runtime")
    json_to_stdout(json_out)
    loaded = load_tables(tables) if tables else None  # checked before the trace is read
    trace = import_files([trace_path])
    spec_m, spec_h = model_preset(model), hardware_preset(hardware)
    if layers is not None:  # a model of the first N layers routes the trace's first N
        trace = first_layers(trace, layers)
        spec_m = dataclasses.replace(spec_m, layers=layers)
    spec_h = _with_buffer(spec_h, spec_m, buffer, buffer_for)
    if loaded is not None and loaded.shape == ModelShape.of(trace):  # (else refused below)
        note_tables(trace, loaded)  # in-sample, synthetic or another model's tables
    _refuse_other_pipelines(pipeline, {
        "runtime": {"--capacity": capacity != RUNTIME_CAPACITY, "--decode-tokens": decode_tokens
                        is not None, "--sequence": sequence != 0},
        "accelerator": {"--batch": batch != 1, "--policy": policy != "lru", "--output":
                    output_dir is not None, "--pregate-accuracy": pregate_accuracy != 1.0,
                    "--adap-threshold": adap_threshold != 0.8, "--buffer": buffer is not None,
                    "--buffer-for": buffer_for is not None},
    })
    if pipeline == "runtime":
        _runtime(trace, spec_m, spec_h, system, loaded, (capacity, decode_tokens, sequence),
                 json_out)
        return
    systems = system or list(DEFAULT_SYSTEMS)
    check_model_fits(trace, spec_m)
    if not trace.is_decode.any():  # (a review: the fallback was silent)
        err.print("note: the trace marks no decode token, so every token is simulated as a "
                  "decode step")
    trace, loaded, note = prepare_tables(trace, loaded, systems)  # once, for every sweep too
    opts = RunOptions(tables=loaded, batch=batch,
                      pregate_accuracy=pregate_accuracy, adap_threshold=adap_threshold,
                      policy=policy)
    data = simulate(trace, spec_m, spec_h, systems, opts)
    data["tables"] = note
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        plots.normalized_time(data, output_dir / "normalized_time.png")
        plots.ablation(data, output_dir / "ablation.png")
        bw = spec_h.link_bytes_per_s
        n = trace.num_experts  # the sweeps' points that this trace (its simulated part) has
        sweeps = {
            "link_bytes_per_s": ([bw / 4, bw / 2, bw, 2 * bw, 4 * bw, 8 * bw, 16 * bw],
                                 "link bandwidth (bytes/s)"),
            "cache_experts_per_layer": ([c for c in (0, 2, 4, 8, 16, 32) if c < n] + [n],
                                        "cache capacity (experts per layer)"),
            "batch": ([b for b in (1, 2, 4, 8) if b <= trace.num_sequences],
                      "batch size (sequences)"),
        }
        data["sweeps"] = {}
        for parameter, (values, label) in sweeps.items():  # the batch sweep sets its own batch
            result = sweep(trace, spec_m, spec_h, systems, parameter, values, opts)
            data["sweeps"][parameter] = result
            plots.sweep(result, data, output_dir / f"sweep_{parameter}.png", label)
    if json_to_stdout(json_out):
        print_json(data)
        return
    _print(data)
    write_json(data, json_out)
    if output_dir is not None:
        out.print(f"wrote figures to {clean_label(output_dir)}/")


def _cached(capacity: int | tuple[int, ...]) -> str:
    """A runtime run's cache, in its table's title."""
    if isinstance(capacity, int):
        return f"{capacity} experts cached per layer"
    return f"{','.join(map(str, capacity))} experts cached (each MoE layer's)"


def _with_buffer(hw: Any, model: Any, buffer: str | None, buffer_for: str | None) -> Any:
    """The hardware with ``--buffer`` and ``--buffer-for`` applied (checked first)."""
    from stmoe.sim.specs import BUFFER_FOR

    if buffer_for is not None and buffer_for not in BUFFER_FOR:
        raise StmoeError(f"--buffer-for {clean_label(buffer_for)}: expected "
                         f"{' or '.join(BUFFER_FOR)}")
    changes: dict[str, Any] = {} if buffer_for is None else {"buffer_for": buffer_for}
    if buffer is not None:  # bytes: one layer's buffer; none at all is allowed (0)
        changes["cache_experts_per_layer"] = capacity_per_layer(
            buffer, model.num_experts, 0, expert_bytes=model.expert_bytes, name="--buffer",
            error=StmoeError)
    return dataclasses.replace(hw, **changes) if changes else hw


def _print(data: dict) -> None:
    synthetic = " [SYNTHETIC TRACE]" if data["trace"]["synthetic"] else ""
    title = (
        f"{clean_label(data['model'])} on {clean_label(data['hardware'])}, batch {data['batch']}"
    )
    table = Table(title=title + synthetic, title_justify="left")
    for col in ("system", "time (s)", "normalized", "compute", "stall", "link", "energy (J)",
                "EDP (J s)", "hit rate"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in data["systems"].items():
        b = r["breakdown"]
        table.add_row(clean_label(name), f"{r['time']:.4g}", f"{r['normalized_time']:.3f}",
                      f"{b['compute']:.3g}", f"{b['stall']:.3g}", f"{b['communication']:.3g}",
                      f"{r['energy']:.4g}", f"{r['edp']:.4g}", f"{r['hit_rate']:.2f}")
    out.print(table)
    out.print(f"tables: {clean_label(data['tables'])}")
    buf = data.get("buffer") or {}
    if buf.get("experts_per_layer"):
        who = "every system" if buf["for"] == "all" else "the EPU systems and the oracle"
        out.print(f"expert buffer: {buf['experts_per_layer']} experts per layer kept across "
                  f"tokens by {who} ({buf['mib']:,.0f} MiB, ~{buf['area_mm2_estimate']:,.0f} "
                  "mm2 at 40 nm)")
    q = data["systems"].get("adap-gating", {}).get("quality")
    if q:
        kept, dropped = q["experts_per_token_layer"], q["dropped_gate_mass"]
        out.print(f"adap-gating is lossy: keeps {kept:.2f} experts per token-layer, dropping "
                  f"{dropped:.1%} of the gate mass")


def _runtime(trace: Any, model: Any, hw: Any, system: list[str] | None, tables: Any,
             replay: tuple[str, int | None, int], json_out: Path | None) -> None:
    """``--pipeline runtime``: the runtime's systems replaying one sequence on this host."""
    from stmoe.predictors import profile
    from stmoe.sim.accelerator.simulate import check_model_fits, needs_plus_fit
    from stmoe.sim.host.calibrated import measured_on
    from stmoe.sim.host.systems import RUNTIME_SYSTEMS, HostOptions, simulate_runtime

    capacity, decode_tokens, sequence = replay
    check_model_fits(trace, model)
    simulated = measured_on(model.layers, model.num_experts, model.expert_bytes)
    if hw.host is not None and hw.host.measured_on not in ("", simulated):
        err.print(f"note: {clean_label(hw.name)} was calibrated on a model of "
                  f"{hw.host.measured_on}; its layer and token times are that model's, "
                  f"not {clean_label(model.name)}'s ({simulated})", markup=False)
    systems = system or list(RUNTIME_SYSTEMS)
    note = "given"
    if tables is None:  # as benchmarks/bench_offload_real.py: in-sample, said so
        tables = profile(trace, fit_plus=needs_plus_fit(systems))
        note = "profiled on the simulated trace itself (IN-SAMPLE)"
    per_layer: int | tuple[int, ...]
    if "," in capacity:  # one count per MoE layer, as the runtime's --capacity takes
        per_layer = layer_capacities(capacity, model.num_experts, model.top_k,
                                     num_layers=trace.num_layers, name="--capacity",
                                     error=StmoeError)
    else:
        per_layer = capacity_per_layer(capacity, model.num_experts, model.top_k,
                                       expert_bytes=model.expert_bytes, forms=("count", "share"),
                                       name="--capacity", error=StmoeError)
    options = HostOptions(capacity=per_layer, sequence=sequence,
                          decode_tokens=decode_tokens, tables=tables)
    data = simulate_runtime(trace, model, hw, systems, options)
    data["tables"] = note
    if json_to_stdout(json_out):
        print_json(data)
        return
    synthetic = " [SYNTHETIC TRACE]" if data["trace"]["synthetic"] else ""
    table = Table(title=f"runtime pipeline: {clean_label(data['model'])} on "
                  f"{clean_label(data['hardware'])}, {_cached(per_layer)}"
                  + synthetic, title_justify="left")
    for col in ("system", "decode tok/s", "decode s", "stall share", "hit rate", "moved GiB",
                "admission"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in data["systems"].items():
        c = r["counters"]
        adm = ("exempt (the bound)" if r["predictor"] == "oracle" else
               f"{c['layers_off']:.0f} layers off at the end, {c['off_calls']:.0f} calls off"
               if r["admission"] else "off: every load")
        table.add_row(clean_label(name), f"{r['decode_tokens_per_s']:.3g}", f"{r['decode_s']:.4g}",
                      f"{r['stall_share']:.2f}", f"{r['hit_rate']:.3f}",
                      f"{r['bytes_moved'] / 2**30:.2f}", adm)
    out.print(table)
    out.print(f"tables: {clean_label(note)}")
    untimed = sorted({r["predictor"] for r in data["systems"].values() if not r["predictor_time"]})
    if untimed:  # its decode time leaves out the predictor's own: said, not hidden
        out.print(f"predictor time not in the preset for {', '.join(untimed)}: counted as 0 "
                  "(`stmoe calibrate --tables` measures it)")
    write_json(data, json_out)


def _refuse_other_pipelines(pipeline: str, given: dict[str, dict[str, bool]]) -> None:
    """An option of the other pipeline, given, is refused rather than silently ignored."""
    for other, options in given.items():
        if other != pipeline:
            named = [name for name, set_ in options.items() if set_]
            if named:
                raise StmoeError(f"{', '.join(named)}: an option of --pipeline {other}, "
                                 f"not taken by --pipeline {pipeline}")
