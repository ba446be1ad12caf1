"""Offloading at real expert sizes, on real routing: the shared sample's model shape.

Builds once (cached in ``STMOE_BENCH_DIR``, default ~/.cache/stmoe/bench) a
checkpoint with the exact dimensions of Qwen3.6-35B-A3B's MoE layers (2048
hidden, 256 experts of 512 width, top-8; bfloat16, experts of 6 MiB) with
RANDOM weights and its first ``--layers`` MoE layers (8: 12 GiB of experts),
packs its store, and replays the real routing recorded from that model
(``../shared/traces``: one chat prompt, 36 prefill + 128 decode tokens) through
the runtime (``OffloadedModel.force_routing``): every cache, prefetch, read and expert
matmul is real; only the router's choice comes from the trace.

Each (round, tier, system) runs in its own process (so its peak memory is its
own), rounds interleave the systems (each round in a rotated order), and figures
are medians with [min, max]; the gap closed is printed per round too.
Systems at 50% of each layer's experts cached (same cache, same reads):

  on-demand   no prefetch, no reuse       lru-only   no prefetch, LRU cache
  stmoe       ST-MoE prefetch + LRU       stmoe-plus probabilistic tables, 1.5K per layer
  stmoe-plus-2k  stmoe-plus with 2K experts per prediction (higher recall, more loads)
  oracle      prefetches exactly what the router will pick (a first pass records it)

Tiers: ``disk`` (O_DIRECT reads of the store) and ``emulated`` (host memory behind
a link of ``--bandwidth``; EMULATED; its whole store sits in RAM, so its runs take
the first ``--emulated-layers``, by default as many as fit half the RAM: 5 of 8
on 24 GiB). Then, at one memory bound for the whole
process, page cache included (a memory cgroup per run; ``offload_baselines.py``):
stmoe and stmoe-plus against what a user would pick instead, plain transformers on
the memory-mapped checkpoint and accelerate's disk offload (``pip install -e
'.[bench]'``). Last, every expert cached, warm, against plain transformers with
the whole model in RAM (same routing forced).

The tables of the table predictors never see the routing replayed (HELD-OUT):
by default the sample is split by tokens (``--split-at 100``: tables profiled on
its prompt and first 64 decode tokens, the other 64 replayed after the 8 tokens
before them as the prompt); ``--profile-on`` profiles on other traces instead,
and ``--in-sample`` on the replayed sequence itself (an upper bound, labelled
so). benchmarks/bench_heldout.py runs issue 27's whole matrix of held-out
configurations.

    python benchmarks/bench_offload_real.py [--layers 8 | A:B] [--tokens 129] [--rounds 3]
                                            [--tiers disk,emulated] [--bandwidth 1GB]

With ``--calibrate``, ``stmoe calibrate`` runs in each round of each tier too (a
hardware preset per round, recorded in the JSON), so that
``bench_sim_check.py`` can check the simulator against presets measured when the
runs were.

Another model's shape on routing recorded from it (a trace captured with ``stmoe
capture`` or imported from vLLM/SGLang with ``stmoe import``; its first sequence):

    python benchmarks/bench_offload_real.py --like qwen1.5-moe-a2.7b --trace mine.npz \
        --profile-on others.npz --layers 8:16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stmoe.errors import StmoeError
from stmoe.evaluate.compare import closed, not_slower, rotated, spread, verdict
from stmoe.trace.select import select_layers

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
SAMPLE = SHARED / "qwen3.6-35b-a3b_chat-1prompt.npz"
PRESET = "qwen3.6-35b-a3b"
SAMPLE_SPLIT = 36 + 64  # the sample's prompt and first 64 decode tokens profiled, the rest replayed
SYSTEMS = {  # name: (predictor, cache policy)
    "on-demand": ("ondemand", "none"),
    "lru-only": ("ondemand", "lru"),
    "stmoe": ("stmoe", "lru"),
    "stmoe-plus": ("stmoe-plus", "lru"),
    "stmoe-plus-2k": ("stmoe-plus", "lru"),  # 2K experts per prediction: more recall, more loads
    "oracle": ("oracle", "lru"),
    "stmoe-plus-score": ("stmoe-plus", "score"),  # victims: what stmoe-plus scores lowest
    # each layer's cache sized by held-out curves of --profile-on's prompts, the same total
    # (stmoe.evaluate.layer_capacity; the split printed)
    "stmoe-plus-split": ("stmoe-plus", "lru"),
    "stmoe-plus-split-all": ("stmoe-plus", "lru"),  # the same, admission off
    # admission off (every predicted load made, the runtime before issue 27): the A/B
    "stmoe-all": ("stmoe", "lru"),
    "stmoe-plus-all": ("stmoe-plus", "lru"),
}
DEFAULT_SYSTEMS = ("on-demand", "lru-only", "stmoe", "stmoe-plus", "stmoe-plus-2k", "oracle")
PREDICTING = ("stmoe", "stmoe-plus", "stmoe-plus-2k")
BASELINES = ("resident", "mmap", "accelerate")  # offload_baselines.py
BOUNDED = ("stmoe", "stmoe-plus", "mmap", "accelerate")  # compared at one memory bound


def bench_dir() -> Path:
    return Path(os.environ.get("STMOE_BENCH_DIR", Path.home() / ".cache" / "stmoe" / "bench"))


def prepare(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The checkpoint, its store and the tables (built once, then reused)."""
    from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint

    root = bench_dir()
    layers, like = args.layers, args.like
    model = root / f"{like}-L{layers}"
    if not (model / "config.json").is_file():
        print(f"writing {model} (random weights, real shape) ...", flush=True)
        make_checkpoint(plan_checkpoint(like, layers), model)
    store = root / f"{like}-L{layers}.store"
    if not (store / "index.json").is_file():
        print(f"packing {store} ...", flush=True)
        subprocess.run([sys.executable, "-m", "stmoe", "pack", str(model), "-o", str(store)],
                       check=True)
    return model, store, tables_for(args)


