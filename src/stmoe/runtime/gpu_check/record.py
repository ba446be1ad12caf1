"""The GPU check's record: one JSON rewritten after every stage, each stage in its own
try/except, and the targets the issue fixes as ``{name, met, value, goal}``.

Why: the check runs once on a borrowed machine; a stage that fails or a run cut short must
still leave what was measured, and a dry run on the CPU must never claim a target.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
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
                 tokens: int = 4, repo: Path | None = None, layers: int | None = None,
                 routing: Path | None = None, real_shape: bool = False) -> None:
        import torch

        self.torch: ModuleType = torch
        self.out, self.dry, self.tokens, self.repo = out, dry, tokens, repo
        # the decode table's checkpoint: tiny with synthetic routing (a dry run), or the real
        # shape with the recorded routing (the GPU run, and a dry run that rehearses it)
        self.tiny = dry and not real_shape
        self.layers, self.routing = layers, routing  # the decode table's (``setup``)
        self._work: Path | None = None  # ``work``, once a stage asks for it
        self.shared: dict[str, Any] = {}  # what one stage makes for the next
        # the targets read off ``doc`` at every write (``targets.targets``, set by run_stages)
        self.read_targets: Callable[[Check], None] | None = None
        self.cuda = torch.cuda.is_available() and not dry
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.t0, self.budget_s = time.perf_counter(), budget_s
        self.doc: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if self.cuda else "cpu (dry run)",
            "commit": commit, "dry_run": dry, **({"rehearsal": True} if dry and real_shape
                                                  else {}),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stages": {}, "targets": []}

    @property
    def work(self) -> Path:
        """Where the stages make their files (the checkpoint, its store): made when first
        asked for, so a check that makes none leaves no folder behind (``remove_work``)."""
        if self._work is None:
            self._work = Path(tempfile.mkdtemp(prefix="stmoe-gpu-check-"))
        return self._work

    def remove_work(self) -> None:
        """The stages' files gone (at the end of the run)."""
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def stage(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        started = time.perf_counter()
        if self.out_of_time():
            rec: dict[str, Any] = {"status": "skipped", "why": "over the time budget"}
        else:
            try:
                rec = {"status": "ok", **fn()}
            except Exception as exc:  # recorded; the next stage runs
                rec = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-3000:]}
        rec["seconds"] = round(time.perf_counter() - started, 2)
        self.doc["stages"][name] = rec
        print(f"[{self.elapsed():6.1f}s] {name}: {rec['status']}", flush=True)
        self.write()

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.t0

    def out_of_time(self, keep_s: float = 0.0) -> bool:
        """Whether the run is past its budget (a stage's own runs stop starting), or within
        ``keep_s`` of it (time kept for the stages after)."""
        return self.elapsed() > self.budget_s - keep_s

    def target(self, name: str, met: bool | None, value: object, goal: str,
               note: str = "") -> None:
        """One target; a dry run's, or one without CUDA, are never met or not (its figures
        measure nothing): what a dry run's would say is kept as ``dry_run_met``."""
        rec = {"name": name, "met": met if self.cuda else None, "value": value, "goal": goal}
        if self.dry:
            rec.update(dry_run_met=met, note="dry run on the CPU: not a measurement")
        elif note:
            rec["note"] = note
        self.doc["targets"].append(rec)

    def write(self) -> None:
        """The JSON as it stands, its targets read again first (``read_targets``): a run the
        machine's time limit kills (mid-stage, mid-table) still leaves every target its
        figures allow."""
        if self.read_targets is not None:
            self.doc["targets"] = []
            self.read_targets(self)
        self.doc["elapsed_s"] = round(self.elapsed(), 2)
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


def git_head(repo: Path) -> str:
    """The checkout's commit, or "unknown" (no git, not a checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
