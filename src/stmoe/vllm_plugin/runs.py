"""Runs of ``vllm.LLM`` with the plugin off and on, one process, one JSON: what the plugin's
tests and ``benchmarks/bench_vllm.py`` compare.

    python -m stmoe.vllm_plugin.runs SPEC.json OUT.json

Why one process for many runs: vLLM starts its engine core and worker by spawn, and each
reads ``STMOE_VLLM`` as it starts; so each run sets it (or removes it: plain vLLM), makes
an ``LLM``, generates, and shuts the engine down, and the next run starts afresh. The spec:

    {"model": DIR, "dtype": "float32", "max_model_len": 512, "prompts": [...],
     "runs": [{"name": "plain", "stmoe": null, "max_tokens": 16,
               "batches": [[0, 1, 2, 3]], "rounds": 1, "routed": false}, ...]}

Each batch is one ``generate`` call of those prompts (its requests run concurrently, by
vLLM's continuous batching), greedy with ``ignore_eos``. Per run: each batch's tokens (the
last round's; ``rounds_tokens``: every round's), each round's seconds (after one warm-up
batch), and with ``routed`` vLLM's own routed experts.
``tables_swap: [SRC, DST]`` replaces DST (the run's tables) with SRC before round 2; an
entry's ``dtype`` and ``model`` override the spec's.

``"in_process": true`` runs every engine in this process (vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: on CPU, its engine core and worker too), the plugin
installed and uninstalled for each run here rather than by vLLM's plugin hook: no process
started and no vLLM imported per run (a run of the shipped model took 4-6 s so against
about 35 s on the 2-core VM of 2026-12-08), the same tokens. Without it (the default, and
bench_vllm.py's) each run starts vLLM's own processes, as users run it.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ENV = "STMOE_VLLM"
# How long an engine's processes get to exit before they are killed. vLLM's default is 5 s,
# and its CPU engine core lingers past its workers' exit until killed, every time: each run
# paid 5 s for nothing. Its worker exits on its own when its parent goes.
SHUTDOWN_S = 3.0


def make_llm(model: str, dtype: str, *, max_model_len: int = 512, prefix_caching: bool = True,
             routed: bool = False, eager: bool = True) -> Any:
    """A ``vllm.LLM`` as the plugin's tests and benchmark run it (CPU, eager, seed 0); it
    reads STMOE_VLLM as its engine starts."""
    from vllm import LLM

    return LLM(model=model, dtype=dtype, enforce_eager=eager, max_model_len=max_model_len,
               seed=0, gpu_memory_utilization=0.1, enable_prefix_caching=prefix_caching,
               enable_return_routed_experts=routed)


def run(spec: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """One run of ``spec``: an LLM with ``entry``'s plugin setting, its batches timed."""
    from vllm import SamplingParams

    if entry.get("stmoe"):
        os.environ[ENV] = entry["stmoe"]
    else:
        os.environ.pop(ENV, None)
    if spec.get("in_process"):  # vLLM calls the plugin's hook once a process: each run's own
        from stmoe.vllm_plugin.install import install, uninstall

        uninstall()
        if entry.get("stmoe"):
            install(entry["stmoe"])
    llm = make_llm(entry.get("model", spec["model"]),
                   entry.get("dtype", spec.get("dtype", "float32")),
                   max_model_len=spec.get("max_model_len", 512),
                   prefix_caching=bool(spec.get("prefix_caching", True)),
                   routed=bool(entry.get("routed")), eager=bool(spec.get("eager", True)))
    try:
        params = SamplingParams(temperature=0, max_tokens=entry["max_tokens"], ignore_eos=True)
        prompts = spec["prompts"]
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2),
                     use_tqdm=False)  # warm-up: the first call's one-time costs
        rounds: list[float] = []
        each_round: list[list[list[list[int]]]] = []  # each round's: batch, request, tokens
        routed: list[list[list]] = []
        for r in range(entry.get("rounds", 1)):
            if r == 1 and entry.get("tables_swap"):  # new tables while serving
                src, dst = (Path(p) for p in entry["tables_swap"])
                tmp = dst.with_suffix(".swap.npz")
                shutil.copyfile(src, tmp)
                os.replace(tmp, dst)  # whole, with a new mtime: what the plugin watches
            started = time.perf_counter()
            outs = [llm.generate([prompts[i] for i in batch], params, use_tqdm=False)
                    for batch in entry["batches"]]
            rounds.append(time.perf_counter() - started)
            each_round.append([[list(o.outputs[0].token_ids) for o in batch]
                               for batch in outs])
            if entry.get("routed"):
                routed = [[o.outputs[0].routed_experts.tolist() for o in batch]
                          for batch in outs]
        # one more request: vLLM tells the worker of the finished ones at its next step
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
        tokens = each_round[-1] if each_round else []
        new = sum(len(t) for batch in tokens for t in batch)
        return {"name": entry["name"], "stmoe": entry.get("stmoe"), "tokens": tokens,
                "rounds_s": rounds, "new_tokens": new, "routed": routed or None,
                "rounds_tokens": each_round}
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
        del llm
        gc.collect()


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python -m stmoe.vllm_plugin.runs SPEC.json OUT.json")
    spec = json.loads(Path(argv[0]).read_text())
    if spec.get("in_process"):  # before vLLM is imported: its engine in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    out = Path(argv[1])
    results: list[dict[str, Any]] = []
    for entry in spec["runs"]:
        results.append(run(spec, entry))
        out.write_text(json.dumps({"runs": results}))  # after each run: a crash keeps them
        print(f"stmoe runs: {entry['name']} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