def tables_for(args: argparse.Namespace) -> Path:
    """The tables' file (profiled once, then reused): of the trace replayed (IN-SAMPLE), of
    --profile-on's others or of the tokens before --split-at (HELD-OUT), over the layers cut
    as the replay's."""
    from stmoe.predictors import profile, save_tables
    from stmoe.trace import load_trace

    trace = Path(args.trace)
    sources = [Path(p) for p in args.profile_on.split(",")] if args.profile_on else [trace]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:8]
    tag = "" if sources == [SAMPLE] else f"-{'+'.join(p.stem for p in sources)}-{digest}"
    tag += f"-at{args.split_at}" if args.split_at else ""
    tag += "" if args.cut == str(args.layers) else f"-cut{args.cut.replace(':', '-')}"
    tables = bench_dir() / f"{args.like}-L{args.layers}{tag}.tables.npz"
    if not tables.is_file():
        if args.split_at:
            routing = split_routing(args, select_layers(load_trace(trace), args.cut))[0]
        else:
            routing = cut_routing(sources, args.cut)
        save_tables(profile(routing), tables)
    return tables


def cut_routing(paths: list[Path], cut: str) -> Any:
    """The traces at ``paths``, their layers ``cut`` as the replay's, as one trace."""
    from stmoe.trace import concat, load_trace

    return concat([select_layers(load_trace(p), cut) for p in paths])


def split_routing(args: argparse.Namespace, trace: Any) -> tuple[Any, Any]:
    """``--split-at``: (the tokens before it, profiled; the tokens from it on, replayed with
    the ``--split-prompt`` tokens just before it as their prompt): held-out by tokens."""
    from stmoe.trace.select import held_out_tail, select_sequences

    return held_out_tail(select_sequences(trace, [0]), args.split_at, args.split_prompt)


def replay_plan(args: argparse.Namespace, config: Any) -> Any:
    """The trace's first sequence (its layers ``--layers``; from ``--split-at`` on if given)
    shaped for the model (a clear error if it does not fit)."""
    from stmoe.runtime.forced_routing import plan_routing
    from stmoe.sim.specs import model_preset
    from stmoe.trace import load_trace

    spec = model_preset(args.like)
    routing = select_layers(load_trace(args.trace), args.cut)
    if args.split_at:
        routing = split_routing(args, routing)[1]
    return plan_routing(routing, 0, args.layers, spec.num_experts, spec.top_k,
                        config.vocab_size)


