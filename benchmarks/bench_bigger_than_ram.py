"""A whole model bigger than this machine's RAM, decoded under one memory budget (issue 28, item 4).

All 24 layers of Qwen1.5-MoE-A2.7B's shape (``stmoe make-model --like qwen1.5-moe-a2.7b``:
28.6 GB of bf16, **random weights**; this machine has 24 GiB), every process bounded by a
memory cgroup of ``--memory`` (default 10GB, page cache included; the files' pages dropped
first), in one of two weight formats:

- ``--weights int4``: experts packed in int4 (``stmoe pack --format int4``: 7.6 GB), stmoe
  with ``--quantize-resident int4``, against llama.cpp Q4_K_M (from the converter's Q8_0);
- ``--weights bf16``: the bf16 experts read IN PLACE from the checkpoint's safetensors
  (``stmoe pack --in-place``: an index.json, no second copy), against llama.cpp BF16 (the
  converter's GGUF: a second 28.6 GB on disk, llama.cpp's own format).

stmoe (``generate --memory``) replays the REAL routing of one of the three
``../shared/traces/qwen15`` prompts (all 24 layers), tables profiled on the other two
(HELD-OUT; rotated each round): on-demand, lru-only, stmoe, stmoe-plus, oracle. llama.cpp
(``--load-mode mmap``) cannot replay a trace: it free-runs on the checkpoint's random router,
which repeats itself more than real routing does (a kinder case for its page cache).
Targets: stmoe-plus >= 3x llama.cpp's decode, and stmoe-plus closes >= 70% of the lru-only
-> oracle time gap.

    python benchmarks/bench_bigger_than_ram.py [--weights int4|bf16] [--rounds 3] [--tokens 32]
                                              [--memory 10GB]

Needs ~45 GB (int4) or ~60 GB (bf16) of disk in STMOE_BENCH_DIR (checked first) and
llama.cpp built (benchmarks/build_llama_cpp.sh); ``--clean`` deletes what it wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_tools as llama_cpp

from stmoe.evaluate.compare import closed, rotated, spread, verdict
from stmoe.evaluate.systems import OFFLOAD_SYSTEMS
from stmoe.util.cgroup import cgroup_peak, drop_pages, make_cgroup, remove_cgroup
from stmoe.util.units import parse_bytes

LIKE = "qwen1.5-moe-a2.7b"
SHARED = Path(os.environ.get("STMOE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
PROMPTS = ("history_1", "cooking_1", "ml_moe_1")
SYSTEMS = ["on-demand", "lru-only", "stmoe", "stmoe-plus", "oracle"]
NEED_BYTES = {"int4": 45 * 10**9, "bf16": 60 * 10**9}


def root() -> Path:
    return Path(os.environ.get("STMOE_BENCH_DIR", Path.home() / ".cache" / "stmoe" / "bench"))


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def prepare(weights: str) -> tuple[Path, Path, Path]:
    """The checkpoint, its int4 store and the Q4_K_M GGUF, or its in-place index and the
    BF16 GGUF (made once, each checked)."""
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    ckpt = base / f"{LIKE}-L24"
    store = base / f"{LIKE}-L24.{'int4' if weights == 'int4' else 'in-place'}"
    gguf = base / f"{LIKE}-L24.{'q4_k_m' if weights == 'int4' else 'bf16'}.gguf"
    if not (ckpt / "config.json").is_file() or not (store / "index.json").is_file() \
            or not gguf.is_file():
        have = sum(f.stat().st_size for f in [*ckpt.glob("*"), gguf] if f.is_file())
        free = shutil.disk_usage(base).free
        if free + have < NEED_BYTES[weights]:
            raise SystemExit(f"error: {base} has {free / 1e9:.0f} GB free, this needs "
                             f"{(NEED_BYTES[weights] - have) / 1e9:.0f} GB more")
    if not (ckpt / "config.json").is_file():
        run([sys.executable, "-m", "stmoe", "make-model", "--like", LIKE, "-o", str(ckpt)])
    if not (store / "index.json").is_file():
        how = ["--format", "int4"] if weights == "int4" else ["--in-place"]
        run([sys.executable, "-m", "stmoe", "pack", str(ckpt), "-o", str(store), *how])
    if weights == "bf16" and not gguf.is_file():
        llama_cpp.convert(ckpt, gguf)
    if not gguf.is_file():
        q8 = base / f"{LIKE}-L24.q8_0.gguf"
        llama_cpp.convert(ckpt, q8, outtype="q8_0")  # no 28.6 GB BF16 copy on the way
        done = subprocess.run([str(llama_cpp.binary("llama-quantize")), "--allow-requantize",
                               str(q8), str(gguf), "Q4_K_M"], capture_output=True, text=True)
        q8.unlink()
        if done.returncode:
            raise SystemExit(f"error: llama-quantize failed:\n{done.stderr[-2000:]}")
    return ckpt, store, gguf


def traces() -> dict[str, Path]:
    out = {}
    for name in PROMPTS:
        path = root() / f"qwen15-{name}.npz"
        if not path.is_file():
            run([sys.executable, "-m", "stmoe", "import",
                 str(SHARED / "traces" / "qwen15" / f"{name}.routes.json"), "-o", str(path)],
                capture_output=True)
        out[name] = path
    return out


def tables(replayed: str, found: dict[str, Path]) -> Path:
    """Tables profiled on the two prompts not replayed (held-out), made once."""
    from stmoe.predictors import profile, save_tables
    from stmoe.trace import concat, load_trace

    out = root() / f"qwen15-L24-not-{replayed}.tables.npz"
    if not out.is_file():
        save_tables(profile(concat([load_trace(p) for n, p in found.items() if n != replayed])),
                    out)
    return out


def in_cgroup(cmd: list[str], limit: int, files: list[Path]) -> tuple[str, int | None]:
    """``cmd``'s stdout, run with its whole process in a fresh cgroup of ``limit`` bytes."""
    for f in files:
        drop_pages(f if f.is_dir() else f.parent)
    group = make_cgroup(f"stmoe-big-{os.getpid()}", limit)
    if group is None:
        raise SystemExit("error: no memory cgroup can be made here")
    try:
        quoted = " ".join(f"'{c}'" for c in cmd)
        done = subprocess.run(["sh", "-c", f"echo $$ > {group}/cgroup.procs && exec {quoted}"],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{cmd[:4]} failed ({done.returncode}): {done.stderr[-1500:]}")
        return done.stdout, cgroup_peak(group)
    finally:
        remove_cgroup(group)


def stmoe_run(system: str, replayed: str, args: argparse.Namespace, ckpt: Path, store: Path,
              found: dict[str, Path]) -> dict[str, Any]:
    predictor, policy = OFFLOAD_SYSTEMS[system]
    cmd = [sys.executable, "-m", "stmoe", "generate", "--model", str(ckpt), "--store",
           str(store), "--routing", str(found[replayed]), "--max-new-tokens", str(args.tokens),
           "--memory", args.memory, "--predictor", predictor, "--policy", policy,
           "--threads", "1", "--json", "-"]
    if args.weights == "int4":
        cmd += ["--quantize-resident", "int4"]
    if predictor in ("stmoe", "stmoe-plus"):
        cmd += ["--tables", str(tables(replayed, found))]
    out, peak = in_cgroup(cmd, args.limit, [ckpt, store])
    data = json.loads(out)
    return {"tokens_per_s": data["decode_tokens_per_s"], "ttft_s": data["ttft_s"],
            "hit_rate": data["hit_rate"], "per_layer": data["config"]["capacity"],
            "peak": peak}


def llama_run(gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """llama-bench under the bound: as it runs by default, else (killed or failed) with its
    weight repacking off (repacked weights live in anonymous memory, which mmap cannot page)."""
    for extra in ([], ["--repack", "0"]):
        cmd = [str(llama_cpp.binary("llama-bench")), "-m", str(gguf), "-t", "1", "-r", "1",
               "-p", "0", "-n", str(args.tokens), "--load-mode", "mmap", "-o", "json", *extra]
        try:
            out, peak = in_cgroup(cmd, args.limit, [gguf])
        except RuntimeError as exc:
            print(f"  llama.cpp {' '.join(extra) or '(default)'} failed under the bound: "
                  f"{str(exc)[:300]}", flush=True)
            continue
        return {"tokens_per_s": float(json.loads(out)[0]["avg_ts"]), "peak": peak,
                "how": " ".join(extra) or "default"}
    return {"tokens_per_s": 0.0, "peak": None, "how": "failed"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", choices=["int4", "bf16"], default="int4",
                    help="int4: a packed int4 store against Q4_K_M; bf16: the experts read in "
                    "place against llama.cpp BF16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--memory", default="10GB")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--clean", action="store_true", help="delete the files this wrote, and stop")
    args = ap.parse_args()
    if args.clean:
        for p in root().glob(f"{LIKE}-L24*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return
    args.limit = int(parse_bytes(args.memory))
    ckpt, store, gguf = prepare(args.weights)
    found = traces()
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    held = (f"int4 store {sum(f.stat().st_size for f in store.glob('*.bin')) / 1e9:.1f} GB"
            if args.weights == "int4" else "bf16 experts read in place (index.json "
            f"{(store / 'index.json').stat().st_size / 1e6:.1f} MB)")
    print(f"{ckpt}: {size / 1e9:.1f} GB of bf16 (RANDOM weights); {held}; "
          f"{'Q4_K_M' if args.weights == 'int4' else 'BF16'} GGUF "
          f"{gguf.stat().st_size / 1e9:.1f} GB; every process bounded to {args.memory}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    names = [*SYSTEMS, "llama.cpp"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in names}
    for rnd in range(args.rounds):
        replayed = PROMPTS[rnd % len(PROMPTS)]
        for system in rotated(names, rnd):
            r = (llama_run(gguf, args) if system == "llama.cpp"
                 else stmoe_run(system, replayed, args, ckpt, store, found))
            runs[system].append(r)
            peak = f"{r['peak'] / 2**30:.2f} GiB" if r.get("peak") else "unknown"
            extra = (f", ttft {r['ttft_s']:.1f} s, hit {r['hit_rate']:.3f}, "
                     f"{r['per_layer']} cached per layer" if "ttft_s" in r else "")
            print(f"round {rnd + 1} ({replayed}), {system}: {r['tokens_per_s']:.2f} tok/s "
                  f"(peak {peak}{extra})", flush=True)
    speed = {s: [r["tokens_per_s"] for r in rs] for s, rs in runs.items()}
    for s in names:
        ttft = (f", ttft {spread([r['ttft_s'] for r in runs[s]])} s" if s != "llama.cpp"
                else "")
        print(f"  {s:<11} {spread(speed[s])} tok/s{ttft}")
    ratios = [a / b if b else float("inf") for a, b in zip(speed["stmoe-plus"],
                                                           speed["llama.cpp"], strict=True)]
    ok = statistics.median(ratios) >= 3.0
    print(f"stmoe-plus / llama.cpp: {spread(ratios)}x per round; target >= 3x {verdict(ok)}")
    gaps = [closed(1 / lru, 1 / plus, 1 / orc) for lru, plus, orc in
            zip(speed["lru-only"], speed["stmoe-plus"], speed["oracle"], strict=True)]
    oracle_gain = statistics.median(speed["oracle"]) / statistics.median(speed["lru-only"])
    if oracle_gain < 1.05 or any(g != g for g in gaps):  # nan: the oracle no faster
        gap_ok = False
        print(f"the oracle is {oracle_gain:.2f}x lru-only: no gap to close at this bound "
              "(target >= 70%: not measurable here)")
    else:
        gap_ok = statistics.median(gaps) >= 0.7
        print(f"stmoe-plus closes {spread([100 * g for g in gaps], '.0f')}% of the lru-only "
              f"-> oracle gap; target >= 70% {verdict(gap_ok)}")
    print(f"load at end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "ratio_met": ok, "gap": gaps,
                                         "gap_met": gap_ok}, indent=1) + "\n")


if __name__ == "__main__":
    main()
