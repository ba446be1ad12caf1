"""Issue 27's matrix: every system against LRU-only on routing its tables never saw.

Configurations (each a checkpoint of a real model's shape with RANDOM weights,
driven by routing recorded from that model; built once in ``STMOE_BENCH_DIR``
by bench_offload_real.py):

* ``q15-first4``, ``q15-mid8``: Qwen1.5-MoE-A2.7B (60 experts of 16.5 MiB, top-4),
  its MoE layers 0..3 and 8..15, replaying the three prompts of
  ``../shared/traces/qwen15`` in rotation: round r replays prompt r with tables
  profiled on the other two (``stmoe import`` makes the npz files, into
  ``STMOE_BENCH_DIR``);
* ``q36-first8``: Qwen3.6-35B-A3B (256 experts of 6 MiB, top-8), its first 8 MoE
  layers, the shared sample split by tokens: tables profiled on its prompt and
  first 64 decode tokens, the rest replayed (every round the same);

on the disk tier and the emulated one (host memory behind a link, EMULATED) at two
bandwidths, at 25%, 50% and 75% of each layer's experts cached. In each round
every system runs once, in its own process (bench_offload_real.py ``--one``), in
a rotated order. Per configuration it prints each system's median decode speed
with its range, the median of the per-round ratios to LRU-only (a round's
systems replay the same prompt) with their range, and the targets:

* stmoe and stmoe-plus >= 1.0x LRU-only: MET when the median ratio is >= 1.0,
  MET (noise) when it is below but the per-round ratios' range reaches 1.0;
* where the oracle is >= 20% faster than LRU-only: the best predictor closes
  >= 50% of the decode-time gap (the median of the rounds' shares); the share of
  the stall alone is printed beside.

    python benchmarks/bench_heldout.py [--configs q15-first4:disk:50%,...] [--tokens 32]
                                       [--rounds 3] [--json out.json]

``--list`` prints every configuration's name. The JSON is rewritten after every
configuration, so a long run that is stopped keeps what it measured.
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

import bench_offload_real as real

from stmoe.evaluate.compare import closed, rotated, spread, verdict

QWEN15 = real.SHARED / "qwen15"
PROMPTS = ("history_1", "cooking_1", "ml_moe_1")
SYSTEMS = ("lru-only", "stmoe", "stmoe-plus", "oracle")
PREDICTING = ("stmoe", "stmoe-plus")
CUTS = {  # name: (model preset, --layers)
    "q15-first4": ("qwen1.5-moe-a2.7b", "4"),
    "q15-mid8": ("qwen1.5-moe-a2.7b", "8:16"),
    "q36-first8": ("qwen3.6-35b-a3b", "8"),
}
TIERS = {"disk": None, "emu-0.5GB": "0.5GB", "emu-2GB": "2GB"}  # name: emulated bandwidth
SPLIT_AT, SPLIT_PROMPT = 36 + 64, 8  # the sample: 36 prompt tokens, then 128 decode


def all_configs() -> list[str]:
    """Every configuration, most telling first (a stopped run keeps those)."""
    order = []
    for cap in ("50%", "25%", "75%"):
        for cut in CUTS:
            order.append(f"{cut}:disk:{cap}")
        if cap == "50%":
            order += [f"q15-first4:{t}:50%" for t in TIERS if t != "disk"]
    order += [f"q15-mid8:{t}:50%" for t in TIERS if t != "disk"]
    return order


def imported(name: str) -> Path:
    """``stmoe import`` of a Qwen1.5 prompt's nested JSON, made once."""
    out = real.bench_dir() / f"qwen15-{name}.npz"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "stmoe", "import",
                        str(QWEN15 / f"{name}.routes.json"), "-o", str(out)], check=True,
                       capture_output=True)
    return out


