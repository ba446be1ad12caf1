"""Compute against llama.cpp: resident decode, same checkpoint, same threads (issue 28).

One random-weight checkpoint of Qwen1.5-MoE-A2.7B's shape (its first 4 layers, 60 experts
of 16.5 MiB, top-4, a shared expert; ``stmoe make-model --like qwen1.5-moe-a2.7b --layers
4``), converted to GGUF by llama.cpp's own converter (BF16) and quantized by llama-quantize
(Q8_0, Q4_K_M). Every engine decodes free-running on the checkpoint's random router (so
all route alike), everything resident, pinned to the same cores:

  llama.cpp BF16 / Q8_0 / Q4_K_M   llama-bench -p 0 -n TOKENS -t THREADS (mmap, page cache warm)
  transformers bf16                the checkpoint in plain transformers (the reference)
  stmoe native / int8 / int4       stmoe.offload at capacity 100%, warm (every expert cached:
                                   a first generation loads them), experts in that format
  stmoe int8+r / int4+r            the same with --quantize-resident int8 / int4 (attention,
                                   shared experts, lm_head; routers and gates native)

Each system runs in its own process, in rounds (each round's order rotated), and each
target is judged on the per-round ratios' median (MET / NOT MET):
  1 thread: stmoe int4+r >= 0.6x llama.cpp Q4_K_M; stmoe native >= 0.6x llama.cpp BF16.
The same at 2 threads is reported. int8 and int4 are lossy (benchmarks/bench_quality.py
measures them); the bytes each format really stores per weight are printed.

``--bounded``: instead, each run's whole process under a memory cgroup (page cache included;
the files' pages dropped first), llama.cpp with ``--load-mode mmap`` (its pages come and go
with the bound), stmoe on the disk tier (direct reads) with ``--memory`` at the bound (the
cache sized from it), stmoe-plus with tables profiled on the checkpoint's own routing of
other prompts (``stmoe capture`` + ``profile``), lru-only beside it; 1 compute thread each
on cores 0-1 (stmoe's prefetch workers read on the second). Two bounds:
  bf16: non-expert bytes + half the experts' + 1 GiB: stmoe-plus native >= 1.0x llama.cpp BF16;
  int4: 0.6 x the model's bytes + 1 GiB (llama.cpp: the Q4_K_M file; stmoe: its int4 experts
        and int4 resident weights): stmoe-plus int4+r >= 2x llama.cpp Q4_K_M.
The 1 GiB is the process's own (interpreter, torch; llama.cpp's buffers), the same for both.

``--bounded --real-routing``: stmoe alone at the same two bounds, replaying REAL
Qwen1.5-MoE routing (llama.cpp cannot replay a trace): round r replays the decode of
``../shared/traces/qwen15`` prompt r with tables profiled on the other two (HELD-OUT, as
bench_heldout.py), stmoe-plus (1.5K experts a prediction), lru-only and the oracle, to
show what real routing's lower reuse does at the bound (reported against lru-only, the
issue 27 rule: stmoe-plus >= 1.0x).

``--prefill``: time to first token of a 512-token prompt at the bf16 bound, cold: llama.cpp
BF16 (llama-bench -p 512 -n 0: 512 / its prompt tokens/s), stmoe-plus native with the prompt's
next layer streamed while each layer computes (runtime/planning.py) and without (the
predictor's guess, as before).

    python benchmarks/bench_compute.py [--rounds 3] [--tokens 64] [--threads 1,2] [--json F]
    python benchmarks/bench_compute.py --bounded [--rounds 3] [--tokens 64] [--json F]
    python benchmarks/bench_compute.py --bounded --real-routing [--rounds 3] [--tokens 32]
    python benchmarks/bench_compute.py --prefill [--rounds 3] [--json F]

Needs llama.cpp built (bash benchmarks/build_llama_cpp.sh) and about 12 GB of disk in
STMOE_BENCH_DIR (default ~/.cache/stmoe/bench): the checkpoint, its GGUF files, the stores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_tools as llama_cpp  # benchmarks/llama_cpp_tools.py

from stmoe.evaluate.compare import rotated, spread, verdict

LIKE, LAYERS = "qwen1.5-moe-a2.7b", 4
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # token ids: the router is random, the text meaningless
LLAMA = {"llama.cpp BF16": None, "llama.cpp Q8_0": "Q8_0", "llama.cpp Q4_K_M": "Q4_K_M"}
STMOE = {"stmoe native": ("native", None), "stmoe int8": ("int8", None),
         "stmoe int4": ("int4", None), "stmoe int8+r": ("int8", "int8"),
         "stmoe int4+r": ("int4", "int4")}
SYSTEMS = [*LLAMA, "transformers bf16", *STMOE]
TARGETS = [("stmoe int4+r", "llama.cpp Q4_K_M", 0.6), ("stmoe native", "llama.cpp BF16", 0.6)]


def bench_dir() -> Path:
    return Path(os.environ.get("STMOE_BENCH_DIR", Path.home() / ".cache" / "stmoe" / "bench"))


def checkpoint() -> Path:
    from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint

    path = bench_dir() / f"{LIKE}-L{LAYERS}"
    if not (path / "config.json").is_file():
        print(f"writing {path} (random weights, real shape) ...", flush=True)
        make_checkpoint(plan_checkpoint(LIKE, LAYERS), path)
    config = json.loads((path / "config.json").read_text())
    if "architectures" not in config:  # written before make-model named it
        config["architectures"] = ["Qwen2MoeForCausalLM"]
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def gguf_files(ckpt: Path) -> dict[str, Path]:
    bf16 = llama_cpp.convert(ckpt, ckpt.parent / f"{ckpt.name}.bf16.gguf")
    return {name: bf16 if kind is None else
            llama_cpp.quantize(bf16, ckpt.parent / f"{ckpt.name}.{kind.lower()}.gguf", kind)
            for name, kind in LLAMA.items()}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One stmoe or transformers run in this process: warm decode tokens/s."""
    import torch

    torch.set_num_threads(args.threads)
    ckpt = checkpoint()
    ids = torch.tensor([PROMPT])
    if args.child == "transformers bf16":
        from stmoe.hf.loading import load_causal_lm

        model = load_causal_lm(ckpt).eval()

        def run(n: int) -> float:
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
            return time.perf_counter() - t

        run(args.tokens + 1)  # warm
        first, whole = run(1), run(args.tokens + 1)
        return {"tokens_per_s": args.tokens / (whole - first)}
    from stmoe.runtime.api import offload

    if args.trace:
        return replayed(args, ckpt)
    if args.child in BOUNDED_STMOE or args.child in PREFILL_STMOE:
        fmt, resident, predictor = BOUNDED_STMOE[args.child.removesuffix(NO_STREAM)]
        with offload(ckpt, memory=str(args.memory), predictor=predictor, format=fmt,
                     quantize_resident=resident, tables=tables(ckpt)) as om:
            if args.child.endswith(NO_STREAM):
                om.engine.planner.prompt_routers = None
            prompt = LONG_PROMPT if args.child in PREFILL_STMOE else PROMPT
            r = om.generate(prompt, max_new_tokens=args.tokens)  # cold: what a bound means
            plan = om.config["memory_plan"]
            if args.child in PREFILL_STMOE:
                return {"ttft_s": r.ttft_s, "per_layer": plan["per_layer"],
                        "prefill": r.stats["phases"]["prefill"]}
        return {"tokens_per_s": r.decode_tokens_per_s, "hit_rate": r.hit_rate,
                "per_layer": plan["per_layer"], "process": plan["process"]}
    fmt, resident = STMOE[args.child]
    with offload(ckpt, capacity="100%", predictor="ondemand", format=fmt,
                 quantize_resident=resident) as om:
        om.generate(PROMPT, max_new_tokens=args.tokens)  # loads every expert it routes to
        r = om.generate(PROMPT, max_new_tokens=args.tokens, cold=False)
        expert_bytes = om.config["expert_bytes"]
        resident_bytes = sum(t.numel() * t.element_size() for t in
                             [*om.model.parameters(), *om.model.buffers()] if not t.is_meta)
    return {"tokens_per_s": r.decode_tokens_per_s, "hit_rate": r.hit_rate,
            "expert_bytes": expert_bytes, "resident_bytes": resident_bytes}


