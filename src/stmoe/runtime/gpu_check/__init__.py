"""The prepared GPU check of issue 43 (``benchmarks/gpu_check.py`` is its CLI; docs/runtime.md):
every stage in turn, each failing alone, one JSON rewritten after each; the targets, none
claimed by a dry run.

    setup.py      the decode table's checkpoint, store, held-out routing and tables
    decode.py     the decode table: the GPU-resident model and every system, tier, capacity
    baselines.py  accelerate's offload at the same HBM budget; calibrate and the simulator
    stages.py     every stage, in order (STAGES)
    record.py     the run's JSON and clock (``Check``)
    targets.py    the targets as {name, met, value, goal}
    rerun.py      a former run's stages kept, the failed ones (or those named) run again
    forecast.py   the decode table's targets forecast by the simulator (no GPU; ASSUMED
                  costs or a calibrated preset): benchmarks/gpu_forecast.py

Why in the package: the check runs once on a borrowed GPU machine, so its plumbing is
tested here on the CPU (``dry_run=True``: tiny sizes, the CPU's stand-in for a GPU, no
figure means anything) by calling ``run_stages``, never by running the benchmark.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stmoe.runtime.gpu_check.record import Check, git_head
from stmoe.runtime.gpu_check.rerun import keep_earlier, rerun_plan
from stmoe.runtime.gpu_check.setup import prepare_routing
from stmoe.runtime.gpu_check.stages import STAGES, Stage
from stmoe.runtime.gpu_check.targets import target_lines, targets

__all__ = ["STAGES", "Check", "Stage", "git_head", "prepare_routing", "rerun_plan",
           "run_stages", "target_lines"]


def run_stages(out: Path, *, dry_run: bool = False, commit: str = "unknown",
               repo: Path | None = None, tokens: int | None = None, budget_s: float = 420.0,
               stages: Mapping[str, Stage] | None = None, layers: int | None = None,
               routing: Path | None = None, real_shape: bool = False,
               earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """Runs ``stages`` (default ``STAGES``) in order, then the targets, and returns the
    document written to ``out``. ``repo``: the checkout (its cuda-marked tests; its carried
    routing, ``setup.CARRIED``); ``tokens``: new tokens per generation (4 dry, else 64);
    ``layers``: the decode table's MoE layers (2 dry, else 4); ``routing``: a trace file in
    place of the carried one; stages still to start after ``budget_s`` are skipped;
    ``real_shape`` with ``dry_run``: the rehearsal (the real checkpoint's shape, one layer,
    and the recorded routing, on the CPU: what the GPU run will make and read, minus CUDA).
    ``earlier``: a former run's document (``rerun.rerun_plan``), whose stages not in
    ``stages`` are kept, each marked with the run it came from."""
    c = Check(out, dry_run, commit, budget_s, tokens=tokens or (4 if dry_run else 64),
              repo=repo, layers=layers, routing=routing, real_shape=real_shape)
    c.read_targets = targets
    chosen = dict(STAGES if stages is None else stages)
    if earlier is not None:
        keep_earlier(c.doc, earlier, set(chosen))
    if not c.cuda and not dry_run:  # the environment says why; nothing else can be measured
        c.doc["note"] = ("torch sees no GPU: only the environment stage ran (its record says "
                         "why); only --dry-run makes sense without one")
        chosen = {k: v for k, v in chosen.items() if k == "environment"}
    try:
        for name, fn in chosen.items():
            c.stage(name, lambda fn=fn: fn(c))  # (its write reads the targets again)
    finally:
        c.remove_work()  # the checkpoint and store made there
    if earlier is not None:  # the stages in the check's order, kept and run again alike
        st = c.doc["stages"]
        c.doc["stages"] = {n: st[n] for n in [*STAGES, *st] if n in st}
    c.write()
    return c.doc
