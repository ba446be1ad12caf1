"""The engine's own per-layer cost (issue 42, item 6): prefetch must not slow the compute.

On a GPU a layer's compute is tens of microseconds, so what the engine does per MoE layer
(the planner, the predictor, waking the workers, the cache's books) decides the speed.
Here, on stmoe's shipped model (real weights, small experts) behind an EMULATED link set
so that on-demand loading (no prefetch, the LRU cache: what ``stmoe generate --predictor
ondemand`` runs) stalls ``--stall`` of its decode, the systems run in interleaved rounds:

  on-demand   no prefetch, LRU cache (the baseline of the targets)
  no-reuse    no prefetch, no cache reuse (the field's plain on-demand)
  stmoe       ST-MoE prefetch (the shipped tables) into the LRU cache
  stmoe-plus  stmoe-plus prefetch (the same tables)
  oracle      prefetches exactly the experts the router will pick

Targets: the oracle >= 1.3x on-demand and stmoe >= 1.0x on-demand at that link; with every
expert cached (warm), the offloaded model >= 0.95x plain transformers. Every system's
tokens are checked equal (lossless). The prompts are not those the tables were profiled on.

    python benchmarks/bench_layer_path.py [--tokens 32] [--rounds 3] [--stall 0.55]
                                          [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_runtime import PROMPTS, shipped

from stmoe.evaluate.compare import spread, verdict
from stmoe.evaluate.systems import compared_predictor
from stmoe.hf.loading import load_model
from stmoe.models import SHIPPED_MODEL
from stmoe.runtime.api import offload

SYSTEMS = {"on-demand": ("ondemand", "lru"), "no-reuse": ("ondemand", "none"),
           "stmoe": ("stmoe", "lru"), "stmoe-plus": ("stmoe-plus", "lru"),
           "oracle": ("oracle", "lru")}


def load() -> float:
    return os.getloadavg()[0]


def stat(values: list[float]) -> dict[str, Any]:
    """Median, range and their ``median [min, max]`` text."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "text": spread(values)}


def decode(store: Path, tables: Any, system: str, bandwidth: float, tokens: int,
           capacity: str = "50%") -> dict[str, Any]:
    """One system over the prompts from a cold cache (one untimed warm-up first)."""
    predictor, policy = SYSTEMS[system]
    with offload(SHIPPED_MODEL, store, capacity=capacity, tier="emulated", bandwidth=bandwidth,
                 predictor=compared_predictor(predictor, tables), policy=policy) as om:
        om.generate(PROMPTS[0], max_new_tokens=4)  # compiles the predictor's kernels
        runs = [om.generate(p, max_new_tokens=tokens) for p in PROMPTS]
    decode_s = sum(r.decode_s for r in runs)
    stall = sum(r.stall_s for r in runs)
    return {"tok_s": sum(r.decode_tokens for r in runs) / decode_s,
            "stall_share": stall / decode_s, "busy_s": decode_s - stall, "decode_s": decode_s,
            "hit_rate": statistics.mean(r.hit_rate for r in runs),
            "tokens": [r.tokens for r in runs]}


def probe_bandwidth(store: Path, tables: Any, stall: float, tokens: int) -> float:
    """The link at which on-demand stalls ``stall`` of its decode: its stall time scales
    as 1/bandwidth and its busy time does not (two corrections from 100 MB/s)."""
    bandwidth = 100e6
    for _ in range(2):
        r = decode(store, tables, "on-demand", bandwidth, tokens)
        s = min(max(r["stall_share"], 0.01), 0.99)
        bandwidth *= (s / (1 - s)) * ((1 - stall) / stall)
        print(f"  probe: on-demand stalled {s:.2f} -> link {bandwidth / 1e6:.1f} MB/s",
              flush=True)
    return bandwidth


