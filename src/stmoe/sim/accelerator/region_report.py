"""Where, if anywhere, do the paper's figures all hold? The sweep ``benchmarks/paper_region.py``
runs: its traces, its grids, the lines it prints, the JSON and the figures it writes.

Why here: the benchmark is a thin CLI and a test checks what it computes and writes
(docs/architecture.md: no test reaches into ``benchmarks/``). Link bandwidth x expert
buffer x PE array on the ``stmoe-asic`` preset, twice (the buffer in every system, and
in ST-MoE's chip only), on the real Qwen1.5-MoE prompts (tables profiled on the other
two), the real Qwen3.6-35B-A3B sample (its first half profiled) and a synthetic trace
of Qwen1.5-MoE's shape; each point judged by ``region.conditions``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stmoe.predictors import ProfiledTables, profile
from stmoe.sim.accelerator.region import Plausible, Targets, closest, sweep_region
from stmoe.sim.accelerator.simulate import prepare_tables
from stmoe.sim.specs import hardware_preset, model_preset
from stmoe.trace import RoutingTrace, import_files, synthesize

HARDWARE = "stmoe-asic"
QWEN15 = ("cooking_1", "history_1", "ml_moe_1")
BANDWIDTH_X = (0.25, 0.5, 1, 2, 4, 8, 16, 32)  # times stmoe-asic's 102.4 GB/s
PE_ARRAYS = (256, 512, 1024, 2048, 4096, 16384, 65536)  # MACs a cycle: 16x16 to 256x256
BUFFER_COUNTS = (0, 1, 2, 4, 8)  # experts per layer, with N/4, N/2 and N
BUFFER_RULES = ("epu", "all")


@dataclass(frozen=True)
class RegionCase:
    """One trace swept: the model preset it runs as, its tables and where they came from."""

    name: str
    trace: RoutingTrace
    model: str
    tables: ProfiledTables
    note: str


def cases(traces: Path, quick: bool) -> list[RegionCase]:
    """Every trace swept (``quick``: one real prompt and a tiny synthetic trace)."""
    out = []
    q15 = {n: import_files([traces / "qwen15" / f"{n}.routes.json"]) for n in QWEN15}
    for name in QWEN15[:1] if quick else QWEN15:
        others = [q15[o] for o in QWEN15 if o != name]
        out.append(RegionCase(f"qwen1.5 {name}", q15[name], "qwen1.5-moe-a2.7b",
                              profile(others, fit_plus=False),
                              "real; tables profiled on the other two prompts"))
    if not quick:
        sample = import_files([traces / "qwen3.6-35b-a3b_chat-1prompt.npz"])
        rest, tables, _ = prepare_tables(sample, None)
        out.append(RegionCase("qwen3.6 sample", rest, "qwen3.6-35b-a3b", tables,
                              "real, one prompt: first half profiled"))
    synth = synthesize(tokens=400 if quick else 2000, layers=24, experts=60, top_k=4,
                             sequences=8, spatial=0.9, temporal=0.4, skew=0.8, seed=5)
    rest, tables, _ = prepare_tables(synth, None)
    out.append(RegionCase("SYNTHETIC qwen1.5 shape", rest, "qwen1.5-moe-a2.7b", tables,
                          "SYNTHETIC; first half profiled"))
    return out


def grid(num_experts: int, quick: bool) -> dict[str, list[float]]:
    """The points swept: link bandwidths, buffer sizes (experts per layer), PE arrays."""
    base = hardware_preset(HARDWARE).link_bytes_per_s
    shares = sorted({*BUFFER_COUNTS, num_experts // 4, num_experts // 2, num_experts})
    if quick:
        return {"link_bytes_per_s": [base, 8 * base], "cache_experts_per_layer": [0, 1],
                "pe_macs_per_cycle": [1024, 4096]}
    return {"link_bytes_per_s": [base * x for x in BANDWIDTH_X],
            "cache_experts_per_layer": shares, "pe_macs_per_cycle": list(PE_ARRAYS)}


def describe(row: dict[str, Any] | None) -> str:
    """One point in a line: the claims it meets, its hardware and its figures."""
    if row is None:
        return "none"
    f = row["figures"]
    failed = [k for k, ok in row["conditions"].items() if not ok]
    steps = " -> ".join(f"{s:.2f}" for s in f["ablation"])
    return (f"{row['met']}/5 (fails: {', '.join(failed) or 'none'}) at "
            f"{row['link_bytes_per_s'] / 1e9:.0f} GB/s, buffer {row['cache_experts_per_layer']} "
            f"experts/layer ({row['buffer_mm2']:.0f} mm2), PE {row['pe_macs_per_cycle']:.0f}: "
            f"ST-MoE/GPU {f['stmoe_vs_gpu']:.3f}, Pre-gated/ST-MoE {f['pregated_vs_stmoe']:.2f}, "
            f"ablation {steps}, energy {f['energy']:.3f}, EDP {f['edp']:.3f}, baseline's "
            f"communication share {f['baseline_comm_share']:.2f}")


def sweep_paper_region(traces: Path, quick: bool = False,
                       say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every case swept under both buffer rules, each one's summary ``say``-ed as it ends;
    the JSON's document (``targets``, ``plausible``, ``results``: one per case and rule)."""
    hw = hardware_preset(HARDWARE)
    targets, limits = Targets(), Plausible()
    say(f"targets: {targets}\nplausible 40 nm-era chip (assumptions): {limits}")
    results = []
    for case in cases(traces, quick):
        model = model_preset(case.model)
        for rule in BUFFER_RULES:
            rows = sweep_region(case.trace, model, hw, case.tables,
                                grid(model.num_experts, quick), buffer_for=rule,
                                targets=targets, limits=limits)
            full = [r for r in rows if r["met"] == 5]
            plausible = [r for r in full if r["plausible"]]
            say(f"\n{case.name} ({case.note}), buffer for {rule}: all five at "
                f"{len(full)} of {len(rows)} points, {len(plausible)} plausible, "
                f"{sum(r['premise'] for r in plausible)} of those with the paper's premise "
                "(baseline 60-80% communication)")
            say(f"  closest plausible: {describe(closest(rows, plausible_only=True))}")
            most = describe(closest(rows, plausible_only=False))
            say(f"  least hardware meeting the most: {most}")
            results.append({"trace": case.name, "note": case.note, "model": model.name,
                            "buffer_for": rule, "rows": rows})
    return {"targets": vars(targets), "plausible": vars(limits), "results": results}


