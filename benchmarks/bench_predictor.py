"""Speed of the ST-MoE predictor (and stmoe-plus, hybrid): one online step, and replay.

Targets (issue "The ST-MoE predictor, ..."):
- one online step (predict + update) for one token at one layer: median <= 20 us,
  at N=64, K=4 and at N=256, K=8;
- replay of a 100,000-token x 24-layer trace (N=60, K=4): >= 500,000 token-layers/s,
  with the same prefetch sets as the step-by-step path.

Each figure is printed with its ratio to the target and to a baseline measured in
the same run (a literal pure-Python implementation for the step; the step-by-step
protocol for the replay). All traces here are SYNTHETIC (``stmoe.synthesize``).

    python benchmarks/bench_predictor.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import stmoe
from stmoe.predictors import make, profile
from stmoe.predictors.base import Predictor
from stmoe.predictors.plus import MEMORY_TOKENS
from stmoe.predictors.st_moe import STMoEPredictor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_stmoe import predict_reference, profile_reference, update_reference

STEP_TARGET_US = 20.0
REPLAY_TARGET = 500_000  # token-layers per second


def bench_step(n: int, k: int, tokens: int) -> None:
    trace = stmoe.synthesize(tokens=tokens, layers=8, experts=n, top_k=k, sequences=4, seed=1)
    tables = profile(trace)
    p = STMoEPredictor(tables.shape, tables)
    ex = np.asarray(trace.experts)
    p.plan(trace)  # compile and warm up
    p.reset()
    times = []
    for t in range(trace.num_tokens):
        for layer in range(trace.num_layers - 1):
            start = time.perf_counter_ns()
            p.update(layer, ex[t, layer])
            p.predict(layer + 1)
            times.append(time.perf_counter_ns() - start)
        p.update(trace.num_layers - 1, ex[t, -1])
    median = statistics.median(times) / 1000
    # Baseline: the same step in plain Python (tests/reference_stmoe.py), same data.
    cct = copy.deepcopy(profile_reference(ex, n, k))
    base = []
    for t in range(1, min(trace.num_tokens, 300)):
        for layer in range(trace.num_layers - 1):
            start = time.perf_counter_ns()
            predict_reference([[s for s in r if s] for r in cct[layer]], ex[t, layer],
                              ex[t - 1, layer + 1])
            update_reference(cct[layer], list(ex[t, layer]), list(ex[t, layer + 1]), k)
            base.append(time.perf_counter_ns() - start)
    base_median = statistics.median(base) / 1000
    verdict = "PASS" if median <= STEP_TARGET_US else "FAIL"
    print(
        f"step N={n:<3} K={k}: median {median:6.2f} us (target <= {STEP_TARGET_US:.0f} us: "
        f"{STEP_TARGET_US / median:4.1f}x margin, {verdict}); pure-Python baseline "
        f"{base_median:6.1f} us -> {base_median / median:4.1f}x faster"
    )


def bench_step_plus(name: str, n: int, k: int, tokens: int) -> None:
    """The same step for stmoe-plus / hybrid (hybrid also takes a gate lookahead)."""
    trace = stmoe.synthesize(tokens=tokens, layers=8, experts=n, top_k=k, sequences=4, seed=1)
    tables = profile(trace)
    p = make(name, tables.shape, tables)
    ex = np.asarray(trace.experts)
    look = np.concatenate([ex, (ex + 1) % n], axis=2).astype(np.int16)  # a stand-in lookahead
    for t in range(50):  # compile and warm up
        for layer in range(trace.num_layers):
            p.update(layer, ex[t, layer])
    times = []
    for t in range(trace.num_tokens):
        for layer in range(trace.num_layers - 1):
            start = time.perf_counter_ns()
            p.update(layer, ex[t, layer])
            if p.uses_lookahead:
                p.lookahead(layer + 1, look[t, layer + 1])
            p.predict(layer + 1)
            times.append(time.perf_counter_ns() - start)
        p.update(trace.num_layers - 1, ex[t, -1])
    median = statistics.median(times) / 1000
    verdict = "PASS" if median <= STEP_TARGET_US else "FAIL"
    margin = STEP_TARGET_US / median
    print(f"step {name:<10} N={n:<3} K={k}: median {median:6.2f} us (target <= "
          f"{STEP_TARGET_US:.0f} us: {margin:4.1f}x margin, {verdict})")


def bench_replay(tokens: int, layers: int, n: int, k: int, check_tokens: int) -> None:
    t0 = time.perf_counter()
    trace = stmoe.synthesize(tokens=tokens, layers=layers, experts=n, top_k=k, sequences=100,
                             seed=2)
    gen = time.perf_counter() - t0
    tables = profile(trace)
    STMoEPredictor(tables.shape, tables).plan(stmoe.split(trace, 0.01, by="token")[0])  # compile
    p = STMoEPredictor(tables.shape, tables)
    start = time.perf_counter()
    plan = p.plan(trace)
    elapsed = time.perf_counter() - start
    rate = tokens * layers / elapsed
    # Same sets as the step-by-step protocol, on the first `check_tokens` tokens.
    head = stmoe.select_sequences(trace, range(max(1, check_tokens * 100 // tokens)))
    q = STMoEPredictor(tables.shape, tables)
    fast = q.plan(head)
    start = time.perf_counter()
    slow = Predictor.plan(STMoEPredictor(tables.shape, tables), head)
    slow_rate = head.num_tokens * layers / (time.perf_counter() - start)
    same = fast.equals(slow)
    verdict = "PASS" if rate >= REPLAY_TARGET and same else "FAIL"
    print(
        f"replay {tokens} tokens x {layers} layers (N={n}, K={k}; synthetic trace made in "
        f"{gen:.1f} s): {elapsed:.2f} s = {rate:,.0f} token-layers/s (target >= "
        f"{REPLAY_TARGET:,}: {rate / REPLAY_TARGET:4.1f}x, {verdict}); step-by-step path "
        f"{slow_rate:,.0f}/s -> {rate / slow_rate:4.1f}x; identical sets on "
        f"{head.num_tokens} tokens: {same}; mean set size {plan.sizes()[:, 1:].mean():.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller traces (a smoke run)")
    args = parser.parse_args()
    tokens = 10_000 if args.quick else 100_000
    print(f"stmoe {stmoe.__version__}, numpy {np.__version__}; SYNTHETIC traces")
    bench_step(64, 4, 1000)
    bench_step(256, 8, 1000)
    for name in ("stmoe-plus", "hybrid"):
        # profiled on more tokens than the token memory holds: it is full from the start
        bench_step_plus(name, 64, 4, MEMORY_TOKENS + 1000)
        bench_step_plus(name, 256, 8, MEMORY_TOKENS + 1000)
    bench_replay(tokens, 24, 60, 4, check_tokens=2000 if args.quick else 10_000)


if __name__ == "__main__":
    main()
