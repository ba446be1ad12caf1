"""Running again only some of a former run's stages (``gpu_check.py --rerun JSON``): the ones
that did not finish ok, or those named, the rest kept from it.

Why: a GPU is lent rarely and briefly, and a stage that failed on a bug fixed since should
not cost the whole check's time again. What is kept says which run it came from; runs on
another device, or a dry run beside a real one, are refused (their figures do not mix);
and a stage whose input is run again is run again too (accelerate's identity and
calibrate's comparison read the decode table's), so no target reads a stage against a
stale one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stmoe.errors import StmoeError

# the stages that read another stage's record: run again whenever that one is
READS = {"accelerate_offload": ("decode_table",), "calibrate_simulator": ("decode_table",)}


def rerun_plan(earlier: dict[str, Any], names: Sequence[str] | None,
               order: Sequence[str]) -> list[str]:
    """The stages to run again, in ``order``: ``names``, else every one the earlier run did
    not finish ok; with each stage that reads one of them, and the environment (this
    machine's, cheap) always."""
    unknown = [n for n in names or [] if n not in order]
    if unknown:
        raise StmoeError(f"no stage {', '.join(map(repr, unknown))}; the stages are "
                         f"{', '.join(order)}")
    done = earlier.get("stages", {})
    wanted = (set(names) if names else
              {n for n in order if done.get(n, {}).get("status") != "ok"})
    wanted |= {reader for reader, sources in READS.items() if wanted.intersection(sources)}
    wanted.add("environment")
    return [n for n in order if n in wanted]


def keep_earlier(doc: dict[str, Any], earlier: dict[str, Any], rerun: set[str]) -> None:
    """Into ``doc`` (a run starting), ``earlier``'s stages it does not run again, each with
    ``from_run`` (the commit and start of the run that made it)."""
    for key, what in (("dry_run", "a dry run's and a GPU run's"),
                      ("device", "two devices'")):
        if earlier.get(key) != doc.get(key):
            raise StmoeError(f"the earlier run's {key} is {earlier.get(key)!r}, this run's "
                             f"{doc.get(key)!r}: {what} stages do not mix; run the whole "
                             "check instead")
    came = {"commit": earlier.get("commit"), "started": earlier.get("started")}
    kept = [n for n in earlier.get("stages", {}) if n not in rerun]
    doc["rerun_of"] = {**came, "kept": kept}
    for name in kept:
        doc["stages"][name] = {**earlier["stages"][name], "from_run": came}


def read_rerun(path: Path | None, stages: str | None,
               order: Sequence[str]) -> tuple[dict[str, Any] | None, list[str] | None]:
    """``--rerun PATH [--stages a,b]`` read: (the former run's document, the stages to run
    again), or (None, None) without ``path``; a clear error naming the file otherwise."""
    if path is None:
        if stages:
            raise StmoeError("--stages names the stages --rerun runs again; give --rerun too")
        return None, None
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StmoeError(f"--rerun {path}: {exc}") from exc
    if not isinstance(earlier, dict) or not isinstance(earlier.get("stages"), dict):
        raise StmoeError(f"--rerun {path}: not a GPU check's JSON (no 'stages' object)")
    names = [n.strip() for n in stages.split(",") if n.strip()] if stages else None
    return earlier, rerun_plan(earlier, names, order)
