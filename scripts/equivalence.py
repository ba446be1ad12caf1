"""Behaviour-equivalence check for restructurings: run a fixed set of commands and API
calls, keep every output that must not change, and compare two such runs.

Why: a restructuring (moved modules, renamed classes) must leave what stmoe computes
identical. This script uses only the CLI and import paths that stay valid across a
restructuring (old paths are kept as re-exports), so the same file runs on the commit
before and the commit after:

    python scripts/equivalence.py run /tmp/eq/before     # on the old commit
    python scripts/equivalence.py run /tmp/eq/after      # on the new commit
    python scripts/equivalence.py compare /tmp/eq/before /tmp/eq/after

What is kept: replay plans of every predictor (their CSR arrays' SHA-256), `stmoe eval`
and `stmoe simulate` JSON, `stmoe info`/`analyze` JSON, traces written by capture, synth,
import and export (their arrays), and generated tokens of `stmoe generate` (every
predictor, tier and capacity form; forced routing) and of `stmoe.offload`. What is left
out: wall-clock figures (seconds, tokens/s, stall), paths, and the counters of runs whose
prefetch is asynchronous (when a worker's read lands depends on timing, never on code).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

# Keys whose values are timings or machine-dependent; dropped from every JSON compared.
VOLATILE = re.compile(
    r"(_s$|_ms$|per_s|tok_s|tokens_per_s|seconds|time|stall|wall|elapsed|date|created|"
    r"store|path|output|version|rss|peak|read_s|busy)"
)


def _sh(args: list[str], cwd: Path) -> None:
    print("$ " + " ".join(args), flush=True)
    subprocess.run(args, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def _clean(obj: Any, keep_counters: bool = True) -> Any:
    """The JSON with volatile keys removed; floats rounded to 12 digits."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if VOLATILE.search(k):
                continue
            out[k] = _clean(v, keep_counters)
        return out
    if isinstance(obj, list):
        return [_clean(v, keep_counters) for v in obj]
    if isinstance(obj, float):
        return round(obj, 12)
    return obj


def _trace_digest(path: Path) -> dict[str, str]:
    import numpy as np

    from stmoe import load_trace

    t = load_trace(path)
    out = {}
    for name in ("experts", "weights", "is_decode", "seq_starts"):
        arr = getattr(t, name, None)
        if arr is not None:
            a = np.ascontiguousarray(arr)
            out[name] = f"{a.dtype}{a.shape}:" + hashlib.sha256(a.tobytes()).hexdigest()
    return out


def _plans(trace_path: Path, tables_path: Path) -> dict[str, str]:
    """SHA-256 of every registered predictor's replay plan on the trace."""
    import numpy as np

    from stmoe import load_trace
    from stmoe.predictors import ModelShape, make, names_for
    from stmoe.predictors.tables import load_tables

    trace = load_trace(trace_path)
    tables = load_tables(tables_path)
    shape = ModelShape.of(trace)
    out = {}
    for name in names_for(trace):
        try:
            pred = make(name, shape, tables)
        except Exception as exc:  # a predictor this trace cannot run: record that
            out[name] = f"refused: {type(exc).__name__}"
            continue
        plan = pred.plan(trace)
        h = hashlib.sha256(np.ascontiguousarray(plan.ptr).tobytes())
        h.update(np.ascontiguousarray(plan.ids).tobytes())
        out[name] = h.hexdigest()
    return out


def _generate(work: Path, name: str, args: list[str], deterministic: bool) -> dict[str, Any]:
    out = work / f"gen-{name}.json"
    _sh(["stmoe", "generate", *args, "--json", str(out)], work)
    d = json.loads(out.read_text())
    kept = {k: d[k] for k in ("tokens", "text", "prompt_tokens", "decode_tokens") if k in d}
    kept["config"] = _clean(d.get("config", {}))
    if deterministic:
        kept["stats"] = _clean(d.get("stats", {}))
    return kept


