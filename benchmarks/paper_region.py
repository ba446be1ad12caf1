"""Where, if anywhere, do the paper's figures all hold in stmoe's simulator? (issue 32)

Sweeps link bandwidth x expert buffer x PE array on the `stmoe-asic` preset and checks,
at every point, the paper's five claims at once (docs/method.md): ST-MoE <= 0.45 of the
GPU baseline's time, ST-MoE >= 1.3x faster than Pre-gated MoE, the ablation increasing at
every step, ST-MoE's energy +0-20% over the baseline's, EDP <= 0.5x. Twice: with the
buffer in every system (`buffer_for = "all"`) and in ST-MoE's chip only (`"epu"`, the
paper's baselines keeping no experts across tokens).

Traces: the three real Qwen1.5-MoE prompts (tables profiled on the OTHER two), the real
Qwen3.6-35B-A3B sample (one prompt: tables from its first half, its second half
simulated) and a SYNTHETIC trace of Qwen1.5-MoE's shape (docs/simulator.md's recipe,
shorter; first half profiled). Prints, per trace and buffer rule, how many points meet
all five, how many of them a 40 nm-era chip could have (`region.Plausible`), and the
closest plausible point; writes the JSON and the figure.

    python benchmarks/paper_region.py [--traces ../shared/traces] [--json OUT]
        [--figure docs/figures/paper_region.png] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import stmoe
from stmoe.predictors import profile
from stmoe.sim.accelerator.region import Plausible, Targets, closest, sweep_region
from stmoe.sim.accelerator.simulate import prepare_tables
from stmoe.sim.specs import hardware_preset, model_preset
from stmoe.trace import import_files

ROOT = Path(__file__).resolve().parent.parent
QWEN15 = ("cooking_1", "history_1", "ml_moe_1")
BANDWIDTH_X = (0.25, 0.5, 1, 2, 4, 8, 16, 32)  # times stmoe-asic's 102.4 GB/s
PE_ARRAYS = (256, 512, 1024, 2048, 4096, 16384, 65536)  # MACs a cycle: 16x16 to 256x256
BUFFER_COUNTS = (0, 1, 2, 4, 8)  # experts per layer, with N/4, N/2 and N


def cases(traces: Path, quick: bool) -> list[dict[str, Any]]:
    """(name, trace, model, tables, note) for every trace swept."""
    out = []
    q15 = {n: import_files([traces / "qwen15" / f"{n}.routes.json"]) for n in QWEN15}
    for name in QWEN15[:1] if quick else QWEN15:
        others = [q15[o] for o in QWEN15 if o != name]
        out.append({"name": f"qwen1.5 {name}", "trace": q15[name], "model": "qwen1.5-moe-a2.7b",
                    "tables": profile(others, fit_plus=False),
                    "note": "real; tables profiled on the other two prompts"})
    if not quick:
        sample = import_files([traces / "qwen3.6-35b-a3b_chat-1prompt.npz"])
        rest, tables, _ = prepare_tables(sample, None)
        out.append({"name": "qwen3.6 sample", "trace": rest, "model": "qwen3.6-35b-a3b",
                    "tables": tables, "note": "real, one prompt: first half profiled"})
    synth = stmoe.synthesize(tokens=400 if quick else 2000, layers=24, experts=60, top_k=4,
                             sequences=8, spatial=0.9, temporal=0.4, skew=0.8, seed=5)
    rest, tables, _ = prepare_tables(synth, None)
    out.append({"name": "SYNTHETIC qwen1.5 shape", "trace": rest, "model": "qwen1.5-moe-a2.7b",
                "tables": tables, "note": "SYNTHETIC; first half profiled"})
    return out


def grid(num_experts: int, quick: bool) -> dict[str, list[float]]:
    base = hardware_preset("stmoe-asic").link_bytes_per_s
    shares = sorted({*BUFFER_COUNTS, num_experts // 4, num_experts // 2, num_experts})
    if quick:
        return {"link_bytes_per_s": [base, 8 * base], "cache_experts_per_layer": [0, 1],
                "pe_macs_per_cycle": [1024, 4096]}
    return {"link_bytes_per_s": [base * x for x in BANDWIDTH_X],
            "cache_experts_per_layer": shares, "pe_macs_per_cycle": list(PE_ARRAYS)}


def describe(row: dict[str, Any] | None) -> str:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces",
                        help="folder of the real traces (default: ../shared/traces)")
    parser.add_argument("--json", type=Path, help="write every point's figures here")
    parser.add_argument("--figure", type=Path, help="write the region figure here (.png)")
    parser.add_argument("--quick", action="store_true",
                        help="one real prompt, a tiny synthetic trace and a 2x2x2 grid "
                        "(a smoke run)")
    args = parser.parse_args(argv)
    if not (args.traces / "qwen15").is_dir():
        print(f"{args.traces}: no qwen15/ folder of real traces (give --traces)", file=sys.stderr)
        return 2
    hw = hardware_preset("stmoe-asic")
    targets, limits = Targets(), Plausible()
    print(f"targets: {targets}\nplausible 40 nm-era chip (assumptions): {limits}")
    results = []
    for case in cases(args.traces, args.quick):
        model = model_preset(case["model"])
        for rule in ("epu", "all"):
            rows = sweep_region(case["trace"], model, hw, case["tables"],
                                grid(model.num_experts, args.quick), buffer_for=rule,
                                targets=targets, limits=limits)
            full = [r for r in rows if r["met"] == 5]
            plausible = [r for r in full if r["plausible"]]
            print(f"\n{case['name']} ({case['note']}), buffer for {rule}: all five at "
                  f"{len(full)} of {len(rows)} points, {len(plausible)} plausible, "
                  f"{sum(r['premise'] for r in plausible)} of those with the paper's premise "
                  "(baseline 60-80% communication)")
            print(f"  closest plausible: {describe(closest(rows, plausible_only=True))}")
            most = describe(closest(rows, plausible_only=False))
            print(f"  least hardware meeting the most: {most}")
            results.append({"trace": case["name"], "note": case["note"], "model": model.name,
                            "buffer_for": rule, "rows": rows})
    if args.json:
        args.json.write_text(json.dumps({"targets": vars(targets), "plausible": vars(limits),
                                         "results": results}, indent=1))
        print(f"\nwrote {args.json}")
    if args.figure:
        from stmoe.sim.accelerator.plots import region

        for rule in ("epu", "all"):
            path = args.figure if rule == "epu" else args.figure.with_stem(
                f"{args.figure.stem}_all")
            region([r for r in results if r["buffer_for"] == rule], path)
            print(f"wrote {path}")
        from stmoe.sim.accelerator.plots import buffer_curves

        first = next(r for r in results if r["buffer_for"] == "epu")  # a real Qwen1.5 prompt
        base = hw.link_bytes_per_s
        links = sorted({r["link_bytes_per_s"] for r in first["rows"]})
        shown = [x for x in links if x in (base / 2, base, 4 * base)] or links[:1]
        path = args.figure.with_stem(f"{args.figure.stem}_buffer")
        buffer_curves(first, path, hw.pe_macs_per_cycle if not args.quick else 1024, shown)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