def resident_pair(store: Path, tokens: int, model: torch.nn.Module,
                  ids: torch.Tensor) -> tuple[float, float]:
    """Seconds to decode ``ids`` (the first prompt): plain transformers' ``model``, then the
    offloaded model with every expert cached and warm."""
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                       min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        plain = time.perf_counter() - start
    with offload(SHIPPED_MODEL, store, capacity="100%", predictor="ondemand") as om:
        om.generate(ids[0].tolist(), max_new_tokens=4)  # every expert loaded once
        start = time.perf_counter()
        om.generate(ids[0].tolist(), max_new_tokens=tokens, cold=False)
        offloaded = time.perf_counter() - start
    return plain, offloaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--stall", type=float, default=0.55,
                        help="on-demand's stall share the link is set for")
    parser.add_argument("--bandwidth", type=float, help="the link in bytes/s (skips the probe)")
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    store, tables = shipped(args.threads)
    start_load = load()
    print(f"load at start {start_load:.2f}; torch threads {args.threads}; {len(PROMPTS)} prompts "
          f"x {args.tokens} new tokens; capacity 50%; EMULATED link", flush=True)
    bandwidth = args.bandwidth or probe_bandwidth(store, tables, args.stall, args.tokens)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    resident: list[tuple[float, float]] = []
    model, tok = load_model(SHIPPED_MODEL)  # plain transformers, loaded once
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    for i in range(args.rounds):  # interleaved: drift hits every system alike
        for name in SYSTEMS:
            runs[name].append(decode(store, tables, name, bandwidth, args.tokens))
        resident.append(resident_pair(store, args.tokens, model, ids))
        print(f"  round {i + 1}: " + ", ".join(f"{n} {r[-1]['tok_s']:.1f}"
                                               for n, r in runs.items()) + " tok/s", flush=True)
    same = all(r["tokens"] == runs["on-demand"][0]["tokens"] for rs in runs.values() for r in rs)
    assert same, "lossless violated: the systems generated different tokens"
    print(f"\nlink {bandwidth / 1e6:.1f} MB/s; every system generated the same tokens")
    print(f"{'system':<11} {'tok/s':>22} {'stall':>6} {'busy s':>7} {'hit':>6}")
    table: dict[str, Any] = {}
    for name, rs in runs.items():
        tok_s = stat([r["tok_s"] for r in rs])
        med = {k: statistics.median(r[k] for r in rs) for k in ("stall_share", "busy_s",
                                                                 "hit_rate")}
        table[name] = {"tok_s": tok_s, **med}
        print(f"{name:<11} {tok_s['text']:>22} {med['stall_share']:6.1%} {med['busy_s']:7.2f} "
              f"{med['hit_rate']:6.3f}")
    base = [r["tok_s"] for r in runs["on-demand"]]
    ratios = {name: stat([r["tok_s"] / b for r, b in zip(rs, base, strict=True)])
              for name, rs in runs.items()}
    res = stat([p / o for p, o in resident])
    targets = [("oracle >= 1.3x on-demand", ratios["oracle"], 1.3),
               ("stmoe >= 1.0x on-demand", ratios["stmoe"], 1.0),
               ("every expert cached >= 0.95x plain transformers", res, 0.95)]
    print()
    for name in ("no-reuse", "stmoe", "stmoe-plus", "oracle"):
        print(f"{name} / on-demand: {ratios[name]['text']}")
    print(f"every expert cached / plain transformers: {res['text']} (per-round pairs)")
    for what, r, goal in targets:
        print(f"{verdict(r['median'] >= goal):<7} {what} (median {r['median']:.2f})")
    end_load = load()
    print(f"load at start {start_load:.2f}, at end {end_load:.2f}"
          + ("  (above 3: redo)" if max(start_load, end_load) > 3 else ""))
    if args.json:
        args.json.write_text(json.dumps({
            "bandwidth": bandwidth, "tokens": args.tokens, "rounds": args.rounds,
            "threads": args.threads, "load": [start_load, end_load], "systems": table,
            "ratios": ratios, "resident_ratio": res,
            "targets": [{"name": w, "met": r["median"] >= g, "value": r["median"], "goal": g}
                        for w, r, g in targets]}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
