"""Driving ``python -m stmoe.vllm_plugin.runs`` from the plugin's tests: one process for a
list of runs (each starts its own engine, reading STMOE_VLLM as it starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROMPTS = ["def fib(n):", "The history of Rome", "Let x be a real number such that",
           "import numpy as np\n", "Once upon a time", "SELECT name FROM", "The derivative of",
           "class Stack:"]
BATCHES = [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [0], [5]]


def run_env(tmp: Path) -> dict[str, str]:
    """The runs' environment: a small KV cache, the plugin's stores under ``tmp``."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "STMOE_CACHE": str(tmp / "cache")}


def start(tmp: Path, spec: dict) -> subprocess.CompletedProcess:
    """The runs of ``spec`` (its JSON under ``tmp``), finished or failed."""
    (tmp / "spec.json").write_text(json.dumps(spec))
    return subprocess.run([sys.executable, "-m", "stmoe.vllm_plugin.runs", str(tmp / "spec.json"),
                           str(tmp / "out.json")], capture_output=True, text=True,
                          env=run_env(tmp), timeout=900)


def drive(tmp: Path, model: Path, runs: list[dict],
          **spec: object) -> tuple[dict[str, dict], str]:
    """Every run's results by its name (they must all succeed) and the log. The engines run
    in the one process (``in_process``: no vLLM process started per run, a ninth of the
    time); the documented commands' tests (test_docs.py) and the refusals run vLLM's own
    processes, as users do."""
    p = start(tmp, {"model": str(model), "prompts": PROMPTS, "runs": runs, "in_process": True,
                    **spec})
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    results = json.loads((tmp / "out.json").read_text())["runs"]
    by_name = {r["name"]: r for r in results}
    assert len(by_name) == len(results), "two runs share a name"
    return by_name, log
