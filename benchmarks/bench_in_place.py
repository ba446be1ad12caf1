"""Experts read in place from the checkpoint against the same experts packed (issue 28, item 4).

One checkpoint of Qwen1.5-MoE-A2.7B's MoE shape (``stmoe make-model --like
qwen1.5-moe-a2.7b --layers 4``: bf16 experts of 16.5 MiB, RANDOM weights), its experts
both packed (``stmoe pack``: a second copy, 3.9 GiB) and indexed in place (``stmoe pack
--in-place``: index.json alone). In interleaved rounds, on the disk tier:

- reads: the same random blocks read into slot memory, ``DiskTier`` (one O_DIRECT read
  straight into the slot) against ``InPlaceTier`` (aligned spans into a buffer, then a
  copy into the slot), median ms per expert and GB/s;
- decode: ``stmoe generate`` replaying the REAL routing of one of the three
  ``../shared/traces/qwen15`` prompts (its first 4 layers), tables profiled on the other
  two (HELD-OUT, rotated each round), 50% of the experts cached, lru-only and stmoe-plus,
  each from the packed store and in place.

Target: in place decodes at >= 0.9x the packed store's speed for both systems (no
second copy of the experts on disk).

    python benchmarks/bench_in_place.py [--rounds 3] [--tokens 48] [--json out.json]

Writes ~8 GB into STMOE_BENCH_DIR (default ~/.cache/stmoe/bench); ``--clean`` deletes it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bigger_than_ram import traces

from stmoe.evaluate.compare import against, rotated, spread, verdict
from stmoe.evaluate.systems import OFFLOAD_SYSTEMS

LIKE, LAYERS = "qwen1.5-moe-a2.7b", 4
SYSTEMS = ["lru-only", "stmoe-plus"]
TARGET = 0.9


def bench_dir() -> Path:
    return Path(os.environ.get("STMOE_BENCH_DIR", Path.home() / ".cache" / "stmoe" / "bench"))


def prepare() -> tuple[Path, Path, Path]:
    """The checkpoint, its packed store and its in-place index (each made once)."""
    base = bench_dir()
    ckpt = base / f"{LIKE}-L{LAYERS}"
    packed, in_place = base / f"{ckpt.name}.packed", base / f"{ckpt.name}.in-place"
    if not (ckpt / "config.json").is_file():
        if shutil.disk_usage(base.parent if not base.exists() else base).free < 10 * 10**9:
            raise SystemExit(f"error: {base} needs about 10 GB free")
        subprocess.run([sys.executable, "-m", "stmoe", "make-model", "--like", LIKE,
                        "--layers", str(LAYERS), "-o", str(ckpt)], check=True)
    for out, extra in ((packed, []), (in_place, ["--in-place"])):
        if not (out / "index.json").is_file():
            subprocess.run([sys.executable, "-m", "stmoe", "pack", str(ckpt), "-o", str(out),
                            *extra], check=True)
    return ckpt, packed, in_place


def read_rounds(ckpt: Path, stores: dict[str, Path], rounds: int, count: int) -> dict[str, Any]:
    """Per round and store, ``count`` random blocks (the same for both) into slot memory."""
    import numpy as np

    from stmoe.runtime.cache import param_specs
    from stmoe.runtime.store import ExpertStore
    from stmoe.runtime.store.loader import Loader
    from stmoe.runtime.store.reading import open_tier
    from stmoe.runtime.store.tiers import aligned_buffer, buffer_bytes

    opened = {k: ExpertStore(p) for k, p in stores.items()}
    for s in opened.values():
        s.check_source(ckpt)
    keys = sorted(opened["packed"].blocks)
    times: dict[str, list[float]] = {k: [] for k in stores}
    for rnd in range(rounds):
        picks = random.Random(rnd).sample(keys, count)
        for name in rotated(list(stores), rnd):
            store = opened[name]
            tier = open_tier("disk", store, None, 0.0)  # its pages dropped on opening
            block = store.blocks[picks[0]]
            buf = aligned_buffer(buffer_bytes(block))
            slot = np.frombuffer(aligned_buffer(buffer_bytes(block)), np.uint8)
            slot[:] = 0  # faulted in, as a cache slot is
            parts = {layer: [slot[p.offset : p.offset + p.nbytes]
                             for p in param_specs(store.blocks[(layer, 0)])]
                     for layer in {k[0] for k in picks}}
            loader = Loader(tier, store)
            start = time.perf_counter()
            for key in picks:
                loader.fill_parts(store.blocks[key], parts[key[0]], buf)
            times[name].append((time.perf_counter() - start) / count)
            tier.close()
    nbytes = opened["packed"].blocks[keys[0]].nbytes
    return {k: {"ms": [t * 1e3 for t in v], "gb_s": [nbytes / t / 1e9 for t in v]}
            for k, v in times.items()}


def tables(replayed: str, found: dict[str, Path]) -> Path:
    """Tables of the first LAYERS layers profiled on the two prompts not replayed (HELD-OUT)."""
    from stmoe.predictors import profile, save_tables
    from stmoe.trace import concat, load_trace
    from stmoe.trace.select import select_layers

    out = bench_dir() / f"qwen15-L{LAYERS}-not-{replayed}.tables.npz"
    if not out.is_file():
        save_tables(profile(concat([select_layers(load_trace(p), f"0:{LAYERS}")
                                    for n, p in found.items() if n != replayed])), out)
    return out


def decode_run(ckpt: Path, store: Path, system: str, replayed: str, found: dict[str, Path],
               tokens: int, extra: tuple[str, ...] = (), capacity: str = "50%") -> dict[str, Any]:
    """One ``stmoe generate`` replay in its own process (``extra``: more of its options)."""
    predictor, policy = OFFLOAD_SYSTEMS[system]
    cmd = [sys.executable, "-m", "stmoe", "generate", "--model", str(ckpt), "--store",
           str(store), "--routing", str(found[replayed]), "--layers", f"0:{LAYERS}",
           "--max-new-tokens", str(tokens), "--capacity", capacity, "--predictor", predictor,
           "--policy", policy, "--json", "-", *extra]
    if predictor in ("stmoe", "stmoe-plus"):
        cmd += ["--tables", str(tables(replayed, found))]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(cmd[:6])} failed: {done.stderr[-1500:]}")
    data = json.loads(done.stdout)
    return {"tokens_per_s": data["decode_tokens_per_s"], "hit_rate": data["hit_rate"],
            "in_place": data["config"]["in_place"], "stall_share": data["stall_share"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reads", type=int, default=40, help="blocks read per round and store")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--clean", action="store_true", help="delete what this wrote, and stop")
    args = ap.parse_args()
    if args.clean:
        for p in [*bench_dir().glob(f"{LIKE}-L{LAYERS}*"),
                  *bench_dir().glob(f"qwen15-L{LAYERS}-not-*")]:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return
    load = [os.getloadavg()[0]]
    print(f"load at start {load[0]:.2f}; RANDOM weights, real sizes; routing REAL, tables "
          "HELD-OUT", flush=True)
    ckpt, packed, in_place = prepare()
    stores = {"packed": packed, "in place": in_place}
    reads = read_rounds(ckpt, stores, args.rounds, args.reads)
    found = traces()
    prompts = list(found)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        replayed = prompts[rnd % len(prompts)]
        for system in rotated(SYSTEMS, rnd):
            for name in rotated(list(stores), rnd):
                r = decode_run(ckpt, stores[name], system, replayed, found, args.tokens)
                assert r["in_place"] == (name == "in place")
                runs.setdefault((system, name), []).append(r)
                print(f"  round {rnd + 1} {system:10s} {name:8s} {r['tokens_per_s']:.2f} tok/s "
                      f"(hit {r['hit_rate']:.2f}, replayed {replayed})", flush=True)
    load.append(os.getloadavg()[0])
    print(f"\nreads of one expert ({args.reads} per round, {args.rounds} rounds):")
    for name, r in reads.items():
        print(f"  {name:8s} {spread(r['ms'])} ms  {spread(r['gb_s'])} GB/s")
    ratio = [a / b for a, b in zip(reads["in place"]["ms"], reads["packed"]["ms"], strict=True)]
    print(f"  in place / packed read time per round: {spread(ratio)}")
    met = True
    print("\ndecode tok/s, 50% cached, disk:")
    for system in SYSTEMS:
        a = [r["tokens_per_s"] for r in runs[(system, "in place")]]
        b = [r["tokens_per_s"] for r in runs[(system, "packed")]]
        per = [x / y for x, y in zip(a, b, strict=True)]
        ok = statistics.median(per) >= TARGET
        met &= ok
        print(f"  {system:10s} packed {spread(b)}  in place {spread(a)}  ratio {spread(per)} "
              f"({against(a, b)})  >= {TARGET}x: {verdict(ok)}")
    print(f"\nload at start {load[0]:.2f}, at end {load[1]:.2f}"
          + ("  (ABOVE 3: redo)" if max(load) > 3 else ""))
    print(f"in place >= {TARGET}x packed decode: {verdict(met)}")
    if args.json:
        args.json.write_text(json.dumps({"reads": reads, "load": load, "runs": {
            f"{s}|{n}": v for (s, n), v in runs.items()}}, indent=1))


if __name__ == "__main__":
    main()
