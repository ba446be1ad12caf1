"""torch's compute threads against the prefetch workers on this 2-core machine (issue 28, item 3).

The same checkpoint and routing as ``bench_in_place.py`` (Qwen1.5-MoE's shape, 4 layers,
bf16 experts of 16.5 MiB, RANDOM weights; REAL routing of one ``../shared/traces/qwen15``
prompt, tables HELD-OUT), its packed store on the disk tier, in interleaved rounds:
stmoe-plus at 50% cached and every expert cached (100%: compute alone), each with
``--threads 1`` and ``--threads 2`` (torch's intra-op threads; the 2 prefetch workers are
threads of their own). Prints each ratio 2 threads / 1 thread and which default the
runtime should keep: the one that is not slower (ranges apart) in both settings.

    python benchmarks/bench_threads.py [--rounds 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bigger_than_ram import traces
from bench_in_place import decode_run, prepare

from stmoe.evaluate.compare import against, rotated, spread

SETTINGS = {"50% cached": "50%", "all cached": "100%"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    load = [os.getloadavg()[0]]
    print(f"load at start {load[0]:.2f}; RANDOM weights, real sizes; routing REAL, tables "
          f"HELD-OUT; {os.cpu_count()} cores", flush=True)
    ckpt, packed, _ = prepare()
    found = traces()
    prompts = list(found)
    runs: dict[tuple[str, int], list[float]] = {}
    combos = [(s, t) for s in SETTINGS for t in (1, 2)]
    for rnd in range(args.rounds):
        replayed = prompts[rnd % len(prompts)]
        for setting, threads in rotated(combos, rnd):
            r = decode_run(ckpt, packed, "stmoe-plus", replayed, found, args.tokens,
                           ("--threads", str(threads)), SETTINGS[setting])
            runs.setdefault((setting, threads), []).append(r["tokens_per_s"])
            print(f"  round {rnd + 1} {setting:10s} --threads {threads}: "
                  f"{r['tokens_per_s']:.2f} tok/s (hit {r['hit_rate']:.2f})", flush=True)
    load.append(os.getloadavg()[0])
    print("\nstmoe-plus decode tok/s, disk:")
    for setting in SETTINGS:
        one, two = runs[(setting, 1)], runs[(setting, 2)]
        per = [b / a for a, b in zip(one, two, strict=True)]
        print(f"  {setting:10s} 1 thread {spread(one)}  2 threads {spread(two)}  "
              f"2/1 {spread(per)} per round ({against(two, one)})")
    print(f"\nload at start {load[0]:.2f}, at end {load[1]:.2f}"
          + ("  (ABOVE 3: redo)" if max(load) > 3 else ""))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print("faster per setting: " + ", ".join(
        f"{s}: {1 if med[(s, 1)] >= med[(s, 2)] else 2} thread(s)" for s in SETTINGS))


if __name__ == "__main__":
    main()
