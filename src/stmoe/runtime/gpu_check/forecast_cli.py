"""``benchmarks/gpu_forecast.py``'s command line, in the package so its refusals are tested
(tests do not run benchmarks): a FORECAST of the GPU check's decode table, nothing measured
(``forecast``). A bad input (a missing ``--hardware``, ``--layers`` out of range, a routing
that is not a trace) is one ``error:`` line and status 1, the hardware read before the
tables are profiled."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from stmoe.errors import StmoeError
from stmoe.evaluate.layer_capacity import size_split
from stmoe.predictors import profile
from stmoe.runtime.gpu_check.forecast import SHARES, assumed_grid, forecast, verdicts
from stmoe.runtime.gpu_check.setup import CARRIED, LAYERS, LIKE, SAMPLE, SPLIT_AT, SPLIT_PROMPT
from stmoe.sim.specs import HardwareSpec, hardware_preset, model_preset
from stmoe.trace import load_trace
from stmoe.trace.select import held_out_tail, select_layers


def main(argv: Sequence[str] | None, repo: Path, description: str = "") -> int:
    """Parse ``argv`` (the routing's default found under ``repo``: the check's prepared one,
    else ../shared/traces), print the forecast; the exit status."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--hardware", type=Path, default=None,
                    help="a `stmoe calibrate --tier gpu` preset (default: the ASSUMED grid)")
    ap.add_argument("--routing", type=Path, default=None,
                    help=f"the recorded routing (default {CARRIED}, else ../shared/traces)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="MoE layers (the check's: 4)")
    ap.add_argument("--predictors-from", type=Path, default=None,
                    help="a `stmoe calibrate` preset whose [host.predictors] stands for the "
                         "GPU host's predictor time in the ASSUMED grid (default: none counted)")
    a = ap.parse_args(argv)
    try:
        given = hardware_preset(str(a.hardware)) if a.hardware else None  # before any work
        path = a.routing or next((p for p in (repo / CARRIED, repo.parent / "shared"
                                               / "traces" / SAMPLE) if p.is_file()), None)
        if path is None:
            raise StmoeError("no recorded routing: run benchmarks/gpu_check.py --prepare, or "
                             "give --routing")
        _forecast(a, path, given)
    except StmoeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _forecast(a: argparse.Namespace, path: Path, given: HardwareSpec | None) -> None:
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
