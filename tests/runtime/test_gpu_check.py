"""The prepared GPU check (stmoe.runtime.gpu_check, which benchmarks/gpu_check.py runs) goes
end to end on the CPU as a dry run and writes a valid JSON: every stage's plumbing, the todo
stages named, the targets in the schema the issue fixes, and no target claimed (a dry run
measures nothing); a stage that fails records its error and the next one runs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stmoe.runtime.gpu_check import STAGES, Check, run_stages, target_lines

pytest.importorskip("torch")
pytest.importorskip("transformers")

TODO = ("decode_table", "accelerate_offload", "calibrate_simulator")


def _check_schema(doc: dict[str, Any]) -> None:
    assert doc["dry_run"] is True and doc["device"] == "cpu (dry run)"
    assert isinstance(doc["commit"], str) and doc["commit"]
    assert list(doc["stages"]) == [*STAGES, *TODO]
    assert all(doc["stages"][name]["status"] == "todo" for name in TODO)
    assert doc["targets"], "no targets"
    for t in doc["targets"]:
        assert {"name", "met", "value", "goal"} <= set(t)
        assert t["met"] is None  # a dry run claims nothing


def test_the_dry_run_runs_end_to_end_and_writes_valid_json(tmp_path, capsys):
    out = tmp_path / "check.json"
    returned = run_stages(out, dry_run=True, commit="abc123")
    doc = json.loads(out.read_text())
    assert doc == json.loads(json.dumps(returned, default=str))  # what was written, returned
    assert list(STAGES) == ["environment", "h2d", "kernels", "cuda_tests", "tier_gpu"]
    _check_schema(doc)
    assert doc["commit"] == "abc123"
    assert all(doc["stages"][name]["status"] == "ok" for name in STAGES), {
        n: doc["stages"][n].get("error") for n in STAGES}
    runs = doc["stages"]["tier_gpu"]["runs"]
    assert runs and all(r["identical"] is True for r in runs)
    assert doc["stages"]["kernels"]["results"]  # every format's row, on the CPU's kernels
    assert doc["stages"]["cuda_tests"]["ran"] is False
    printed = capsys.readouterr().out
    assert all(f"] {name}: ok" in printed for name in STAGES)  # a line as each stage ends
    lines = target_lines(doc)
    assert len(lines) == len(doc["targets"]) and all(line.startswith("n/a") for line in lines)
    assert not (tmp_path / "check.tmp").exists()  # written whole, then moved into place


def test_a_failing_stage_is_recorded_and_the_next_runs(tmp_path):
    def broken(c: Check) -> dict[str, Any]:
        raise RuntimeError("no copy engine")

    stages = {**STAGES, "h2d": broken, "tier_gpu": lambda c: {"runs": []}}  # (its own test)
    out = tmp_path / "check.json"
    run_stages(out, dry_run=True, commit="abc123", stages=stages)
    doc = json.loads(out.read_text())
    _check_schema(doc)
    h2d = doc["stages"]["h2d"]
    assert h2d["status"] == "error" and h2d["error"] == "RuntimeError: no copy engine"
    assert "Traceback" in h2d["traceback"]
    assert doc["stages"]["kernels"]["status"] == "ok"  # the next stage ran
    assert not any(t["name"].startswith("the pinned store's") for t in doc["targets"])


def test_stages_past_the_budget_are_skipped(tmp_path):
    stages = {"environment": lambda c: {"ran": True}, "h2d": lambda c: {"ran": True}}
    doc = run_stages(tmp_path / "check.json", dry_run=True, budget_s=-1.0, stages=stages)
    assert [doc["stages"][n]["status"] for n in stages] == ["skipped", "skipped"]
    assert doc["commit"] == "unknown"
