"""Speed of the simulator (target: 100,000 tokens x 24 layers in at most 10 s).

A SYNTHETIC trace with Qwen1.5-MoE-A2.7B's routing shape (24 MoE layers, 60
experts, top-4) is simulated on the `stmoe-asic` preset for each paper system;
the ST-MoE system's time includes its predictor's replay. Prints each time and
the ratio to the target; the compiled kernels are warmed up first.

    python benchmarks/bench_simulator.py [--tokens 100000]
"""

from __future__ import annotations

import argparse
import time

import stmoe
from stmoe.predictors import profile
from stmoe.sim.accelerator.systems import DEFAULT_SYSTEMS, RunOptions, run_system
from stmoe.sim.specs import hardware_preset, model_preset

TARGET_S = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    args = parser.parse_args()
    model, hw = model_preset("qwen1.5-moe-a2.7b"), hardware_preset("stmoe-asic")
    trace = stmoe.synthesize(tokens=args.tokens, layers=model.layers, experts=model.num_experts,
                             top_k=model.top_k, sequences=100, seed=3)
    tables = profile(trace)
    small = stmoe.select_sequences(trace, [0])
    for name in DEFAULT_SYSTEMS:  # compile once
        run_system(name, small, model, hw, RunOptions(tables=tables))
    print(f"SYNTHETIC trace: {trace.num_tokens} tokens x {trace.num_layers} layers "
          f"({int(trace.is_decode.sum())} decode), {model.name} on {hw.name}")
    for name in DEFAULT_SYSTEMS:
        start = time.perf_counter()
        result = run_system(name, trace, model, hw, RunOptions(tables=tables))
        elapsed = time.perf_counter() - start
        verdict = "PASS" if elapsed <= TARGET_S else "FAIL"
        print(f"{name:13s} {elapsed:6.2f} s ({elapsed / TARGET_S:.2f} of the {TARGET_S:.0f} s "
              f"target, {verdict}); simulated decode time {result.time:.4g} s")


if __name__ == "__main__":
    main()