def run(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "work"
    work.mkdir(exist_ok=True)
    os.environ["STMOE_CACHE"] = str(work / "cache")
    result: dict[str, Any] = {}

    _sh(["stmoe", "capture", "-o", "tiny.npz", "--max-new-tokens", "12"], work)
    _sh(["stmoe", "synth", "-o", "synth.npz", "--tokens", "3000", "--layers", "8",
         "--experts", "16", "--top-k", "4", "--sequences", "4", "--spatial", "0.8",
         "--temporal", "0.3", "--seed", "1"], work)
    _sh(["stmoe", "export", "tiny.npz", "-o", "vllm.json", "--format", "vllm"], work)
    _sh(["stmoe", "import", "vllm.json", "-o", "vllm.npz"], work)
    _sh(["stmoe", "export", "tiny.npz", "-o", "tiny.jsonl", "--format", "jsonl"], work)
    _sh(["stmoe", "import", "tiny.jsonl", "-o", "jsonl.npz"], work)
    for t in ("tiny", "synth", "vllm", "jsonl"):
        result[f"trace:{t}"] = _trace_digest(work / f"{t}.npz")

    for t in ("tiny", "synth"):
        _sh(["stmoe", "profile", f"{t}.npz", "--split", "0.5", "-o", f"{t}.tables.npz"], work)
        result[f"plans:{t}"] = _plans(work / f"{t}.npz", work / f"{t}.tables.npz")
        _sh(["stmoe", "eval", f"{t}.npz", "--tables", f"{t}.tables.npz", "--split", "0.5",
             "--capacity", "8", "--json", f"eval-{t}.json"], work)
        result[f"eval:{t}"] = _clean(json.loads((work / f"eval-{t}.json").read_text()))
        _sh(["stmoe", "info", f"{t}.npz", "--json", f"info-{t}.json"], work)
        result[f"info:{t}"] = _clean(json.loads((work / f"info-{t}.json").read_text()))
    _sh(["stmoe", "eval", "synth.npz", "--tables", "synth.tables.npz", "--split", "0.5",
         "--capacity", "6", "--policy", "belady", "--set-size", "6", "--adaptive",
         "--json", "eval-synth-b.json"], work)
    result["eval:synth-belady"] = _clean(json.loads((work / "eval-synth-b.json").read_text()))

    _sh(["stmoe", "simulate", "tiny.npz", "--model", "stmoe-tiny", "--hardware", "stmoe-asic",
         "--json", "sim.json"], work)
    result["simulate:tiny"] = _clean(json.loads((work / "sim.json").read_text()))
    _sh(["stmoe", "simulate", "synth.npz", "--model", "stmoe-tiny", "--hardware",
         "gpu-offload", "--batch", "2", "--json", "sim2.json"], work)
    result["simulate:synth-batch2"] = _clean(json.loads((work / "sim2.json").read_text()))
    _sh(["stmoe", "analyze", "tiny.npz", "-o", "report", "--json", "analysis.json"], work)
    result["analyze:tiny"] = _clean(json.loads((work / "analysis.json").read_text()))

    common = ["--max-new-tokens", "10", "--tier", "emulated", "--bandwidth", "1GB"]
    prompt = ["--prompt", "def fib(n):"]
    # on-demand with LRU and no prefetch: every counter is a function of the routing alone
    result["gen:ondemand"] = _generate(
        work, "ondemand", [*prompt, *common, "--predictor", "ondemand"], True)
    result["gen:none"] = _generate(
        work, "none", [*prompt, *common, "--predictor", "ondemand", "--policy", "none"], True
    )
    for pred in ("stmoe", "stmoe-plus", "hybrid", "oracle"):
        result[f"gen:{pred}"] = _generate(
            work, pred, [*prompt, *common, "--predictor", pred, "--capacity", "25%"], False
        )
    result["gen:disk-bytes"] = _generate(
        work, "disk", [*prompt, "--max-new-tokens", "6", "--capacity", "10MB"], False
    )
    result["gen:routing"] = _generate(
        work, "routing", ["--routing", "tiny.npz", "--sequence", "1", *common[2:],
                          "--predictor", "stmoe"], False)
    result["api:offload"] = _api_offload()
    result["serve:bf16"] = _serve_tokens(None)
    result["serve:int4"] = _serve_tokens("int4")

    (out_dir / "equivalence.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"wrote {out_dir / 'equivalence.json'}: {len(result)} entries")


def _api_offload() -> dict[str, Any]:
    """Tokens of ``stmoe.offload(...).generate`` on the shipped model (with a forced
    routing replay too, where the API offers one)."""
    import stmoe
    from stmoe.models import SHIPPED_MODEL

    out: dict[str, Any] = {}
    with stmoe.offload(SHIPPED_MODEL, capacity="50%", predictor="stmoe", tier="emulated",
                       bandwidth="2GB") as off:
        res = off.generate("The cat sat on", max_new_tokens=8)
        out["offloaded"] = list(res.tokens)
        out["prompt_tokens"] = res.prompt_tokens
    with stmoe.offload(SHIPPED_MODEL, capacity=4, predictor="ondemand", policy="lfu") as off:
        res = off.generate("Once upon a time", max_new_tokens=6)
        out["ondemand-lfu"] = {"tokens": list(res.tokens), "stats": _clean(res.stats)}
    return out


SERVE_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24], [30, 31, 32, 33]]
SERVE_LENGTHS = [9, 4, 7, 5]


def _serve_tokens(quantized: str | None) -> dict[str, Any]:
    """Tokens of four requests served together by the step batcher on the shipped model at
    25% cached (bf16: each request's own forward; int4 with its resident linears quantized:
    one batched forward per decode step), and each request alone on the same model."""
    import torch
    from stmoe.runtime.batching import Request, StepBatcher

    import stmoe
    from stmoe.models import SHIPPED_MODEL

    extra = {"format": quantized, "quantize_resident": quantized} if quantized else {}
    with stmoe.offload(SHIPPED_MODEL, capacity="25%", predictor="stmoe-plus", **extra) as off:
        batcher = StepBatcher(off, max_batch=4)
        try:
            reqs = [batcher.submit(Request(torch.tensor([p]), n))
                    for p, n in zip(SERVE_PROMPTS, SERVE_LENGTHS, strict=True)]
            together = [list(r.wait(300)) for r in reqs]
        finally:
            batcher.close()
        alone = [list(off.generate(p, max_new_tokens=n).tokens)
                 for p, n in zip(SERVE_PROMPTS, SERVE_LENGTHS, strict=True)]
    return {"together": together, "alone": alone}


def compare(a: Path, b: Path) -> int:
    # cleaned again: a run written before a key was known to be volatile compares by today's list
    da = _clean(json.loads((a / "equivalence.json").read_text()))
    db = _clean(json.loads((b / "equivalence.json").read_text()))
    bad = 0
    for key in sorted(set(da) | set(db)):
        if da.get(key) != db.get(key):
            bad += 1
            print(f"DIFFERENT  {key}")
        else:
            print(f"identical  {key}")
    print(f"{len(set(da) | set(db)) - bad} identical, {bad} different")
    return 1 if bad else 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        run(Path(sys.argv[2]).resolve())
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        return compare(Path(sys.argv[2]), Path(sys.argv[3]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
