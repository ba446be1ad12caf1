"""The GPU check run again in part (``gpu_check.py --rerun JSON``): the stages that did not
finish ok (or those named) run again with the ones that read them, the rest are kept and
say which run made them; a dry run's stages and a GPU's, or two devices', never mix."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from stmoe.errors import StmoeError
from stmoe.runtime.gpu_check import STAGES, Check, rerun_plan, run_stages
from stmoe.runtime.gpu_check.rerun import keep_earlier

pytest.importorskip("torch")
pytest.importorskip("transformers")

ORDER = list(STAGES)


def _earlier(**status: str) -> dict[str, Any]:
    return {"dry_run": False, "device": "NVIDIA H200", "commit": "aaa", "started": "t0",
            "stages": {n: {"status": status.get(n, "ok"), "figure": n} for n in ORDER}}


def test_the_plan_is_what_did_not_finish_with_what_reads_it():
    earlier = _earlier(decode_table="error", cuda_tests="skipped")
    assert rerun_plan(earlier, None, ORDER) == [
        "environment", "decode_table", "accelerate_offload", "calibrate_simulator",
        "cuda_tests"]
    assert rerun_plan(_earlier(), None, ORDER) == ["environment"]  # all ok: nothing else
    assert rerun_plan(_earlier(), ["kernels"], ORDER) == ["environment", "kernels"]
    # accelerate alone reads the kept decode table: it does not run the table again
    assert rerun_plan(_earlier(), ["accelerate_offload"], ORDER) == [
        "environment", "accelerate_offload"]
    with pytest.raises(StmoeError, match=r"no stage 'decode'; the stages are environment, "):
        rerun_plan(_earlier(), ["decode"], ORDER)


@pytest.mark.parametrize("key, value", [("device", "NVIDIA H100 80GB HBM3"),
                                        ("dry_run", True)])
def test_stages_of_another_device_or_a_dry_run_are_refused(key, value):
    doc = {"dry_run": False, "device": "NVIDIA H200", "stages": {}}
    with pytest.raises(StmoeError, match="do not mix; run the whole check instead"):
        keep_earlier(doc, {**_earlier(), key: value}, {"environment"})
    assert doc["stages"] == {}


def test_a_rerun_runs_the_failed_stages_and_keeps_the_rest_marked(tmp_path):
    out = tmp_path / "check.json"

    def broken(c: Check) -> dict[str, Any]:
        raise RuntimeError("a bug, fixed since")

    first = {"environment": STAGES["environment"], "h2d": broken, "kernels": STAGES["kernels"]}
    earlier = run_stages(out, dry_run=True, commit="aaa", stages=first)
    assert earlier["stages"]["h2d"]["status"] == "error"
    plan = rerun_plan(earlier, None, ORDER)
    assert plan[:2] == ["environment", "h2d"] and "kernels" not in plan
    doc = run_stages(out, dry_run=True, commit="bbb", earlier=earlier,
                     stages={n: STAGES[n] for n in ("environment", "h2d")})
    assert list(doc["stages"]) == ["environment", "h2d", "kernels"]  # the check's order
    assert doc["stages"]["h2d"]["status"] == "ok" and "from_run" not in doc["stages"]["h2d"]
    kept = doc["stages"]["kernels"]
    assert kept["from_run"] == {"commit": "aaa", "started": earlier["started"]}
    assert kept["results"] == earlier["stages"]["kernels"]["results"]
    assert doc["rerun_of"]["kept"] == ["kernels"] and doc["commit"] == "bbb"
    # the targets read the kept stages too (the kernels' figures)
    assert any(t["name"].startswith("CUDA int4") and t["value"] is not None
               for t in doc["targets"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc, default=str))


def test_a_bad_rerun_is_refused_in_one_line_naming_the_file(tmp_path):
    from stmoe.runtime.gpu_check.rerun import read_rerun

    assert read_rerun(None, None, ORDER) == (None, None)
    bad, other = tmp_path / "bad.json", tmp_path / "other.json"
    bad.write_text("{not json")
    other.write_text("[1, 2]")
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(_earlier(h2d="error")))
    for args, message in (
            ((bad, None), f"--rerun {bad}: Expecting property name"),
            ((tmp_path / "none.json", None), "No such file"),
            ((other, None), "not a GPU check's JSON (no 'stages' object)"),
            ((None, "h2d"), "--stages names the stages --rerun runs again"),
            ((gpu, "h2d,nope"), "no stage 'nope'")):
        with pytest.raises(StmoeError, match=re.escape(message)) as e:
            read_rerun(*args, ORDER)
        assert "\n" not in str(e.value)
    earlier, names = read_rerun(gpu, None, ORDER)
    assert earlier["commit"] == "aaa" and names == ["environment", "h2d"]
    assert read_rerun(gpu, " kernels, ", ORDER)[1] == ["environment", "kernels"]