def replayed(args: argparse.Namespace, ckpt: Path) -> dict[str, Any]:
    """A bounded stmoe run replaying ``args.trace``'s routing, tables of ``args.profile_on``."""
    import bench_offload_real as real

    from stmoe.runtime.api import offload

    ns = real_args(args.trace, args.profile_on)
    fmt, resident, predictor = REPLAYED[args.child]
    pred, takes = real.compared(predictor, real.tables_for(ns))
    with offload(ckpt, memory=str(args.memory), predictor=pred, format=fmt,
                 quantize_resident=resident, tables=takes) as om:
        r = om.force_routing(real.replay_plan(ns, om.model.config), max_new_tokens=args.tokens)
        plan = om.config["memory_plan"]
    return {"tokens_per_s": r.decode_tokens_per_s, "hit_rate": r.hit_rate,
            "per_layer": plan["per_layer"], "stall_share": r.stall_share,
            "prefetch_recall": r.prefetch_recall}


def real_args(trace: str, profile_on: str) -> argparse.Namespace:
    """bench_offload_real's arguments for this checkpoint replaying ``trace``."""
    import bench_offload_real as real

    ns = argparse.Namespace(like=LIKE, layers=str(LAYERS), trace=trace, profile_on=profile_on,
                            split_at=0, in_sample=False)
    real.set_layers(ns)
    return ns


