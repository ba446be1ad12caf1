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
closest plausible point; writes the JSON and the figure. What it computes and writes is
``stmoe.sim.accelerator.region_report``'s (tested there); this is its CLI.

    python benchmarks/paper_region.py [--traces ../shared/traces] [--json OUT]
        [--figure docs/figures/paper_region.png] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stmoe.sim.accelerator.region_report import sweep_paper_region, write_figures

ROOT = Path(__file__).resolve().parent.parent


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
    doc = sweep_paper_region(args.traces, args.quick)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"\nwrote {args.json}")
    if args.figure:
        write_figures(doc["results"], args.figure, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
