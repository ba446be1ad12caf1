#!/usr/bin/env python3
"""A FORECAST of the GPU check's decode table from the simulator's host pipeline: no GPU,
nothing measured (``stmoe.runtime.gpu_check.forecast``; docs/simulator.md).

    PYTHONPATH=src python3 benchmarks/gpu_forecast.py                  # ASSUMED GPU costs
    PYTHONPATH=src python3 benchmarks/gpu_forecast.py --hardware gpu_check.calibrated-gpu.toml
    PYTHONPATH=src python3 benchmarks/gpu_forecast.py --predictors-from CPU.toml  # + their time

The routing, its held-out split (tables profiled on tokens 0..99, the rest replayed), the
model's shape and the systems are the check's; the costs a grid of ASSUMED ones (public
link figures, a GUESSED compute time per layer) or a ``stmoe calibrate --tier gpu`` preset
(the check writes one beside its JSON).
Per point: each system's decode tokens/s and the issue's decode targets as a forecast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from stmoe.errors import StmoeError
from stmoe.evaluate.layer_capacity import size_split
from stmoe.predictors import profile
from stmoe.runtime.gpu_check.forecast import SHARES, assumed_grid, forecast, verdicts
from stmoe.runtime.gpu_check.setup import CARRIED, LAYERS, LIKE, SAMPLE, SPLIT_AT, SPLIT_PROMPT
from stmoe.sim.specs import hardware_preset, model_preset
from stmoe.trace import load_trace
from stmoe.trace.select import held_out_tail, select_layers

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", type=Path, default=None,
                    help="a `stmoe calibrate --tier gpu` preset (default: the ASSUMED grid)")
    ap.add_argument("--routing", type=Path, default=None,
                    help=f"the recorded routing (default {CARRIED}, else ../shared/traces)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="MoE layers (the check's: 4)")
    ap.add_argument("--predictors-from", type=Path, default=None,
                    help="a `stmoe calibrate` preset whose [host.predictors] stands for the "
                         "GPU host's predictor time in the ASSUMED grid (default: none counted)")
    a = ap.parse_args()
    given = hardware_preset(str(a.hardware)) if a.hardware else None  # refused before work
    path = a.routing or next((p for p in (REPO / CARRIED, REPO.parent / "shared" / "traces"
                                           / SAMPLE) if p.is_file()), None)
    if path is None:
        ap.error("no recorded routing: run benchmarks/gpu_check.py --prepare, or --routing")
    head, tail = held_out_tail(select_layers(load_trace(path), str(a.layers)), SPLIT_AT,
                               SPLIT_PROMPT)
    tables = profile(head)
    model = dataclasses.replace(model_preset(LIKE), layers=a.layers)
    print(f"FORECAST, not a measurement: {path.name}, {a.layers} MoE layers of {LIKE}, "
          f"HELD-OUT tables (profiled on tokens 0..{SPLIT_AT - 1}, "
          f"{tail.num_tokens - SPLIT_PROMPT} decode tokens replayed)")
    with tempfile.TemporaryDirectory() as tmp:
        for share in SHARES:
            # stmoe-plus-split's caches, sized from the profiled tokens alone (as the check's)
            split = size_split(head, round(share * model.num_experts)).capacities
            print(f"{share:.0%} in HBM: stmoe-plus-split's caches {','.join(map(str, split))}")
            points = ([(str(a.hardware), given)] if given is not None
                      else assumed_grid(model, share, Path(tmp), a.predictors_from))
            for label, hw in points:
                r = forecast(hw, model, tail, tables, share, split)
                rates = " ".join(f"{k} {v:.1f}" for k, v in r.items())
                marks = "; ".join(f"{n} {v:.2f} ({'MET' if v >= g else 'NOT MET'})"
                                  for n, v, g in verdicts(r))
                print(f"{share:.0%} in HBM, {label}: {rates} tok/s | {marks}")


if __name__ == "__main__":
    try:
        main()
    except StmoeError as exc:  # a bad --hardware, --layers or file: one line, not a traceback
        sys.exit(f"error: {exc}")
