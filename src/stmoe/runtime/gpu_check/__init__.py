"""The prepared GPU check of issue 43 (``benchmarks/gpu_check.py`` is its CLI; docs/runtime.md):
every stage in turn, each failing alone, one JSON rewritten after each; the todo stages
named with what they need; the targets, none claimed by a dry run.

Why in the package: the check runs once on a borrowed GPU machine, so its plumbing is
tested here on the CPU (``dry_run=True``: tiny sizes, ordinary memory, no figure means
anything) by calling ``run_stages``, never by running the benchmark.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stmoe.runtime.gpu_check.record import TODO, Check, git_head, target_lines, targets
from stmoe.runtime.gpu_check.stages import STAGES, Stage

__all__ = ["STAGES", "TODO", "Check", "Stage", "git_head", "run_stages", "target_lines"]


def run_stages(out: Path, *, dry_run: bool = False, commit: str = "unknown",
               repo: Path | None = None, tokens: int | None = None, budget_s: float = 420.0,
               stages: Mapping[str, Stage] | None = None) -> dict[str, Any]:
    """Runs ``stages`` (default ``STAGES``) in order, records the todo stages and the
    targets, and returns the document written to ``out``. ``repo``: the checkout whose
    cuda-marked tests a real run runs; ``tokens``: per generation (4 dry, else 64); stages
    still to start after ``budget_s`` are skipped."""
    c = Check(out, dry_run, commit, budget_s, tokens=tokens or (4 if dry_run else 64),
              repo=repo)
    if not c.cuda and not dry_run:
        c.doc["note"] = "torch sees no GPU: only --dry-run makes sense here"
    for name, fn in (STAGES if stages is None else stages).items():
        c.stage(name, lambda fn=fn: fn(c))
    for name, why in TODO.items():
        c.doc["stages"][name] = {"status": "todo", "needs": why}
    targets(c)
    c.write()
    return c.doc
