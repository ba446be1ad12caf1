"""The GPU check's record: one JSON rewritten after every stage, each stage in its own
try/except, and the targets the issue fixes as ``{name, met, value, goal}``.

Why: the check runs once on a borrowed machine; a stage that fails or a run cut short must
still leave what was measured, and a dry run on the CPU must never claim a target.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

KIB, MIB = 1 << 10, 1 << 20


class Check:
    """The run: its JSON (``doc``), written after every stage, and the clock."""

    def __init__(self, out: Path, dry: bool, commit: str, budget_s: float, *,
                 tokens: int = 4, repo: Path | None = None) -> None:
        import torch

        self.torch: ModuleType = torch
        self.out, self.dry, self.tokens, self.repo = out, dry, tokens, repo
        self.cuda = torch.cuda.is_available() and not dry
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.t0, self.budget_s = time.perf_counter(), budget_s
        self.doc: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if self.cuda else "cpu (dry run)",
            "commit": commit, "dry_run": dry,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stages": {}, "targets": []}

    def stage(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        started = time.perf_counter()
        if started - self.t0 > self.budget_s:
            rec: dict[str, Any] = {"status": "skipped", "why": "over the time budget"}
        else:
            try:
                rec = {"status": "ok", **fn()}
            except Exception as exc:  # recorded; the next stage runs
                rec = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-3000:]}
        rec["seconds"] = round(time.perf_counter() - started, 2)
        self.doc["stages"][name] = rec
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {name}: {rec['status']}", flush=True)
        self.write()

    def target(self, name: str, met: bool | None, value: object, goal: str,
               note: str = "") -> None:
        """One target; a dry run's are never met or not (its figures measure nothing): what
        they would say is kept as ``dry_run_met``."""
        rec = {"name": name, "met": None if self.dry else met, "value": value, "goal": goal}
        if self.dry:
            rec.update(dry_run_met=met, note="dry run on the CPU: not a measurement")
        elif note:
            rec["note"] = note
        self.doc["targets"].append(rec)

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        tmp.replace(self.out)

    def timed(self, fn: Callable[[], object], reps: int, trials: int = 5) -> float:
        """Median seconds of one ``fn()`` (CUDA events around ``reps`` calls, each trial)."""
        torch = self.torch
        fn()  # warm
        samples = []
        for _ in range(trials):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / reps)
            else:
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                samples.append((time.perf_counter() - t) / reps)
        return statistics.median(samples)


TODO = {
    "decode_table": "decode tok/s, hit rate, PCIe bytes, stall share and achieved copy "
                    "bandwidth for the GPU-resident model, on-demand, lru-only, stmoe, "
                    "stmoe-plus and the oracle at 25% and 50% of the experts in HBM, from "
                    "pinned memory and from disk, on a Qwen3.6-35B-A3B-shaped checkpoint "
                    "(stmoe make-model, random weights, 4-8 layers) replaying held-out "
                    "routing: needs the engine's asynchronous GPU path (issue 43 item 1) "
                    "and the disk -> GPU tier as a --tier",
    "accelerate_offload": "accelerate's offload (device_map with the experts on the CPU at "
                          "the same HBM budget): needs the decode table's checkpoint and "
                          "budget",
    "calibrate_simulator": "stmoe calibrate on the GPU and the simulator's prediction beside "
                           "the measured figures: needs the decode table",
}
PENDING_TARGETS = [
    ("bit-identical to the GPU-resident model in the same format, every family, every "
     "predictor, bf16 and int4", "all identical"),
    ("50% in HBM from pinned: stmoe-plus vs lru-only decode", ">= 1.0x"),
    ("50% in HBM from pinned: share of the lru-only -> oracle gap stmoe-plus closes",
     ">= 50% on held-out routing"),
    ("stmoe-plus vs accelerate's offload decode", ">= 5x"),
    ("on-demand's achieved copy bandwidth vs the measured pinned peak", ">= 70%"),
    ("stmoe-plus vs the GPU-resident model's decode", ">= 0.6x"),
    ("the simulator calibrated on the GPU vs every measured system", "within 20%"),
]


def targets(c: Check) -> None:
    """Every target, read off the stages' records (a stage that did not run: no figure)."""
    st = c.doc["stages"]
    h = st.get("h2d", {})
    if h.get("status") == "ok":
        big = [r for r in h["sizes"] if r["bytes"] >= 64 * MIB] or h["sizes"][-1:]
        ratio = min(r["registered_GBps"] / r["pinned_GBps"] for r in big)
        c.target("the pinned store's registered mapping copies as fast as torch's pinned "
                 "memory (>= 64 MiB)", ratio >= 0.9, round(ratio, 3), ">= 0.9x")
    k = st.get("kernels", {})
    for fmt in ("int8", "int4"):
        errs = [v["rel_err"] for key, v in k.get("results", {}).items() if f"_{fmt}" in key]
        c.target(f"CUDA {fmt} weight-only kernel on the stored layout computes the "
                 "dequantized matrix (max error / max value)",
                 (max(errs) <= 0.02) if errs else None, max(errs) if errs else None, "<= 0.02")
    t = st.get("cuda_tests", {})
    c.target("the cuda-marked tests pass", (t.get("returncode") == 0) if t.get("ran") else None,
             t.get("summary"), "all pass")
    g = st.get("tier_gpu", {})
    runs = g.get("runs", [])
    same = [r["identical"] for r in runs]
    c.target("today's --tier gpu: greedy tokens identical to the GPU-resident shipped model",
             all(x is True for x in same) if same else None,
             f"{sum(x is True for x in same)} of {len(same)} runs" if same else None,
             "all identical")
    for name, goal in PENDING_TARGETS:
        c.target(name, None, None, goal, "not measured: a todo stage (engine's GPU path)")


def target_lines(doc: dict[str, Any]) -> list[str]:
    """One line per target: MET, NOT MET or n/a (a dry run's, or a figure not measured)."""
    marks = {True: "MET", False: "NOT MET", None: "n/a"}
    return [f"{marks[t['met']]:8} {t['name']}: {t['value']} (goal {t['goal']})"
            for t in doc["targets"]]


def git_head(repo: Path) -> str:
    """The checkout's commit, or "unknown" (no git, not a checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
