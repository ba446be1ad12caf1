"""Offloaded decoding speed of stmoe's own model: on-demand, LRU-only, ST-MoE, oracle.

Targets (issue 8), at 50% cache capacity on an EMULATED link set so that
on-demand loading is at least half of decode time:
  * ST-MoE decode tokens/s >= 1.5x on-demand's;
  * ST-MoE decode time <= 1.25x the oracle's;
and, with every expert resident, the runtime >= 0.9x plain transformers.

Systems (same cache size per layer):
  on-demand  no prefetch, no reuse: each layer loads the experts it needs
  lru-only   no prefetch, LRU cache
  stmoe      ST-MoE prefetch (the paper's rules, shipped tables) + prediction-aware LRU
  stmoe-plus stmoe's probabilistic table predictor (same tables), 1.5K experts per prediction
  hybrid     stmoe-plus fused with gate lookahead (the next router on this layer's state)
  oracle     prefetches exactly the experts the router will pick (a first pass records them)
Extra systems (any registered predictor) with --extra NAME.

Every system runs the same prompts (not those the shipped tables were
profiled on) from a cold cache, after one untimed warm-up generation (so
compiling a predictor's kernels is not timed); figures are totals over prompts. The disk tier
reads the store with O_DIRECT (or drops the page cache) so misses are real reads.

    python benchmarks/bench_runtime.py [--bandwidth 200MB] [--tokens 64] [--rounds 3]
                                       [--capacities 50%] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from stmoe.evaluate.systems import OFFLOAD_SYSTEMS, compared_predictor
from stmoe.hf.loading import load_model
from stmoe.models import SHIPPED_MODEL, SHIPPED_TABLES
from stmoe.predictors import load_tables
from stmoe.runtime.api import OffloadedModel, offload
from stmoe.runtime.store import ensure_store

PROMPTS = (
    "class Stack:\n    def __init__(self):\n",
    "The river was quiet that morning, and the boats",
    "Problem: What is 12 times 15?\nSolution:",
)


def shipped(threads: int) -> tuple[Path, Any]:
    """The shipped model's store (packed once into the benchmarks' cache) and its tables,
    with torch's compute threads set."""
    torch.set_num_threads(threads)
    os.environ.setdefault("STMOE_CACHE", str(Path(tempfile.gettempdir()) / "stmoe-bench"))
    return ensure_store(SHIPPED_MODEL, None), load_tables(SHIPPED_MODEL / SHIPPED_TABLES)


