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

import sys
from pathlib import Path

from stmoe.runtime.gpu_check.forecast_cli import main

if __name__ == "__main__":
    sys.exit(main(None, Path(__file__).resolve().parents[1], __doc__.split("\n\n")[0]))
