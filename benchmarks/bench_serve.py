"""Issue 29's benchmark: does batching dilute prediction? Total and per-request decode
speed against the number of concurrent requests, for every system.

A checkpoint of Qwen1.5-MoE-A2.7B's shape (its first 4 MoE layers: 60 experts of 16.5
MiB, top-4) with RANDOM weights, the disk tier, 50% of each layer's experts cached.
Each request replays a window of REAL Qwen1.5-MoE routing (``../shared/traces/qwen15``):
round r replays windows of prompt r (each request another window, so the batch's union
is real) with tables profiled on the other two prompts (HELD-OUT). The requests run
through the server's step batcher (``runtime.batcher``: all submitted at once, their
experts loaded once per step), 1, 2, 4 and 8 of them, every system in its own process,
the systems' order rotated per round.

Per (system, batch size): total decode throughput (every request's decode tokens over
the time of the decode steps; over the wall time with the prompts too beside it), the
mean per-request decode speed (first token to last, prompts of others included), hit rate,
stall share, bytes read per token, prefetch recall and bytes wasted; the figure
docs/figures/serve_batch.png; and the targets (MET / NOT MET):

* stmoe-plus at 4 concurrent requests >= 2x its own single request's total throughput;
* at every batch size, stmoe-plus's total throughput >= LRU-only's (median of the
  per-round ratios; within noise counts only when the rounds' range reaches 1.0).

``--capacity C`` and ``--warm`` (each batch run once untimed first, its cache kept: at
100% nothing is read, so the step's compute alone is measured) change the conditions;
the targets are judged at the defaults (50%, cold).

``--format int4|int8``: experts packed in that format (a store made once beside the
checkpoint) and the resident linears quantized the same way (``--quantize-resident``;
LOSSY, its quality in bench_quality.py): then the step batcher computes a step's rows
together, a decode step as one batched forward where the model allows it
(runtime/batcher/step_forward.py), and ``stmoe-plus (own forwards)`` runs beside the other systems
with each request's own forward, its quantized linears gathered (runtime/batcher/step_rows.py):
the A/B of the batched forward. ``X (rows alone)`` is X with neither, each request's rows
computed alone as in bf16 (the A/B of the gathering). In any format, ``X (lfu)`` is X
with the lfu cache policy (fewest steps used, then least recent) in place of lru: a step's
union keeps the experts several requests share, which lru does not tell apart.

    python benchmarks/bench_serve.py [--batches 1,2,4,8] [--tokens 12] [--rounds 2]
                                     [--format native|int8|int4] [--json out.json]
                                     [--figure docs/figures/serve_batch.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_heldout as heldout
import bench_offload_real as real
import numpy as np

from stmoe.evaluate.compare import rotated

SYSTEMS = ("lru-only", "stmoe", "stmoe-plus", "oracle")
FIGURE = Path("docs/figures/serve_batch.png")
ALONE = " (rows alone)"  # quantized formats: the system with the step's rows not computed together
OWN = " (own forwards)"  # quantized formats: each request's own forward, its linears gathered
MODES = {ALONE: {"share_rows": False}, OWN: {"batched": False}}  # a suffix's StepBatcher options
LFU = " (lfu)"  # any format: the system with the lfu cache policy in place of lru


def split_system(system: str) -> tuple[str, dict[str, bool]]:
    """(the compared system, the StepBatcher options its suffix names)."""
    for suffix, options in MODES.items():
        if system.endswith(suffix):
            return system.removesuffix(suffix), options
    return system, {}


def policy_of(system: str) -> tuple[str, str | None]:
    """(the system without its ' (lfu)' suffix, the cache policy that suffix names or None)."""
    return (system.removesuffix(LFU), "lfu") if system.endswith(LFU) else (system, None)
WINDOW_PROMPT = 8  # each window's prompt: the 8 routed tokens before it (already profiled)


def round_args(rnd: int, a: argparse.Namespace) -> argparse.Namespace:
    """bench_offload_real's arguments for round ``rnd``: prompt ``rnd`` replayed, tables of
    the other two (bench_heldout's q15-first4 rotation)."""
    args = heldout.round_args("q15-first4:disk:50%", rnd, a)
    args.format, args.capacity, args.warm = a.format, a.capacity, a.warm
    return args


def windows(args: argparse.Namespace, count: int, tokens: int, config: Any) -> list[Any]:
    """``count`` replay plans of ``tokens`` new tokens each, from disjoint windows of the
    replayed prompt's decode part."""
    from stmoe.runtime.forced_routing import plan_routing
    from stmoe.sim.specs import model_preset
    from stmoe.trace import load_trace
    from stmoe.trace.select import held_out_tail, select_layers, select_sequences

    spec = model_preset(args.like)
    trace = select_sequences(select_layers(load_trace(args.trace), args.cut), [0])
    first = int(np.argmax(trace.is_decode)) + WINDOW_PROMPT
    plans = []
    for w in range(count):
        at = first + w * (tokens + 1)
        if at + tokens + 1 > trace.num_tokens:
            raise SystemExit(f"error: {args.trace}: {count} windows of {tokens} tokens do not "
                             f"fit its {trace.num_tokens} tokens; use fewer --tokens")
        tail = held_out_tail(trace, at, WINDOW_PROMPT)[1]
        plans.append(plan_routing(tail, 0, args.layers, spec.num_experts, spec.top_k,
                                  config.vocab_size))
    return plans


def run_one(args: argparse.Namespace, system: str, batches: list[int]) -> dict[str, Any]:
    """This process: ``system`` at every batch size, each from an empty cache."""
    import torch

    from stmoe.runtime.api import offload
    from stmoe.runtime.batcher import StepBatcher, replay_request

    torch.set_num_threads(1)
    model, store, tables = real.prepare(args)
    quantized = args.format != "native"
    fmt = {"format": args.format, "quantize_resident": args.format} if quantized else {}
    if quantized:  # its own store: packed on first use (main does it, untimed), then reused
        store = None
    named, policy_override = policy_of(system)
    base, mode = split_system(named)
    predictor, policy = real.SYSTEMS[base]
    policy = policy_override or policy
    pred, takes = real.compared(predictor, tables)
    out: dict[str, Any] = {}
    with offload(model, store, capacity=args.capacity, predictor=pred, policy=policy, tier="disk",
                 tables=takes, **fmt) as om:
        plans = windows(args, max(batches), args.tokens, om.model.config)
        for b in batches:
            if args.warm:  # once untimed: the step's experts then all cached (capacity 100%)
                warm = StepBatcher(om, max_batch=b, max_queue=0)
                try:
                    [warm.submit(replay_request(p, args.tokens)).wait(3600) for p in plans[:b]]
                finally:
                    warm.close()
            batcher = StepBatcher(om, max_batch=b, max_queue=0, cold=not args.warm, **mode)
            try:
                start = time.perf_counter()
                reqs = [batcher.submit(replay_request(p, args.tokens)) for p in plans[:b]]
                for r in reqs:
                    r.wait(3600)
                wall = time.perf_counter() - start
            finally:
                batcher.close()
            log = list(batcher.step_log)
            ends = [t for t, _, _ in log[1:]] + [start + wall]
            decode_s = sum(e - t for (t, prompt, _), e in zip(log, ends, strict=True)
                           if not prompt)
            decode = om.engine.run.stats.phases["decode"].summary()
            moved = om.engine.run.stats.bytes_moved
            tokens = sum(len(r.output) - 1 for r in reqs)
            stall = decode["stall_s"]
            out[str(b)] = {
                "total_tok_s": tokens / decode_s,  # over the decode steps' time
                "wall_tok_s": tokens / wall,  # over the batch's wall time, prompts included
                "per_request_tok_s": statistics.mean((len(r.output) - 1) / r.decode_s()
                                                     for r in reqs),
                "hit_rate": decode["hit_rate"], "prefetch_recall": decode["prefetch_recall"],
                "stall_share": stall / decode_s, "bytes_per_token": moved / max(tokens, 1),
                "bytes_wasted": om.engine.run.stats.bytes_wasted, "wall_s": wall,
                "mean_batch": statistics.mean(batcher.decode_sizes() or [0]),
                "rows_together": batcher.share_rows, "batched_forward": batcher.batched,
                "batched_steps": batcher.step_forward.steps, "weights": om.config["weights_label"],
                "resident_weights": om.config["resident_weights"],
            }
    return out


def spawn(args: argparse.Namespace, system: str, batches: list[int]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", system, "--round", str(args.rnd), "--tokens",
           str(args.tokens), "--batches", ",".join(map(str, batches)), "--format", args.format,
           "--capacity", args.capacity] + (["--warm"] if args.warm else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{system} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def judge(runs: dict[str, list[dict[str, Any]]], batches: list[int]) -> dict[str, Any]:
    def med(system: str, b: int, key: str) -> float:
        return statistics.median(r[str(b)][key] for r in runs[system])

    print("\nsystem                   batch  total tok/s  with prompts  per-request  hit   "
          "recall  stall  MB/token")
    for system in runs:
        for b in batches:
            print(f"{system:<24} {b:>5}  {med(system, b, 'total_tok_s'):>10.2f}  "
                  f"{med(system, b, 'wall_tok_s'):>12.2f}  "
                  f"{med(system, b, 'per_request_tok_s'):>11.2f}  "
                  f"{med(system, b, 'hit_rate'):.3f} {med(system, b, 'prefetch_recall'):.3f}  "
                  f"{med(system, b, 'stall_share'):.2f}  "
                  f"{med(system, b, 'bytes_per_token') / 2**20:>8.1f}")
    targets: dict[str, Any] = {}
    for suffix, (key, what) in {ALONE: ("together_vs_alone", "rows together / alone"),
                                OWN: ("batched_vs_own", "one batched forward / own forwards"),
                                LFU: ("lfu_vs_lru", "cache policy lfu / lru"),
                                }.items():  # the A/Bs: the gathering, the batched forward, lfu
        for system in [s for s in runs if s + suffix in runs]:
            for b in batches:
                ratios = [p[str(b)]["total_tok_s"] / q[str(b)]["total_tok_s"]
                          for p, q in zip(runs[system], runs[system + suffix], strict=True)]
                if suffix == LFU:  # said as the candidate against the shipped policy
                    ratios = [1 / r for r in ratios]
                targets[f"{system}_{key}_{b}"] = ratios
                print(f"{system}, {what} at {b}: {statistics.median(ratios):.2f}x "
                      f"[{min(ratios):.2f}, {max(ratios):.2f}]")
    if "stmoe-plus" not in runs or "lru-only" not in runs:
        return targets
    if 1 in batches and 4 in batches:
        ratios = [r["4"]["total_tok_s"] / r["1"]["total_tok_s"] for r in runs["stmoe-plus"]]
        m = statistics.median(ratios)
        targets["plus_4_vs_1"] = {"ratio": m, "range": [min(ratios), max(ratios)],
                                  "met": m >= 2.0}
        print(f"\nstmoe-plus, 4 requests vs 1: {m:.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] "
              f"(target >= 2x): {'MET' if m >= 2.0 else 'NOT MET'}")
    for b in batches:
        ratios = [p[str(b)]["total_tok_s"] / q[str(b)]["total_tok_s"]
                  for p, q in zip(runs["stmoe-plus"], runs["lru-only"], strict=True)]
        m = statistics.median(ratios)
        verdict = "MET" if m >= 1.0 else "MET (noise)" if max(ratios) >= 1.0 else "NOT MET"
        targets[f"plus_vs_lru_{b}"] = {"ratio": m, "range": [min(ratios), max(ratios)],
                                       "verdict": verdict}
        print(f"stmoe-plus vs lru-only at {b}: {m:.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] "
              f"(target >= 1.0x): {verdict}")
    return targets


def figure(runs: dict[str, list[dict[str, Any]]], batches: list[int], path: Path,
           weights: str = "native") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for system in runs:
        total = [statistics.median(r[str(n)]["total_tok_s"] for r in runs[system])
                 for n in batches]
        lo = [min(r[str(n)]["total_tok_s"] for r in runs[system]) for n in batches]
        hi = [max(r[str(n)]["total_tok_s"] for r in runs[system]) for n in batches]
        a.errorbar(batches, total, yerr=[[t - x for t, x in zip(total, lo, strict=True)],
                                         [x - t for t, x in zip(total, hi, strict=True)]],
                   marker="o", capsize=3, label=system)
        b.plot(batches, [statistics.median(r[str(n)]["hit_rate"] for r in runs[system])
                         for n in batches], marker="o", label=system)
    a.set(xlabel="concurrent requests", ylabel="total decode tok/s (median, range)",
          xscale="log", xticks=batches, xticklabels=batches)
    b.set(xlabel="concurrent requests", ylabel="decode hit rate", xscale="log",
          xticks=batches, xticklabels=batches)
    for ax in (a, b):
        ax.minorticks_off()
    a.legend()
    fig.suptitle("Qwen1.5-MoE shape (4 layers, RANDOM weights), held-out real routing, "
                 f"disk, {weights}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--figure", type=Path, default=FIGURE,
                   help="(with --format int4|int8: serve_batch_FORMAT.png beside it)")
    p.add_argument("--replot", type=Path, help="Print the table and draw the figure again "
                   "from a --json this script wrote (nothing is run).")
    p.add_argument("--format", default="native", choices=["native", "int8", "int4"],
                   help="the experts' and resident linears' weights (quantized: LOSSY; "
                   "their rows computed together in a step)")
    p.add_argument("--capacity", default="50%", help="each layer's experts cached")
    p.add_argument("--warm", action="store_true",
                   help="run each batch once untimed first and keep the cache (with "
                   "--capacity 100%%: no reads, the compute alone)")
    p.add_argument("--systems", default="", help="comma-separated, instead of every system; "
                   f"with --format int4|int8 a name + '{OWN}' runs it with each request's "
                   f"own forward (linears gathered), + '{ALONE}' with each request's rows "
                   f"computed alone; in any format + '{LFU}' with the lfu cache policy")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    a.rounds_total = a.rounds
    if a.replot:
        saved = json.loads(a.replot.read_text())
        print("load:", *saved["load"], sep="\n  ")
        judge(saved["runs"], saved["batches"])
        figure(saved["runs"], saved["batches"], a.figure, saved.get(
            "conditions", f"50% cached, weights {saved.get('format', 'native')}"))
        return
    if a.one:
        args = round_args(a.round, a)
        print(json.dumps(run_one(args, a.one, batches)))
        return
    load = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    print("load at start:", load[0], flush=True)
    systems = [*SYSTEMS, "stmoe-plus" + OWN] if a.format != "native" else list(SYSTEMS)
    if a.systems:
        systems = a.systems.split(",")
        unknown = [s for s in systems if split_system(policy_of(s)[0])[0] not in SYSTEMS]
        if unknown or (a.format == "native"
                       and any(split_system(policy_of(s)[0])[1] for s in systems)):
            raise SystemExit(f"error: --systems {a.systems}: each of {', '.join(SYSTEMS)}, "
                             f"any of them + '{LFU}', and with --format int8|int4 any of them "
                             f"+ '{OWN}' or '{ALONE}'")
    if a.format != "native":
        if a.figure == FIGURE:
            a.figure = FIGURE.with_name(f"serve_batch_{a.format}.png")
        a.rnd = 0  # the store packed once, untimed
        spawn(argparse.Namespace(**{**vars(a), "tokens": 2}), "lru-only", [1])
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    print(f"weights: {a.format}" + (" (experts and resident linears; LOSSY)"
                                    if a.format != "native" else ""), flush=True)
    for rnd in range(a.rounds):
        args = round_args(rnd, a)
        real.prepare(args)
        a.rnd = rnd
        for system in rotated(systems, rnd):
            runs[system].append(spawn(a, system, batches))
            got = runs[system][-1]
            print(f"[round {rnd + 1}: {Path(args.trace).stem}] {system}: " + ", ".join(
                f"{b}: {got[str(b)]['total_tok_s']:.2f}" for b in batches) + " tok/s total",
                flush=True)
    load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print("load at end:", load[1])
    targets = judge(runs, batches)
    conditions = f"{a.capacity} cached{' (warm)' if a.warm else ''}, weights {a.format}"
    figure(runs, batches, a.figure, conditions)
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "targets": targets, "load": load,
                                      "tokens": a.tokens, "batches": batches,
                                      "format": a.format, "conditions": conditions},
                                     indent=1))


if __name__ == "__main__":
    main()