REPLAYED = {"stmoe-plus native": ("native", None, "stmoe-plus"),
            "lru-only native": ("native", None, "ondemand"),
            "oracle native": ("native", None, "oracle"),
            "stmoe-plus int4+r": ("int4", "int4", "stmoe-plus"),
            "lru-only int4+r": ("int4", "int4", "ondemand"),
            "oracle int4+r": ("int4", "int4", "oracle")}
REPLAYED_BOUNDS = {"bf16": ["stmoe-plus native", "lru-only native", "oracle native"],
                   "int4": ["stmoe-plus int4+r", "lru-only int4+r", "oracle int4+r"]}


BOUNDED_STMOE = {"stmoe-plus native": ("native", None, "stmoe-plus"),
                 "lru-only native": ("native", None, "ondemand"),
                 "stmoe-plus int4+r": ("int4", "int4", "stmoe-plus"),
                 "lru-only int4+r": ("int4", "int4", "ondemand")}
NO_STREAM = " (no prompt stream)"
PREFILL_STMOE = ["stmoe-plus native", "stmoe-plus native" + NO_STREAM]
PREFILL = ["llama.cpp BF16", *PREFILL_STMOE]
LONG_PROMPT = [3 + (7 * i) % 4000 for i in range(512)]  # 512 token ids (random router)
BOUNDS = {"bf16": ["llama.cpp BF16", "stmoe-plus native", "lru-only native"],
          "int4": ["llama.cpp Q4_K_M", "stmoe-plus int4+r", "lru-only int4+r"]}
BOUNDED_TARGETS = {"bf16": ("stmoe-plus native", "llama.cpp BF16", 1.0),
                   "int4": ("stmoe-plus int4+r", "llama.cpp Q4_K_M", 2.0)}