def write_figures(results: list[dict[str, Any]], figure: Path, quick: bool = False,
                  say: Callable[[str], None] = print) -> list[Path]:
    """The region's heatmaps at ``figure`` (buffer in ST-MoE's chip) and ``<stem>_all``
    (in every system), and ``<stem>_buffer``: the ratios against the buffer's size on the
    first real trace. matplotlib is imported here, only when a figure is asked for."""
    from stmoe.sim.accelerator.plots import buffer_curves, region

    written = []
    for rule in BUFFER_RULES:
        path = figure if rule == "epu" else figure.with_stem(f"{figure.stem}_all")
        region([r for r in results if r["buffer_for"] == rule], path)
        say(f"wrote {path}")
        written.append(path)
    hw = hardware_preset(HARDWARE)
    first = next(r for r in results if r["buffer_for"] == "epu")  # a real Qwen1.5 prompt
    base = hw.link_bytes_per_s
    links = sorted({r["link_bytes_per_s"] for r in first["rows"]})
    shown = [x for x in links if x in (base / 2, base, 4 * base)] or links[:1]
    path = figure.with_stem(f"{figure.stem}_buffer")
    buffer_curves(first, path, hw.pe_macs_per_cycle if not quick else 1024, shown)
    say(f"wrote {path}")
    written.append(path)
    return written
