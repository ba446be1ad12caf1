"""The prepared GPU check (benchmarks/gpu_check.py) runs end to end on the CPU with
``--dry-run`` and writes a valid JSON: every stage's plumbing, the todo stages named, the
targets in the schema the issue fixes, and no target claimed (a dry run measures nothing);
a stage that fails records its error and the next one runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
STAGES = ("environment", "h2d", "kernels", "cuda_tests", "tier_gpu")
TODO = ("decode_table", "accelerate_offload", "calibrate_simulator")


def _check_schema(doc: dict) -> None:
    assert doc["dry_run"] is True and doc["device"] == "cpu (dry run)"
    assert isinstance(doc["commit"], str) and doc["commit"]
    assert list(doc["stages"]) == [*STAGES, *TODO]
    assert all(doc["stages"][name]["status"] == "todo" for name in TODO)
    assert doc["targets"], "no targets"
    for t in doc["targets"]:
        assert {"name", "met", "value", "goal"} <= set(t)
        assert t["met"] is None  # a dry run claims nothing


def test_the_dry_run_runs_end_to_end_and_writes_valid_json(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "STMOE_COMMIT": "abc123"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    _check_schema(doc)
    assert doc["commit"] == "abc123"
    assert all(doc["stages"][name]["status"] == "ok" for name in STAGES), {
        n: doc["stages"][n].get("error") for n in STAGES}
    runs = doc["stages"]["tier_gpu"]["runs"]
    assert runs and all(r["identical"] is True for r in runs)
    assert doc["stages"]["kernels"]["results"]  # every format's row, on the CPU's kernels
    assert "wrote" in run.stdout and "MET" not in run.stdout.replace("NOT MET", "")


def test_a_failing_stage_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def broken(c):
        raise RuntimeError("no copy engine")

    monkeypatch.setattr(mod, "h2d", broken)
    monkeypatch.setattr(mod, "tier_gpu", lambda c, tokens: {"runs": []})  # (its own test)
    out = tmp_path / "check.json"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--out", str(out)])
    mod.main()
    doc = json.loads(out.read_text())
    _check_schema(doc)
    h2d = doc["stages"]["h2d"]
    assert h2d["status"] == "error" and h2d["error"] == "RuntimeError: no copy engine"
    assert doc["stages"]["kernels"]["status"] == "ok"  # the next stage ran