def tables(ckpt: Path) -> Path:
    """stmoe-plus's tables: the checkpoint's own (random) routing of capture's built-in prompts,
    not the benchmark's prompt, profiled once."""
    out = ckpt.parent / f"{ckpt.name}.tables.npz"
    if not out.is_file():
        trace = ckpt.parent / f"{ckpt.name}.capture.npz"
        subprocess.run([sys.executable, "-m", "stmoe", "capture", "--model", str(ckpt), "-o",
                        str(trace), "--max-new-tokens", "64"], check=True)
        subprocess.run([sys.executable, "-m", "stmoe", "profile", str(trace), "-o", str(out)],
                       check=True)
    return out


def spawn(system: str, threads: int, args: argparse.Namespace, ggufs: dict[str, Path]) -> float:
    cpus = "0" if threads == 1 else f"0-{threads - 1}"
    if system in LLAMA:
        return llama_cpp.bench(ggufs[system], threads, gen=args.tokens, cpus=cpus)["tokens_per_s"]
    cmd = ["taskset", "-c", cpus, sys.executable, __file__, "--child", system,
           "--threads", str(threads), "--tokens", str(args.tokens)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if system in STMOE and result["hit_rate"] < 1.0:
        print(f"  note: {system} warm hit rate {result['hit_rate']:.3f} (not every expert "
              "cached)", flush=True)
    return float(result["tokens_per_s"])


def bytes_per_weight(ggufs: dict[str, Path]) -> list[str]:
    """What each format stores per expert weight (and a GGUF's whole file per weight)."""
    from stmoe.quant import parse_format
    from stmoe.runtime.store import ExpertStore
    from stmoe.runtime.store.packing import default_store_dir

    lines = []
    for name, path in ggufs.items():
        whole, experts, kinds = llama_cpp.gguf_bytes_per_weight(path)
        lines.append(f"{name}: experts {experts:.3f} bytes per weight ({kinds}), whole file "
                     f"{whole:.3f}")
    ckpt = checkpoint()
    c = json.loads((ckpt / "config.json").read_text())
    per_expert = 3 * c["hidden_size"] * c["moe_intermediate_size"]
    for fmt in ("native", "int8", "int4"):
        store = ExpertStore(default_store_dir(ckpt, None if fmt == "native"
                                              else parse_format(fmt)))
        blocks = store.model["num_experts"] * store.model["moe_layers"]
        used = sum(b.nbytes for b in store.blocks.values())
        lines.append(f"stmoe {fmt}: experts {used / (blocks * per_expert):.3f} bytes per "
                     f"weight ({store.weights.label})")
    return lines


def spawn_bounded(system: str, limit: int, args: argparse.Namespace,
                  ggufs: dict[str, Path], extra: list[str] | None = None) -> dict[str, Any]:
    """One run with its whole process in a fresh memory cgroup of ``limit`` bytes."""
    from stmoe.util.cgroup import cgroup_peak, drop_pages, make_cgroup, remove_cgroup

    ckpt = checkpoint()
    drop_pages(ckpt)
    drop_pages(ckpt.parent)  # the GGUF files
    group = make_cgroup(f"stmoe-compute-{os.getpid()}", limit)
    if group is None:
        raise SystemExit("error: no memory cgroup can be made here; --bounded needs one")
    enter = f"echo $$ > {group}/cgroup.procs && exec "
    try:
        if system in LLAMA:
            cmd = [str(llama_cpp.binary("llama-bench")), "-m", str(ggufs[system]), "-t", "1",
                   "-r", "1", "-p", "0", "-n", str(args.tokens), "--load-mode", "mmap",
                   "-o", "json"]
            done = subprocess.run(["taskset", "-c", "0,1", "sh", "-c", enter + " ".join(cmd)],
                                  capture_output=True, text=True)
            if done.returncode in (-9, 137):  # the kernel's OOM killer: it did not fit
                return {"tokens_per_s": 0.0, "killed": True, "peak": cgroup_peak(group)}
            done.check_returncode()
            out = {"tokens_per_s": float(json.loads(done.stdout)[0]["avg_ts"])}
        else:
            cmd = [sys.executable, __file__, "--child", system, "--threads", "1", "--tokens",
                   str(args.tokens), "--memory", str(limit), *(extra or [])]
            done = subprocess.run(["taskset", "-c", "0,1", "sh", "-c",
                                   enter + " ".join(f"'{c}'" for c in cmd)],
                                  check=True, capture_output=True, text=True)
            out = json.loads(done.stdout.strip().splitlines()[-1])
        out["peak"] = cgroup_peak(group)
        return out
    finally:
        remove_cgroup(group)


def bounds(ggufs: dict[str, Path], args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Each bound in bytes, per system (see the module docstring)."""
    from stmoe.quant import parse_format
    from stmoe.runtime.store import ExpertStore
    from stmoe.runtime.store.packing import default_store_dir

    ckpt = checkpoint()
    native = ExpertStore(default_store_dir(ckpt))
    int4 = ExpertStore(default_store_dir(ckpt, parse_format("int4")))
    experts = sum(b.nbytes for b in native.blocks.values())
    total = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    measured = json.loads(subprocess.run(
        [sys.executable, __file__, "--child", "stmoe int4+r", "--threads", "1", "--tokens", "2"],
        check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    int4_model = sum(b.nbytes for b in int4.blocks.values()) + measured["resident_bytes"]
    bf16 = total - experts + experts // 2 + 2**30
    return {"bf16": dict.fromkeys(BOUNDS["bf16"], bf16),
            "int4": {"llama.cpp Q4_K_M": int(0.6 * ggufs["llama.cpp Q4_K_M"].stat().st_size)
                     + 2**30,
                     "stmoe-plus int4+r": int(0.6 * int4_model) + 2**30,
                     "lru-only int4+r": int(0.6 * int4_model) + 2**30}}


def bounded(args: argparse.Namespace, ggufs: dict[str, Path]) -> dict[str, Any]:
    limits = bounds(ggufs, args)
    tables(checkpoint())
    report: dict[str, Any] = {"limits": limits, "runs": {}, "targets": []}
    for name, systems in BOUNDS.items():
        print(f"\n## bound {name}: " + ", ".join(f"{s} {limits[name][s] / 2**30:.2f} GiB"
                                                 for s in systems), flush=True)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for rnd in range(args.rounds):
            for system in rotated(systems, rnd):
                runs[system].append(spawn_bounded(system, limits[name][system], args, ggufs))
                r = runs[system][-1]
                extra = (f", {r['per_layer']} experts per layer cached, hit rate "
                         f"{r['hit_rate']:.3f}" if "per_layer" in r else "")
                peak = f"{r['peak'] / 2**30:.2f} GiB" if r.get("peak") else "unknown"
                print(f"round {rnd + 1}, {system}: {r['tokens_per_s']:.2f} tok/s (cgroup peak "
                      f"{peak}{extra})", flush=True)
        speeds = {s: [r["tokens_per_s"] for r in rs] for s, rs in runs.items()}
        for s in systems:
            print(f"  {s:<20} {spread(speeds[s])} tok/s")
        mine, base, goal = BOUNDED_TARGETS[name]
        ratios = [a / b for a, b in zip(speeds[mine], speeds[base], strict=True)]
        ok = statistics.median(ratios) >= goal
        print(f"  {mine} / {base}: {spread(ratios)}x per round; target >= {goal}x {verdict(ok)}")
        report["runs"][name] = runs
        report["targets"].append({"bound": name, "mine": mine, "base": base, "goal": goal,
                                  "ratios": ratios, "met": ok})
    return report


def bounded_real(args: argparse.Namespace, ggufs: dict[str, Path]) -> dict[str, Any]:
    """stmoe alone at each bound, replaying real routing held out (the module docstring)."""
    import bench_heldout as heldout

    from stmoe.evaluate.compare import closed

    limits = bounds(ggufs, args)
    report: dict[str, Any] = {"limits": limits, "runs": {}, "targets": []}
    for name, systems in REPLAYED_BOUNDS.items():
        limit = limits[name][BOUNDS[name][1]]  # stmoe's bound
        print(f"\n## bound {name}, REAL Qwen1.5-MoE routing (held out): {limit / 2**30:.2f} "
              "GiB", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for rnd in range(args.rounds):
            replay = heldout.PROMPTS[rnd % len(heldout.PROMPTS)]
            others = ",".join(str(heldout.imported(p)) for p in heldout.PROMPTS if p != replay)
            extra = ["--trace", str(heldout.imported(replay)), "--profile-on", others]
            for system in rotated(systems, rnd):
                r = spawn_bounded(system, limit, args, ggufs, extra)
                runs[system].append(r)
                print(f"round {rnd + 1} ({replay}), {system}: {r['tokens_per_s']:.2f} tok/s, "
                      f"{r['per_layer']} cached per layer, hit rate {r['hit_rate']:.3f}, stall "
                      f"{r['stall_share']:.2f}", flush=True)
        plus, lru, oracle = ([r["tokens_per_s"] for r in runs[s]] for s in systems)
        for s in systems:
            print(f"  {s:<20} {spread([r['tokens_per_s'] for r in runs[s]])} tok/s, hit rate "
                  f"{spread([r['hit_rate'] for r in runs[s]], '.3f')}")
        ratios = [a / b for a, b in zip(plus, lru, strict=True)]
        gap = [closed(1 / b, 1 / a, 1 / o) for a, b, o in zip(plus, lru, oracle, strict=True)]
        ok = statistics.median(ratios) >= 1.0
        above = [o / b for o, b in zip(oracle, lru, strict=True)]
        print(f"  {systems[0]} / {systems[1]}: {spread(ratios)}x per round; >= 1.0x "
              f"{verdict(ok)}; oracle / lru-only {spread(above)}x; gap closed "
              f"{spread([100 * g for g in gap], '.0f')}%")
        report["runs"][name] = runs
        report["targets"].append({"bound": name, "ratios": ratios, "gap": gap, "met": ok})
    return report


def prefill(args: argparse.Namespace, ggufs: dict[str, Path]) -> dict[str, Any]:
    """Time to first token of LONG_PROMPT at the bf16 bound (see the module docstring)."""
    from stmoe.util.cgroup import drop_pages, make_cgroup, remove_cgroup

    limit = bounds(ggufs, args)["bf16"]["llama.cpp BF16"]
    tables(checkpoint())
    print(f"\n## time to first token, {len(LONG_PROMPT)}-token prompt, at {limit / 2**30:.2f} "
          "GiB (the bf16 bound), cold", flush=True)
    runs: dict[str, list[float]] = {s: [] for s in PREFILL}
    for rnd in range(args.rounds):
        for system in rotated(PREFILL, rnd):
            if system in LLAMA:
                ckpt = checkpoint()
                drop_pages(ckpt.parent)
                group = make_cgroup(f"stmoe-prefill-{os.getpid()}", limit)
                assert group is not None, "no memory cgroup"
                cmd = [str(llama_cpp.binary("llama-bench")), "-m", str(ggufs[system]), "-t",
                       "1", "-r", "1", "-p", str(len(LONG_PROMPT)), "-n", "0", "--load-mode",
                       "mmap", "-o", "json"]
                try:
                    done = subprocess.run(["taskset", "-c", "0,1", "sh", "-c",
                                           f"echo $$ > {group}/cgroup.procs && exec "
                                           + " ".join(cmd)], check=True, capture_output=True,
                                          text=True)
                finally:
                    remove_cgroup(group)
                ttft = len(LONG_PROMPT) / float(json.loads(done.stdout)[0]["avg_ts"])
                note = ""
            else:
                out = spawn_bounded(system, limit, argparse.Namespace(tokens=1), ggufs)
                ttft = out["ttft_s"]
                p = out["prefill"]
                note = (f" ({out['per_layer']} cached per layer; prompt hits {p['hits']} of "
                        f"{p['needed']}, reads {p['demand_reads']} demand + "
                        f"{p['prefetch_reads']} prefetch)")
            runs[system].append(ttft)
            print(f"round {rnd + 1}, {system}: {ttft:.2f} s{note}", flush=True)
    for system in PREFILL:
        print(f"  {system:<36} {spread(runs[system])} s")
    ratios = [b / a for a, b in zip(runs[PREFILL_STMOE[0]], runs[PREFILL_STMOE[1]],
                                    strict=True)]
    print(f"  streaming the prompt's next layer: {spread(ratios)}x faster to the first token")
    return {"limit": limit, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--bounded", action="store_true",
                    help="the memory-bound comparison instead (see the module docstring)")
    ap.add_argument("--prefill", action="store_true",
                    help="time to first token of a 512-token prompt at the bf16 bound")
    ap.add_argument("--real-routing", action="store_true",
                    help="with --bounded: stmoe alone replaying real Qwen1.5-MoE routing "
                    "(held out) at the same bounds")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trace", default="", help=argparse.SUPPRESS)
    ap.add_argument("--profile-on", default="", help=argparse.SUPPRESS)
    ap.add_argument("--memory", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        args.threads = int(args.threads)
        print(json.dumps(child(args)))
        return
    threads = [int(t) for t in args.threads.split(",")]
    ckpt = checkpoint()
    ggufs = gguf_files(ckpt)
    print(f"checkpoint {ckpt} (RANDOM weights, {LIKE}'s shape, {LAYERS} layers); "
          f"load at start: {os.getloadavg()[0]:.2f}", flush=True)
    for system in STMOE:  # pack each format's store once, untimed
        spawn(system, 2, argparse.Namespace(tokens=2), ggufs)
    if args.real_routing and not args.bounded:
        raise SystemExit("error: --real-routing goes with --bounded")
    if args.bounded or args.prefill:
        if args.real_routing:
            report = bounded_real(args, ggufs)
        else:
            report = bounded(args, ggufs) if args.bounded else prefill(args, ggufs)
        load_end = os.getloadavg()[0]
        print(f"load at end: {load_end:.2f}" + ("  (above 3: marked)" if load_end > 3 else ""))
        if args.json:
            args.json.write_text(json.dumps({**report, "load_end": load_end}, indent=1) + "\n")
        return
    runs: dict[int, dict[str, list[float]]] = {t: {s: [] for s in SYSTEMS} for t in threads}
    for rnd in range(args.rounds):
        for t in threads:
            for system in rotated(SYSTEMS, rnd):
                runs[t][system].append(spawn(system, t, args, ggufs))
                print(f"round {rnd + 1}, {t} thread(s), {system}: "
                      f"{runs[t][system][-1]:.2f} tok/s", flush=True)
    load_end = os.getloadavg()[0]
    report: dict[str, Any] = {"tokens": args.tokens, "rounds": args.rounds, "runs": runs,
                              "load_end": load_end, "targets": []}
    for t in threads:
        print(f"\n{t} thread(s): decode tokens/s, median [min, max] of {args.rounds} rounds")
        for system in SYSTEMS:
            print(f"  {system:<20} {spread(runs[t][system])}")
        for mine, base, goal in TARGETS:
            ratios = [a / b for a, b in zip(runs[t][mine], runs[t][base], strict=True)]
            ok = statistics.median(ratios) >= goal
            judged = t == 1
            print(f"  {mine} / {base}: {spread(ratios)}x per round; target >= {goal}x "
                  + (verdict(ok) if judged else "(reported)"))
            report["targets"].append({"threads": t, "mine": mine, "base": base, "goal": goal,
                                      "ratios": ratios, "met": ok if judged else None})
    print("\nbytes per weight:")
    for line in bytes_per_weight(ggufs):
        print(f"  {line}")
    print(f"load at end: {load_end:.2f}" + ("  (above 3: marked, rerun on a quieter machine)"
                                            if load_end > 3 else ""))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