def split_for(args: argparse.Namespace, tables: Any) -> list[int]:
    """stmoe-plus-split's capacities (each run's JSON records them): ``--capacity`` per
    layer split by the curves of the --profile-on prompts, each replayed with tables of the
    others (HELD-OUT, as the tables)."""
    from stmoe.evaluate.layer_capacity import size_split
    from stmoe.evaluate.systems import PLUS_SET_SIZE_IN_K
    from stmoe.util.units import capacity_per_layer

    if not args.profile_on or len(args.profile_on.split(",")) < 2:
        raise SystemExit("stmoe-plus-split sizes its split from 2 or more --profile-on traces")
    routing = cut_routing([Path(p) for p in args.profile_on.split(",")], args.cut)
    uniform = capacity_per_layer(args.capacity, routing.num_experts, routing.top_k,
                                 forms=("count", "share"))
    split = size_split(routing, uniform, "stmoe-plus", "lru", options={
        "set_size": PLUS_SET_SIZE_IN_K * tables.shape.top_k})
    return list(split.capacities)


def compared(predictor: str, tables: Path) -> tuple[Any, Path | None]:
    """(what ``offload(predictor=...)`` takes for a compared system, the ``tables`` it takes
    beside it: None where the predictor is an object holding them or needs none)."""
    from stmoe.evaluate.systems import compared_predictor
    from stmoe.predictors import REGISTRY, load_tables

    pred = predictor if predictor == "ondemand" else \
        compared_predictor(predictor, load_tables(tables))
    takes_tables = isinstance(pred, str) and REGISTRY[pred].needs_tables
    return pred, tables if takes_tables else None


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One system on one tier (this process): the replay's figures and the peak memory."""
    import torch

    from stmoe.predictors import load_tables, make
    from stmoe.runtime.api import offload

    torch.set_num_threads(args.threads)
    model, store, tables = prepare(args)
    predictor, policy = SYSTEMS.get(args.one, ("ondemand", "lru"))
    pred, takes = compared(predictor, tables)
    if args.one == "stmoe-plus-2k":
        loaded = load_tables(tables)
        pred = make("stmoe-plus", loaded.shape, loaded, set_size=2.0 * loaded.shape.top_k)
    link = {"bandwidth": args.bandwidth} if args.tier == "emulated" else {}
    capacity = "100%" if args.one == "all-cached" else args.capacity
    if args.one.startswith("stmoe-plus-split"):
        capacity = split_for(args, load_tables(tables))
    started = time.perf_counter()
    with offload(model, store, capacity=capacity, predictor=pred, tables=takes, policy=policy,
                 tier=args.tier, admission=not args.one.endswith("-all"), **link) as om:
        offload_s = time.perf_counter() - started  # loading, the cache made (its pages faulted in)
        plan = replay_plan(args, om.model.config)
        r = om.force_routing(plan, max_new_tokens=args.tokens)
        if args.one == "all-cached":  # every expert now in the cache: the warm run counts
            r = om.force_routing(plan, max_new_tokens=args.tokens, cold=False)
        out = {key: getattr(r, key) for key in ("decode_tokens_per_s", "ttft_s", "hit_rate",
               "prefetch_recall", "prefetch_precision", "bytes_moved", "bytes_wasted",
               "stall_share")}
        decode = r.stats["phases"]["decode"]  # the tier's reads as this run met them
        out.update({k: decode[k] for k in ("demand_reads", "demand_read_s", "prefetch_reads",
                                           "prefetch_read_s")})
        out["cache_bytes"] = om.config["cache_bytes"]
        out["capacity"] = om.config["capacity"]  # (a split: each layer's)
        out["admission"] = r.stats.get("admission")
        out["offload_s"] = offload_s
        out["resident_bytes"] = sum(p.numel() * p.element_size() for p in om.model.parameters()
                                    if not p.is_meta)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """A system a user would pick instead (``offload_baselines``), the same routing forced
    on its layers; bounded by the cgroup the parent made, or by dropping pages."""
    import torch
    from offload_baselines import decode_speed, load_baseline

    from stmoe.util.cgroup import drop_pages, enter_cgroup

    if args.cgroup:
        enter_cgroup(Path(args.cgroup))
    torch.set_num_threads(args.threads)
    model_dir, _, _ = prepare(args)
    offload_dir = bench_dir() / f"accelerate-offload-{os.getpid()}"
    try:
        model = load_baseline(args.one, model_dir, args.budget, offload_dir)
        plan = replay_plan(args, model.config)
        drop = (lambda: drop_pages(model_dir)) if args.drop_pages else None
        steps = min(args.tokens, plan.new_tokens)
        speeds = decode_speed(model, plan, steps, 1 if args.cgroup or drop else 2, drop)
    finally:
        shutil.rmtree(offload_dir, ignore_errors=True)
    return {"decode_tokens_per_s": speeds[-1], "tokens": steps,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def spawn(args: argparse.Namespace, system: str, tier: str, bound: Path | None = None,
          tokens: int | None = None) -> dict[str, Any]:
    """One run in a child process (in the memory cgroup ``bound`` if given)."""
    cmd = [sys.executable, __file__, "--one", system, "--tier", tier, "--layers", args.cut,
           "--like", args.like, "--trace", str(args.trace),
           "--tokens", str(tokens or args.tokens), "--bandwidth", args.bandwidth, "--capacity",
           args.capacity, "--threads", str(args.threads), "--budget", str(args.budget)]
    if args.profile_on:
        cmd += ["--profile-on", args.profile_on]
    if args.split_at:
        cmd += ["--split-at", str(args.split_at), "--split-prompt", str(args.split_prompt)]
    if args.in_sample:
        cmd += ["--in-sample"]
    if bound is not None:
        cmd += ["--cgroup", str(bound)]
    elif args.drop_pages and system in BASELINES:
        cmd += ["--drop-pages"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{system} on {tier} failed (exit {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def calibrate(args: argparse.Namespace, tier: str, rnd: int) -> Path:
    """``stmoe calibrate`` of ``tier`` on the checkpoint, in the round's rotation like a
    system, so its preset measures the tier when the round's runs did (a virtual
    disk's speed drifts over minutes; ``bench_sim_check.py`` simulates each round with
    its own preset)."""
    model, store, tables = prepare(args)
    out = bench_dir() / (
        f"calibrated-{args.like}-L{args.layers}-{tier}-{args.started}-round{rnd + 1}.toml"
    )  # (the run's start in the name: one set per run)
    cmd = [sys.executable, "-m", "stmoe", "calibrate", "--model", str(model), "--store",
           str(store), "--tier", tier, "--capacity", args.capacity, "--routing",
           str(args.trace), "--threads", str(args.threads), "--tables", str(tables),
           "-o", str(out)]  # (the tables: the predictors' own time measured with them)
    if tier == "emulated":
        cmd += ["--bandwidth", args.bandwidth]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"calibrate on {tier} failed (exit {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return out


def spawn_bounded(args: argparse.Namespace, system: str, limit: int) -> dict[str, Any]:
    """``system`` with the whole process (page cache included) bounded to ``limit`` bytes:
    a fresh cgroup per run, the checkpoint's pages dropped first (charged to none)."""
    from stmoe.util.cgroup import cgroup_peak, drop_pages, make_cgroup, remove_cgroup

    model_dir, _, _ = prepare(args)
    drop_pages(model_dir)
    group = None if args.drop_pages else make_cgroup(f"stmoe-bench-{os.getpid()}", limit)
    if group is None and not args.drop_pages:
        args.drop_pages = True
        print("no memory cgroup can be made here: the baselines drop the checkpoint's pages "
              "before every forward call instead (the bound's worst case)", flush=True)
    tokens = args.baseline_tokens if system in BASELINES else None
    try:
        out = spawn(args, system, "disk", group, tokens)
        if group is not None:
            out["peak_rss"] = cgroup_peak(group) or out["peak_rss"]
    finally:
        if group is not None:
            remove_cgroup(group)
    return out


def memory_budget(args: argparse.Namespace) -> tuple[int, int]:
    """(the bytes stmoe keeps resident at ``--capacity``: non-expert weights + cache, the
    bound: 1.15x that, but at least that + 1 GiB: the interpreter, torch and transformers
    take about 0.5 GiB of their own), from the checkpoint's and store's headers."""
    from safetensors import safe_open

    from stmoe.runtime.store import ExpertStore

    model_dir, store_dir, _ = prepare(args)
    total = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * (2 if sl.get_dtype() in ("BF16", "F16") else 4)
    store = ExpertStore(store_dir)
    experts = sum(b.nbytes for b in store.blocks.values())
    per_layer = int(store.model["num_experts"])
    share = float(args.capacity.rstrip("%")) / 100
    cache = sum(b.nbytes for b in store.blocks.values()) * round(per_layer * share) // per_layer
    resident = total - experts + cache
    return resident, max(int(1.15 * resident), resident + 2**30)


def emulated_layers(args: argparse.Namespace) -> int:
    """The MoE layers the emulated tier's runs take: ``--emulated-layers``, else the most
    (up to ``--layers``) whose store and cache fill at most half of this machine's RAM.
    That tier holds the whole store in host memory (a file mapping): a store near the
    RAM's size has its pages dropped and read back from disk mid-run, which times the
    disk, not the link (8 layers, 12 GiB, on 24 GiB: every round slower than the one
    before, the oracle's median below stmoe-plus's)."""
    from stmoe.sim.specs import model_preset

    if args.emulated_layers:
        return min(args.emulated_layers, args.layers)
    spec = model_preset(args.like)
    share = float(args.capacity.rstrip("%")) / 100
    per_layer = spec.expert_bytes * spec.num_experts * (1 + share)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(args.layers, int(0.5 * ram // per_layer)))


def tables_label(args: argparse.Namespace) -> str:
    """Where the tables' routing comes from, said beside every figure."""
    if args.in_sample:
        return "IN-SAMPLE tables (profiled on the replayed sequence: an upper bound)"
    if args.split_at:
        return f"HELD-OUT tables (profiled on tokens 0..{args.split_at - 1}, not replayed)"
    return f"HELD-OUT tables (profiled on {args.profile_on})"


def report(tier: str, runs: dict[str, list[dict[str, Any]]], layers: int,
           label: str) -> dict[str, Any]:
    med = {s: {k: statistics.median(r[k] for r in rs) for k, v in rs[0].items()
               if isinstance(v, (int, float))} for s, rs in runs.items()}
    print(f"\n## tier {tier}{' (EMULATED)' if tier == 'emulated' else ''}, {layers} MoE layers; "
          f"{label}; RANDOM weights")
    print(f"{'system':13} {'decode tok/s':>22} {'hit':>6} {'recall':>7} {'prec':>6} {'stall':>6}"
          f" {'moved GiB':>10} {'wasted':>7} {'peak GiB':>9} {'start s':>8}")
    for s, rs in runs.items():
        m = med[s]
        print(f"{s:13} {spread([r['decode_tokens_per_s'] for r in rs]):>22} {m['hit_rate']:6.3f} "
              f"{m['prefetch_recall']:7.3f} {m['prefetch_precision']:6.3f} "
              f"{m['stall_share']:6.2f} {m['bytes_moved'] / 2**30:10.2f} "
              f"{m['bytes_wasted'] / max(1, m['bytes_moved']):7.1%} "
              f"{m['peak_rss'] / 2**30:9.2f} {m['offload_s']:8.1f}")
    t = {s: 1 / m["decode_tokens_per_s"] for s, m in med.items()}  # seconds per decode token
    predicting = [s for s in (*PREDICTING, "stmoe-all", "stmoe-plus-all") if s in runs]
    best = min(predicting, key=lambda s: t[s])
    gap = closed(t["lru-only"], t[best], t["oracle"])
    # the same share of the stall alone (steady from run to run, where the compute is not)
    stall = {s: statistics.median(r["stall_share"] / r["decode_tokens_per_s"] for r in rs)
             for s, rs in runs.items()}
    stall_gap = closed(stall["lru-only"], stall[best], stall["oracle"])
    # the same share within each round (its systems ran minutes apart, in rotated order)
    per_round = [closed(*(1 / runs[s][i]["decode_tokens_per_s"] for s in ("lru-only", best,
                 "oracle"))) for i in range(len(runs["oracle"]))]
    mem = max(m["peak_rss"] / (m["resident_bytes"] + m["cache_bytes"]) for m in med.values())
    def speeds(s: str) -> list[float]:
        return [r["decode_tokens_per_s"] for r in runs[s]]

    targets = {f"{s} >= 1.0x lru-only (median, or ranges overlapping)":
               not_slower(speeds(s), speeds("lru-only")) for s in ("stmoe", "stmoe-plus")
               if s in runs}
    if t["lru-only"] >= 1.2 * t["oracle"]:  # the oracle >= 20% faster: a gap worth closing
        targets[f"best ({best}) closes >= 50% of lru-only -> oracle"] = gap >= 0.5
    if "on-demand" in runs and "stmoe" in runs:
        targets["stmoe >= 1.5x on-demand"] = t["on-demand"] / t["stmoe"] >= 1.5
    if "stmoe-plus" in runs:
        plus = med["stmoe-plus"]
        targets["stmoe-plus wasted <= 25% of moved"] = (plus["bytes_wasted"]
                                                         <= 0.25 * plus["bytes_moved"])
    if tier == "disk":  # the emulated tier's host copy of the store is in its RSS by design
        targets["peak memory <= (resident + cache) x 1.15"] = mem <= 1.15
    ratios = ", ".join(f"{s} {t['lru-only'] / t[s]:.2f}x" for s in [*predicting, "oracle"])
    print(f"against lru-only: {ratios}; gap closed by {best} {gap:.0%} (per round: "
          f"{', '.join(f'{g:.0%}' for g in per_round)}; of the stall alone {stall_gap:.0%}); "
          f"peak / (resident + cache) {mem:.2f}")
    for name, ok in targets.items():
        print(f"  {verdict(ok):8} {name}")
    return {
        "median": med,
        "targets": targets,
        "gap_closed": gap,
        "gap_closed_per_round": per_round,
        "stall_gap_closed": stall_gap,
    }


def bounded(args: argparse.Namespace, limit: int) -> dict[str, Any]:
    """stmoe against what a user would pick instead, the whole process bounded alike."""
    print(f"\n## at one memory bound: {limit / 2**30:.2f} GiB for the whole process, page cache "
          f"included (1.15 x stmoe's resident weights + cache, at least + 1 GiB; disk tier; "
          f"mmap and accelerate "
          f"decode {args.baseline_tokens} tokens)", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in BOUNDED}
    for rnd in range(args.rounds):
        for system in rotated(list(BOUNDED), rnd):
            runs[system].append(spawn_bounded(args, system, limit))
            print(f"[bounded round {rnd + 1}] {system}: "
                  f"{runs[system][-1]['decode_tokens_per_s']:.2f} tok/s", flush=True)
    speed = {s: statistics.median(r["decode_tokens_per_s"] for r in rs) for s, rs in runs.items()}
    for s, rs in runs.items():
        print(f"{s:13} {spread([r['decode_tokens_per_s'] for r in rs]):>22} tok/s, peak "
              f"{max(r['peak_rss'] for r in rs) / 2**30:.2f} GiB")
    how = "pages dropped before every forward" if args.drop_pages else "memory cgroup"
    ok = speed["stmoe"] > max(speed["mmap"], speed["accelerate"])
    print(f"stmoe / mmap {speed['stmoe'] / speed['mmap']:.2f}x, stmoe / accelerate "
          f"{speed['stmoe'] / speed['accelerate']:.2f}x ({how})")
    print(f"  {verdict(ok):8} stmoe at {args.capacity} faster than mmap and accelerate at the "
          "same bound")
    return {"runs": runs, "bound_by": how, "met": ok}


def all_cached(args: argparse.Namespace) -> dict[str, Any]:
    """Every expert cached (warm) against plain transformers with the whole model in RAM."""
    cached, plain = [], []
    for rnd in range(args.rounds):  # interleaved, rotated, as the other sections
        for system in rotated(["all-cached", "resident"], rnd):
            (cached if system == "all-cached" else plain).append(spawn(args, system, "disk"))
    ratio = statistics.median(c["decode_tokens_per_s"] for c in cached) / statistics.median(
        p["decode_tokens_per_s"] for p in plain)
    print(
        f"\nevery expert cached (warm): {spread([c['decode_tokens_per_s'] for c in cached])} "
        f"tok/s; plain transformers (whole model in RAM): "
        f"{spread([p['decode_tokens_per_s'] for p in plain])} tok/s; ratio {ratio:.2f}"
    )
    print(f"  {verdict(ratio >= 0.9):8} every expert cached >= 0.9x plain transformers")
    return {"stmoe": cached, "plain": plain, "ratio": ratio}


def held_out(args: argparse.Namespace) -> None:
    """The tables' routing: ``--profile-on`` others, or the tokens before ``--split-at``
    (HELD-OUT), or with ``--in-sample`` the replayed sequence itself; by default the
    shared sample is split at ``SAMPLE_SPLIT``, and another trace needs one said."""
    given = [name for name, on in (("--profile-on", args.profile_on),
                                   ("--split-at", args.split_at),
                                   ("--in-sample", args.in_sample)) if on]
    if len(given) > 1:
        raise SystemExit(f"{' and '.join(given)}: give one of them (the tables' routing)")
    if given:
        return
    if Path(args.trace) != SAMPLE:
        raise SystemExit(f"--trace {args.trace}: say what the tables are profiled on: "
                         "--profile-on OTHER.npz (other prompts), --split-at TOKEN (the "
                         "tokens before it) or --in-sample (the replayed sequence itself, "
                         "an upper bound)")
    args.split_at = SAMPLE_SPLIT


def set_layers(args: argparse.Namespace) -> None:
    """``args.cut``: the ``--layers`` text (N or A:B); ``args.layers``: how many."""
    from stmoe.util.units import UnitError, parse_layer_range

    args.cut = str(args.layers).strip()
    try:
        start, stop = parse_layer_range(args.cut, 10**6)
    except UnitError as exc:
        raise SystemExit(f"error: {exc}") from None
    args.layers = stop - start
    args.cut_start = start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--like", default=PRESET, help="the simulator model preset whose shape the checkpoint takes"
    )
    ap.add_argument(
        "--trace",
        type=Path,
        default=SAMPLE,
        help="the routing replayed (recorded from a model of --like's shape)",
    )
    ap.add_argument("--layers", default="8",
                    help="MoE layers: N (the first N) or A:B (a cut from the middle: a "
                    "checkpoint of B-A layers routed as the trace's layers A..B-1)")
    ap.add_argument(
        "--tokens",
        type=int,
        default=129,
        help="new tokens per replay (<= 129: the sample's 128 decode tokens and the first); "
        "this machine's speed wanders over seconds, a longer run averages more of it",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiers", default="disk,emulated")
    ap.add_argument("--bandwidth", default="1GB", help="the emulated link (bytes/s)")
    ap.add_argument(
        "--emulated-layers",
        type=int,
        default=0,
        help="MoE layers of the emulated tier's runs (default: as many as keep its "
        "in-RAM store and cache within half the RAM; at most --layers)",
    )
    ap.add_argument("--capacity", default="50%")
    ap.add_argument("--threads", type=int, default=1, help="torch compute threads")
    ap.add_argument(
        "--baseline-tokens",
        type=int,
        default=16,
        help="new tokens per run of mmap and accelerate at the bound (slow)",
    )
    ap.add_argument(
        "--drop-pages",
        action="store_true",
        help="bound the baselines by dropping the checkpoint's pages before every "
        "forward call instead of a memory cgroup (the bound's worst case)",
    )
    ap.add_argument("--skip", default="", help="sections to skip: tiers,bounded,cached")
    ap.add_argument(
        "--profile-on",
        default="",
        help="traces (comma-separated) the tables are profiled on, OTHER than --trace: "
        "HELD-OUT figures (default: the shared sample split at token 100, --split-at)",
    )
    ap.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"systems of the tier runs (of {', '.join(SYSTEMS)}; the -all ones: admission "
        "off, every predicted load)",
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="run `stmoe calibrate` in each round of each tier (a preset per round, for "
        "bench_sim_check.py: the tier measured when the runs were)",
    )
    ap.add_argument(
        "--split-at",
        type=int,
        default=0,
        help="held-out by tokens (a trace of one sequence): profile the tables on its tokens "
        "before this one, replay the tokens from it on",
    )
    ap.add_argument("--in-sample", action="store_true",
                    help="tables profiled on the replayed sequence itself: IN-SAMPLE, an "
                    "upper bound of every table predictor (printed so)")
    ap.add_argument("--split-prompt", type=int, default=8,
                    help="with --split-at: the profiled tokens just before it replayed as the "
                    "prompt (its forward call is not timed)")
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--tier", default="disk", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", help=argparse.SUPPRESS)
    args = ap.parse_args()
    set_layers(args)
    held_out(args)
    if args.one:  # a child process: one run, its JSON on the last line
        fn = run_baseline if args.one in BASELINES else run_one
        print(json.dumps(fn(args)))
        return
    model_dir, _, _ = prepare(args)
    try:  # the trace must fit the model before any run starts
        config = json.loads((model_dir / "config.json").read_text())
        plan = replay_plan(args, argparse.Namespace(**config))
    except StmoeError as exc:
        raise SystemExit(f"error: {exc}") from None
    args.tokens = min(args.tokens, plan.new_tokens)  # what each replay runs (recorded)
    resident, limit = memory_budget(args)
    args.budget = resident
    args.started = time.strftime("%Y%m%d-%H%M%S")
    skip = set(args.skip.split(","))
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not {"lru-only", "oracle"} <= set(systems):
        raise SystemExit(f"--systems {args.systems}: unknown {unknown}; lru-only and oracle "
                         f"are needed (the gap); choose from {', '.join(SYSTEMS)}")
    results: dict[str, Any] = {
        "budget": resident, "bound": limit,
        "setup": {"like": args.like, "trace": str(args.trace), "layers": args.cut,
                  "profile_on": args.profile_on, "split_at": args.split_at,
                  "split_prompt": args.split_prompt, "capacity": args.capacity,
                  "tokens": args.tokens, "held_out": not args.in_sample},
    }
    for tier in [] if "tiers" in skip else args.tiers.split(","):
        targs = args
        if tier == "emulated":
            n = emulated_layers(args)
            start = args.cut_start
            cut = str(n) if args.cut == str(args.layers) else f"{start}:{start + n}"
            targs = argparse.Namespace(**{**vars(args), "layers": n, "cut": cut})
            prepare(targs)  # its checkpoint and store, built once
            print(f"\nthe emulated tier holds its whole store in RAM: its runs take the first "
                  f"{targs.layers} MoE layers (--emulated-layers)", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        presets: list[str] = []  # with --calibrate: one hardware preset per round
        for rnd in range(args.rounds):
            for system in rotated(systems + (["calibrate"] if args.calibrate else []), rnd):
                if system == "calibrate":
                    presets.append(str(calibrate(targs, tier, rnd)))
                    print(f"[{tier} round {rnd + 1}] calibrate: {presets[-1]}", flush=True)
                    continue
                runs[system].append(spawn(targs, system, tier))
                print(
                    f"[{tier} round {rnd + 1}] {system}: "
                    f"{runs[system][-1]['decode_tokens_per_s']:.2f} tok/s",
                    flush=True,
                )
        results[tier] = {"layers": targs.layers, "cut": targs.cut, "tokens": args.tokens,
                         "runs": runs, "presets": presets, **report(tier, runs, targs.layers,
                                                                tables_label(args))}
    if "bounded" not in skip:
        results["bounded"] = bounded(args, limit)
    if "cached" not in skip:
        results["all_cached"] = all_cached(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