def run_system(om: OffloadedModel, tokens: int) -> dict[str, Any]:
    om.generate(PROMPTS[0], max_new_tokens=4)  # untimed: compiles the predictor's kernels
    results = [om.generate(p, max_new_tokens=tokens) for p in PROMPTS]
    decode_s = sum(r.decode_s for r in results)
    decode_tokens = sum(r.decode_tokens for r in results)
    needed = sum(r.stats["phases"]["decode"]["needed"] for r in results)
    return {
        "decode_tokens_per_s": decode_tokens / decode_s,
        "stall_share": sum(r.stall_s for r in results) / decode_s,
        "hit_rate": statistics.mean(r.hit_rate for r in results),
        "prefetch_recall": statistics.mean(r.prefetch_recall for r in results),
        "prefetch_precision": statistics.mean(r.prefetch_precision for r in results),
        "bytes_moved": sum(r.bytes_moved for r in results),
        "bytes_wasted": sum(r.bytes_wasted for r in results),
        # bytes moved per byte of loads the router then used (1.0: nothing moved in vain)
        "read_amplification": sum(r.bytes_moved for r in results)
        / max(1, sum(r.bytes_moved - r.bytes_wasted for r in results)),
        "needed_experts": needed,
        "tokens": [r.tokens for r in results],
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs of one system (the tokens of the first)."""
    return {key: runs[0][key] if key == "tokens" else statistics.median(r[key] for r in runs)
            for key in runs[0]}


def resident_ratio(tokens: int, repeats: int) -> dict[str, float]:
    """Plain transformers vs the runtime holding every expert (warm), interleaved."""
    model, tok = load_model(SHIPPED_MODEL)
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids

    def plain() -> float:
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    plain()
    with offload(SHIPPED_MODEL, capacity="100%", predictor="ondemand", tier="disk") as om:
        om.generate(ids[0].tolist(), max_new_tokens=4)  # loads every expert once
        plains, offs = [], []
        for _ in range(repeats):
            plains.append(plain())
            start = time.perf_counter()
            om.generate(ids[0].tolist(), max_new_tokens=tokens, cold=False)
            offs.append(time.perf_counter() - start)
    p, o = statistics.median(plains), statistics.median(offs)
    return {"plain_s": p, "runtime_s": o, "speed_ratio": p / o}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", default="200MB", help="emulated link, bytes/s")
    parser.add_argument("--latency", type=float, default=0.0, help="emulated link latency, s")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--capacities", default="25%,50%,75%")
    parser.add_argument("--tiers", default="emulated,disk")
    parser.add_argument("--extra", action="append", default=[], help="another predictor")
    parser.add_argument("--repeats", type=int, default=5, help="resident comparison repeats")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, interleaved, and report "
                             "the median of each figure (tok/s varies run to run)")
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    store, tables = shipped(args.threads)
    systems = dict(OFFLOAD_SYSTEMS)
    for name in args.extra:
        systems[name] = (name, "lru")
    report: dict[str, Any] = {"bandwidth": args.bandwidth, "latency": args.latency,
                              "tokens": args.tokens, "threads": args.threads,
                              "prompts": list(PROMPTS), "tiers": {}}
    print(f"torch threads {args.threads}; {len(PROMPTS)} prompts x {args.tokens} new tokens")
    for tier in args.tiers.split(","):
        label = f"EMULATED link {args.bandwidth}/s" if tier == "emulated" else "disk (O_DIRECT)"
        print(f"\n== tier: {label}")
        print(f"{'capacity':>8} {'system':<12} {'tok/s':>7} {'stall':>6} {'hit':>6} {'recall':>6} "
              f"{'prec':>6} {'moved MB':>9} {'wasted MB':>9} {'ampl':>5}")
        rows: dict[str, dict[str, Any]] = {}
        for cap in args.capacities.split(","):
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
            for _ in range(args.rounds):  # interleaved, so drift hits every system alike
                for name, (predictor, policy) in systems.items():
                    with offload(SHIPPED_MODEL, store, capacity=cap,
                                 predictor=compared_predictor(predictor, tables),
                                 policy=policy, tier=tier, bandwidth=args.bandwidth,
                                 latency=args.latency) as om:
                        runs[name].append(run_system(om, args.tokens))
            rows[cap] = {name: median_run(r) for name, r in runs.items()}
            for name, r in rows[cap].items():
                spread = ""
                if args.rounds > 1:
                    speeds = [x["decode_tokens_per_s"] for x in runs[name]]
                    spread = f"  (tok/s {min(speeds):.1f}-{max(speeds):.1f})"
                print(f"{cap:>8} {name:<12} {r['decode_tokens_per_s']:7.1f} "
                      f"{r['stall_share']:6.1%} {r['hit_rate']:6.3f} {r['prefetch_recall']:6.3f} "
                      f"{r['prefetch_precision']:6.3f} {r['bytes_moved'] / 1e6:9.1f} "
                      f"{r['bytes_wasted'] / 1e6:9.1f} {r['read_amplification']:5.2f}"
                      f"{spread}")
            same = all(x["tokens"] == rows[cap]["on-demand"]["tokens"]
                       for r in runs.values() for x in r)
            print(f"{'':>8} every system generated the same tokens: {same}")
            assert same, "lossless violated"
        report["tiers"][tier] = rows
        if "50%" in rows:
            half = rows["50%"]
            st, od, orc = half["stmoe"], half["on-demand"], half["oracle"]
            for better in ("stmoe-plus", "hybrid"):
                if better in half:
                    speed = half[better]["decode_tokens_per_s"]
                    print(f"   at 50%: {better} / stmoe = "
                          f"{speed / st['decode_tokens_per_s']:.2f}x, {better} time / oracle "
                          f"time = {orc['decode_tokens_per_s'] / speed:.2f}")
            checks = {
                "on-demand stall share >= 0.5": od["stall_share"] >= 0.5,
                "stmoe >= 1.5x on-demand": st["decode_tokens_per_s"]
                >= 1.5 * od["decode_tokens_per_s"],
                "stmoe decode time <= 1.25x oracle": orc["decode_tokens_per_s"]
                <= 1.25 * st["decode_tokens_per_s"],
            }
            print(f"   at 50%: stmoe / on-demand = "
                  f"{st['decode_tokens_per_s'] / od['decode_tokens_per_s']:.2f}x, "
                  f"stmoe / lru-only = "
                  f"{st['decode_tokens_per_s'] / half['lru-only']['decode_tokens_per_s']:.2f}x, "
                  f"stmoe time / oracle time = "
                  f"{orc['decode_tokens_per_s'] / st['decode_tokens_per_s']:.2f}")
            for what, ok in checks.items():
                print(f"   {'MET    ' if ok else 'NOT MET'} {what}")
            report["tiers"][tier]["checks"] = checks
    resident = resident_ratio(args.tokens, args.repeats)
    report["resident"] = resident
    print(f"\n== every expert resident (warm cache), median of {args.repeats}: plain transformers "
          f"{resident['plain_s']:.3f} s, runtime {resident['runtime_s']:.3f} s -> runtime speed "
          f"{resident['speed_ratio']:.2f}x plain (target >= 0.9): "
          f"{'MET' if resident['speed_ratio'] >= 0.9 else 'NOT MET'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