def round_args(config: str, rnd: int, a: argparse.Namespace) -> argparse.Namespace:
    """bench_offload_real.py's arguments for round ``rnd`` of ``config``."""
    cut, tier, capacity = config.split(":")
    like, layers = CUTS[cut]
    args = argparse.Namespace(
        like=like, layers=layers, tokens=a.tokens, capacity=capacity, threads=1, budget=0,
        bandwidth=TIERS[tier] or "1GB", drop_pages=False, profile_on="", split_at=0,
        in_sample=False,
        split_prompt=SPLIT_PROMPT, tier="emulated" if TIERS[tier] else "disk")
    if like == "qwen3.6-35b-a3b":
        args.trace, args.split_at = real.SAMPLE, SPLIT_AT
    else:
        replayed = PROMPTS[rnd % len(PROMPTS)]
        args.trace = imported(replayed)
        args.profile_on = ",".join(str(imported(p)) for p in PROMPTS if p != replayed)
    real.set_layers(args)
    return args


def run_config(config: str, a: argparse.Namespace) -> dict[str, Any]:
    """Every system in ``a.rounds`` interleaved rounds; per-round ratios; the targets."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in (*SYSTEMS, *a.also)}
    replayed = []
    for rnd in range(a.rounds):
        args = round_args(config, rnd, a)
        real.prepare(args)  # checkpoint, store and tables, built once
        replayed.append(Path(args.trace).stem + (f"@{args.split_at}" if args.split_at else ""))
        for system in rotated(list(runs), rnd):
            runs[system].append(real.spawn(args, system, args.tier))
            print(f"[{config} round {rnd + 1}: {replayed[-1]}] {system}: "
                  f"{runs[system][-1]['decode_tokens_per_s']:.2f} tok/s", flush=True)
    return judge(config, runs, replayed)


def judge(config: str, runs: dict[str, list[dict[str, Any]]],
          replayed: list[str]) -> dict[str, Any]:
    """Medians, per-round ratios to lru-only, the gap closed and the verdicts (printed)."""
    n = len(runs["lru-only"])
    speed = {s: [r["decode_tokens_per_s"] for r in rs] for s, rs in runs.items()}
    ratio = {s: [speed[s][i] / speed["lru-only"][i] for i in range(n)] for s in runs}
    stall = {s: [r["stall_share"] / r["decode_tokens_per_s"] for r in rs]  # s per token
             for s, rs in runs.items()}
    best = max(PREDICTING, key=lambda s: statistics.median(ratio[s]))
    gaps = [closed(1 / speed["lru-only"][i], 1 / speed[best][i], 1 / speed["oracle"][i])
            for i in range(n)]
    stall_gaps = [closed(stall["lru-only"][i], stall[best][i], stall["oracle"][i])
                  for i in range(n)]
    print(f"\n## {config}: replayed {', '.join(replayed)} (HELD-OUT; random weights)")
    print(f"{'system':11} {'decode tok/s':>22} {'x lru-only (per round)':>28} {'hit':>6} "
          f"{'stall':>6} {'moved GiB':>10} {'wasted':>7}")
    for s, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("hit_rate", "stall_share",
                                                                "bytes_moved", "bytes_wasted")}
        print(f"{s:11} {spread(speed[s]):>22} {spread(ratio[s]):>28} {med['hit_rate']:6.3f} "
              f"{med['stall_share']:6.2f} {med['bytes_moved'] / 2**30:10.2f} "
              f"{med['bytes_wasted'] / max(1, med['bytes_moved']):7.1%}")
    targets: dict[str, str] = {}
    for s in PREDICTING:
        m = statistics.median(ratio[s])
        ok = "MET" if m >= 1.0 else "MET (noise)" if max(ratio[s]) >= 1.0 else "NOT MET"
        targets[f"{s} >= 1.0x lru-only"] = ok
    oracle = statistics.median(ratio["oracle"])
    if oracle >= 1.2:
        targets[f"best ({best}) closes >= 50% of the gap to the oracle"] = verdict(
            statistics.median(gaps) >= 0.5)
    print(f"oracle {oracle:.2f}x lru-only; {best} closes {statistics.median(gaps):.0%} of the "
          f"gap (per round {', '.join(f'{g:.0%}' for g in gaps)}; of the stall alone "
          f"{statistics.median(stall_gaps):.0%})")
    for name, v in targets.items():
        print(f"  {v:11} {name}")
    for s in [s for s in runs if s not in SYSTEMS]:  # an A/B run beside (--also)
        base = s.removesuffix("-all").removesuffix("-score").removesuffix("-split")
        if base in runs:
            ab = [speed[base][i] / speed[s][i] for i in range(n)]
            print(f"  {base} / {s}: {spread(ab)}x per round")
    return {"runs": runs, "replayed": replayed, "ratio": ratio, "best": best,
            "gap_closed": gaps, "stall_gap_closed": stall_gaps, "targets": targets}


def summary(results: dict[str, dict[str, Any]]) -> None:
    """One line per configuration: the ratios' medians and the verdicts."""
    print("\n## the matrix (median of per-round ratios to lru-only; HELD-OUT)")
    print(f"{'configuration':24} {'lru tok/s':>9} {'stmoe':>6} {'plus':>6} {'oracle':>7} "
          f"{'closed':>7} {'stall':>6}  verdicts (stmoe, plus, gap)")
    for config, r in results.items():
        med = {s: statistics.median(v) for s, v in r["ratio"].items()}
        lru = statistics.median(x["decode_tokens_per_s"] for x in r["runs"]["lru-only"])
        verdicts = ", ".join(r["targets"].values())
        print(f"{config:24} {lru:9.2f} {med['stmoe']:6.2f} {med['stmoe-plus']:6.2f} "
              f"{med['oracle']:7.2f} {statistics.median(r['gap_closed']):7.0%} "
              f"{statistics.median(r['stall_gap_closed']):6.0%}  {verdicts}")


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="",
                    help="comma-separated CUT:TIER:CAPACITY (default: every one, --list)")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per replay")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds (Qwen1.5: one prompt replayed per round)")
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    ap.add_argument("--also", default="", help="comma-separated systems of "
                    "bench_offload_real.py run beside, e.g. stmoe-plus-all (admission off: "
                    "every predicted load), stmoe-plus-score (score eviction) or stmoe-plus-split "
                    "(each layer's cache sized from the other prompts' curves); each one's "
                    "base system / it is printed")
    a = ap.parse_args()
    a.also = [s for s in a.also.split(",") if s]
    unknown = [s for s in a.also if s not in real.SYSTEMS or s in SYSTEMS]
    if unknown:
        raise SystemExit(f"--also {','.join(unknown)}: expected systems of "
                         f"bench_offload_real.py not already run: "
                         f"{', '.join(s for s in real.SYSTEMS if s not in SYSTEMS)}")
    if a.list:
        print("\n".join(all_configs()))
        return
    configs = a.configs.split(",") if a.configs else all_configs()
    for c in configs:
        parts = c.split(":")
        if len(parts) != 3 or parts[0] not in CUTS or parts[1] not in TIERS:
            raise SystemExit(f"--configs {c!r}: expected CUT:TIER:CAPACITY with CUT one of "
                             f"{', '.join(CUTS)} and TIER one of {', '.join(TIERS)}")
    results: dict[str, dict[str, Any]] = {}
    started = {"at": time.strftime("%Y-%m-%d %H:%M:%S"), "load": load()}
    print(f"started {started['at']}, load {started['load']}", flush=True)
    for config in configs:
        results[config] = run_config(config, a)
        results[config]["load_after"] = load()
        if a.json:
            a.json.write_text(json.dumps({"started": started, "tokens": a.tokens,
                                          "configs": results}, indent=1, default=str) + "\n")
    summary(results)
    print(f"ended {time.strftime('%Y-%m-%d %H:%M:%S')}, load {load()}")


if __name__ == "__main__":
    main()
