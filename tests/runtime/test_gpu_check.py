"""The prepared GPU check (stmoe.runtime.gpu_check, which benchmarks/gpu_check.py runs) goes
end to end on the CPU as a dry run (the gpu tiers on the CPU's stand-in for a GPU, a tiny
checkpoint, synthetic routing) and writes a valid JSON: every stage's plumbing, the decode
table's every system, capacity and tier with the resident model's tokens, the targets in the
schema the issue fixes, and no target claimed (a dry run measures nothing); a stage that
fails records its error and the next one runs. The real run's routing: the carried file,
split as the benchmark splits the shared sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stmoe.runtime.gpu_check import STAGES, Check, run_stages, target_lines

pytest.importorskip("torch")
pytest.importorskip("transformers")

ORDER = ["environment", "h2d", "kernels", "decode_table", "accelerate_offload",
         "calibrate_simulator", "cuda_tests", "tier_gpu"]


def _check_schema(doc: dict[str, Any]) -> None:
    assert doc["dry_run"] is True and doc["device"] == "cpu (dry run)"
    assert isinstance(doc["commit"], str) and doc["commit"]
    assert list(doc["stages"]) == list(STAGES)
    assert doc["targets"], "no targets"
    for t in doc["targets"]:
        assert {"name", "met", "value", "goal"} <= set(t)
        assert t["met"] is None  # a dry run claims nothing


def test_the_dry_run_runs_end_to_end_and_writes_valid_json(tmp_path, capsys, monkeypatch):
    import torch

    from stmoe.runtime.store.pinned import PinnedStore

    pinned: list[str] = []  # each store pinned, as often as it was
    pin = PinnedStore.__init__
    monkeypatch.setattr(PinnedStore, "__init__", lambda self, store, *a: pinned.append(
        str(store.path)) or pin(self, store, *a))
    out = tmp_path / "check.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # calibrate sets one thread: the stages after get the check's
    try:
        returned = run_stages(out, dry_run=True, commit="abc123")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert doc == json.loads(json.dumps(returned, default=str))  # what was written, returned
    # the decode table's store pinned once for its gpu runs and once for calibrate's three
    assert max(pinned.count(p) for p in pinned) == 2, pinned
    assert list(STAGES) == ORDER
    _check_schema(doc)
    assert doc["commit"] == "abc123"
    assert all(doc["stages"][name]["status"] == "ok" for name in STAGES), {
        n: doc["stages"][n].get("error") for n in STAGES}
    table = doc["stages"]["decode_table"]
    runs = table["runs"]
    assert {(r["tier"], r["capacity"], r["system"]) for r in runs} == {
        (t, c, s) for t in ("gpu", "gpu-disk") for c in ("25%", "50%")
        for s in ("on-demand", "lru-only", "stmoe", "stmoe-plus", "oracle", "stmoe-plus-score")
    } | {("gpu", "50%", "stmoe-plus-split")}  # (where the targets are read, only)
    assert all(r["identical"] is True for r in runs), [r for r in runs if not r["identical"]]
    # its caches add up to 50% of the tiny model's 16 experts a layer, one per layer
    split = table["split"]["capacities"]
    assert len(split) == 2 and sum(split) == 16 and table["split"]["system"] == "stmoe-plus-split"
    assert split != [8, 8]  # (the dry run's is not the one size: the test can tell)
    split_run = next(r for r in runs if r["system"] == "stmoe-plus-split")
    plus = next(r for r in runs if r["system"] == "stmoe-plus" and (
        r["tier"], r["capacity"]) == ("gpu", "50%"))
    assert split_run["experts_cached"] == split and plus["experts_cached"] == 8
    assert split_run["cache_bytes"] == plus["cache_bytes"]
    assert table["resident"]["repeats_its_tokens"] and "HELD-OUT" in table["routing"]
    assert table["pinned_store_locked"] == "registered in place"  # (host_lock's fallback not)
    for r in runs:  # the device's figures of every run (the stand-in's here)
        assert r["decode_tok_s"] > 0 and r["pcie_bytes_decode"] >= 0 and r["copy_GBps"] >= 0
    acc = doc["stages"]["accelerate_offload"]
    # accelerate's own hooks ran (the dry run's offload is "disk"; the GPU's, "cpu"): half
    # the experts modules held on "meta" and loaded at each call, the tokens unchanged
    assert acc["identical_prefix"] is True and acc["offloaded_to"] == "disk"
    assert acc["experts_modules_offloaded"] == acc["of_layers"] - acc["experts_layers_in_hbm"] > 0
    sim = doc["stages"]["calibrate_simulator"]["systems"]
    assert [r["system"] for r in sim] == ["on-demand", "lru-only", "stmoe", "stmoe-plus",
                                          "oracle", "stmoe-plus-score", "stmoe-plus-split"]
    assert all(r["simulated_tok_s"] > 0 and r["measured_tok_s"] for r in sim)
    # the calibrated preset comes back beside the JSON (gpu_forecast.py --hardware reads it)
    preset = tmp_path / doc["stages"]["calibrate_simulator"]["preset_file"]
    assert preset.name == "check.calibrated-gpu.toml"
    from stmoe.sim.specs import hardware_preset

    host = hardware_preset(str(preset)).host
    assert host is not None and host.tier == "gpu"
    # the predicting systems' own host time, timed with the check's tables, simulated
    assert set(host.predictors) == {"stmoe", "stmoe-plus"}
    assert set(doc["stages"]["calibrate_simulator"]["preset"]["predictors"]) == {
        "stmoe", "stmoe-plus"}
    assert doc["stages"]["tier_gpu"]["runs"][0]["identical"] is True
    assert doc["stages"]["cuda_tests"]["ran"] is False
    printed = capsys.readouterr().out
    assert all(f"] {name}: ok" in printed for name in STAGES)  # a line as each stage ends
    names = [t["name"] for t in doc["targets"]]
    assert any("stmoe-plus vs accelerate" in n for n in names)
    assert any("gap stmoe-plus-score (score eviction" in n for n in names)
    assert any("simulator calibrated on the GPU" in n for n in names)
    dry = {t["name"]: t.get("dry_run_met") for t in doc["targets"]}
    assert dry[next(n for n in names if n.startswith("bit-identical"))] is None  # no cuda tests
    lines = target_lines(doc)
    assert len(lines) == len(doc["targets"]) and all(line.startswith("n/a") for line in lines)
    assert not (tmp_path / "check.tmp").exists()  # written whole, then moved into place


def test_a_failing_stage_is_recorded_and_the_next_runs(tmp_path):
    def broken(c: Check) -> dict[str, Any]:
        raise RuntimeError("no copy engine")

    stages = {"environment": STAGES["environment"], "h2d": broken,
              "kernels": STAGES["kernels"]}
    out = tmp_path / "check.json"
    run_stages(out, dry_run=True, commit="abc123", stages=stages)
    doc = json.loads(out.read_text())
    h2d = doc["stages"]["h2d"]
    assert h2d["status"] == "error" and h2d["error"] == "RuntimeError: no copy engine"
    assert "Traceback" in h2d["traceback"]
    assert doc["stages"]["kernels"]["status"] == "ok"  # the next stage ran
    assert not any(t["name"].startswith("the pinned store's") for t in doc["targets"])


def test_the_targets_are_written_after_every_stage(tmp_path):
    """A run the machine kills mid-stage (its time limit) still leaves the targets of the
    stages that finished: they are read after each stage, not once at the end."""
    out = tmp_path / "check.json"
    seen: list[list[str]] = []

    def look(c: Check) -> dict[str, Any]:  # what a kill here would leave on disk
        seen.append([t["name"] for t in json.loads(out.read_text())["targets"]])
        return {}

    run_stages(out, dry_run=True, stages={"environment": STAGES["environment"],
                                          "h2d": STAGES["h2d"], "probe": look})
    assert any(name.startswith("the pinned store's registered mapping") for name in seen[0])
    assert len(seen[0]) == len(json.loads(out.read_text())["targets"])  # read once, not twice


def test_unfinished_cuda_tests_are_not_judged():
    from stmoe.runtime.gpu_check.targets import _passed

    assert _passed({"ran": True, "returncode": 0, "summary": "12 passed in 30.1s"}) is True
    assert _passed({"ran": True, "returncode": 0, "summary": "12 skipped in 2.0s"}) is None
    assert _passed({"ran": True, "returncode": 1, "summary": "1 failed, 11 passed"}) is False
    assert _passed({"ran": True, "returncode": None}) is None  # stopped at the budget
    assert _passed({"ran": False}) is None
    # the GPU refused the tests' process (an exclusive compute mode): not the code's failure
    assert _passed({"ran": True, "returncode": 1, "judged": False}) is None


def test_a_gpu_that_refuses_the_tests_process_is_recorded_not_judged(tmp_path, monkeypatch):
    import subprocess

    from stmoe.runtime.gpu_check import stages
    from stmoe.runtime.gpu_check.record import Check

    def refused(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "E RuntimeError: CUDA error: CUDA-capable "
                                           "device(s) is/are busy or unavailable\n"
                                           "3 failed in 4.0s\n", "")

    monkeypatch.setattr(stages.subprocess, "run", refused)
    c = Check(tmp_path / "c.json", False, "abc", 420.0, repo=tmp_path)
    rec = stages.cuda_tests(c)
    assert rec["judged"] is False and "exclusive compute mode" in rec["why"]
    monkeypatch.setattr(stages.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "E AssertionError\n1 failed, 2 passed in 4.0s\n", ""))
    assert "judged" not in stages.cuda_tests(c)  # a real failure stays one


def test_nvidia_smi_says_the_link_and_the_compute_mode_or_why_not(monkeypatch):
    import subprocess

    from stmoe.runtime.gpu_check import stages

    monkeypatch.setattr(stages.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, "Default, 580.159.04, 5, 16, 5, 1980 MHz\n", ""))
    got = stages.nvidia_smi()
    assert got["compute_mode"] == "Default" and got["pcie.link.gen.current"] == "5"
    assert got["pcie.link.width.current"] == "16" and got["clocks.max.sm"] == "1980 MHz"

    def missing(cmd, **kw):
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    monkeypatch.setattr(stages.subprocess, "run", missing)
    assert stages.nvidia_smi()["error"].startswith("FileNotFoundError")
    monkeypatch.setattr(stages.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, "", "No devices were found"))
    assert stages.nvidia_smi() == {"error": "nvidia-smi printed nothing; stderr: No devices "
                                            "were found"}


def test_stages_past_the_budget_are_skipped(tmp_path):
    stages = {"environment": lambda c: {"ran": True}, "h2d": lambda c: {"ran": True}}
    doc = run_stages(tmp_path / "check.json", dry_run=True, budget_s=-1.0, stages=stages)
    assert [doc["stages"][n]["status"] for n in stages] == ["skipped", "skipped"]
    assert doc["commit"] == "unknown"


def test_the_real_runs_routing_is_the_carried_file_held_out_by_tokens(tmp_path):
    """A trace of the shared sample's shape (Qwen3.6-35B-A3B: 256 experts, top-8; a 36-token
    prompt and 128 decode tokens) where the check looks for the carried file: its first
    layers split at token 100, the tail a prompt of 8 and 64 decode tokens, a plan for the
    real checkpoint's shape. Missing, the stage says how to bring it."""
    from stmoe.errors import StmoeError
    from stmoe.runtime.forced_routing import plan_routing
    from stmoe.runtime.gpu_check.setup import CARRIED, LIKE, held_out
    from stmoe.sim.specs import model_preset
    from stmoe.trace import save_trace, synthesize

    spec = model_preset(LIKE)
    trace = synthesize(tokens=164, layers=8, experts=spec.num_experts, top_k=spec.top_k,
                       sequences=1, prefill_fraction=36 / 164, seed=1)
    c = Check(tmp_path / "c.json", False, "x", 60.0, tokens=64, repo=tmp_path)
    with pytest.raises(StmoeError, match=r"gpu_check\.py --prepare"):
        held_out(c, 4)
    (tmp_path / CARRIED).parent.mkdir(parents=True)
    save_trace(trace, tmp_path / CARRIED)
    head, tail, label = held_out(c, 4)
    assert head.num_tokens == 100 and head.num_layers == 4
    assert tail.num_tokens == 8 + 64 and int(tail.is_decode.sum()) == 64
    assert "HELD-OUT" in label and "routing.npz" in label
    plan = plan_routing(tail, 0, 4, spec.num_experts, spec.top_k, 4096)
    assert plan.prefill == 8 and plan.new_tokens == 65


@pytest.mark.skipif(not (Path(__file__).resolve().parents[3] / "shared" / "traces").is_dir(),
                    reason="needs ../shared/traces (not in CI)")
def test_prepare_carries_the_shared_samples_first_layers(tmp_path):
    from stmoe.runtime.gpu_check import prepare_routing
    from stmoe.trace import load_trace

    shared = Path(__file__).resolve().parents[3] / "shared" / "traces"
    out = prepare_routing(shared, tmp_path / "routing.npz")
    trace = load_trace(out)
    assert trace.num_layers == 8 and trace.num_experts == 256 and trace.top_k == 8
    assert trace.num_tokens == 164


def test_a_rehearsal_is_a_dry_run_of_the_real_shape_and_routing(tmp_path):
    """``--rehearse``: a dry run (the CPU, nothing claimed) whose decode table is the GPU
    run's: the real checkpoint's preset and the recorded routing split at token 100, one
    layer by default; a plain dry run stays tiny with synthetic routing."""
    from stmoe.runtime.gpu_check.setup import LIKE, REHEARSAL_LAYERS, held_out
    from stmoe.sim.specs import model_preset
    from stmoe.trace import save_trace, synthesize

    spec = model_preset(LIKE)
    path = tmp_path / "recorded.npz"
    save_trace(synthesize(tokens=164, layers=2, experts=spec.num_experts, top_k=spec.top_k,
                          sequences=1, prefill_fraction=36 / 164, seed=2), path)
    c = Check(tmp_path / "c.json", True, "x", 60.0, routing=path, real_shape=True)
    assert not c.tiny and c.doc["dry_run"] is True and c.doc["rehearsal"] is True
    assert c.doc["device"] == "cpu (dry run)"
    head, _, label = held_out(c, REHEARSAL_LAYERS)
    assert head.num_tokens == 100 and head.num_experts == 256 and head.num_layers == 1
    assert "recorded.npz" in label and "SYNTHETIC" not in label
    dry = Check(tmp_path / "d.json", True, "x", 60.0, routing=path)
    assert dry.tiny and "rehearsal" not in dry.doc
    assert "SYNTHETIC" in held_out(dry, 2)[2]


def test_the_forecast_reads_the_checks_targets_off_the_simulator(tmp_path):
    """benchmarks/gpu_forecast.py's logic: at every ASSUMED point each system gets a rate, the
    GPU-resident model (no copy at all) is the bound no system passes, the presets are
    marked ASSUMED and simulate the gpu tier (a serial link where a wasted copy costs no
    saved read: the runtime's own rule), and the targets are the issue's three."""
    import dataclasses

    from stmoe.predictors import profile
    from stmoe.runtime.gpu_check.forecast import SYSTEMS, assumed_grid, forecast, verdicts
    from stmoe.sim.host.systems import host_costs
    from stmoe.sim.specs import model_preset
    from stmoe.trace import synthesize
    from stmoe.trace.select import held_out_tail

    model = dataclasses.replace(model_preset("stmoe-tiny"), layers=2)
    trace = synthesize(tokens=60, layers=2, experts=model.num_experts, top_k=model.top_k,
                       sequences=1, prefill_fraction=0.1, seed=4)
    head, tail = held_out_tail(trace, 30, 4)
    points = list(assumed_grid(model, 0.5, tmp_path))
    assert len(points) == 6 and all("ASSUMED" in label for label, _ in points)
    for label, hw in points:
        assert "ASSUMED" in (tmp_path / f"{hw.name}.toml").read_text()
        costs = host_costs(model, hw)
        assert costs.fifo and costs.free_waste
        r = forecast(hw, model, tail, profile(head), 0.5)
        assert set(r) == {*SYSTEMS, "resident"} and min(r.values()) > 0, label
        assert max(r[s] for s in SYSTEMS) <= r["resident"] * 1.001, (label, r)
        assert r["on-demand"] < r["lru-only"] <= r["oracle"], (label, r)
        assert [name for name, _, _ in verdicts(r)] == [
            "stmoe-plus / lru-only", "lru-only -> oracle gap closed",
            "the same by stmoe-plus-score", "stmoe-plus / resident"]
    # --predictors-from: another preset's [host.predictors] in every ASSUMED point, said so;
    # the predicting systems only are slower for it
    source = tmp_path / "cpu.toml"
    source.write_text((tmp_path / f"{points[0][1].name}.toml").read_text().replace(
        "# [host.predictors] not measured", "# was") + "\n[host.predictors]\nstmoe-plus = "
        "{ learn_s = 4e-05, predict_s = 3e-05, admission_s = 1.5e-05 }\n")
    (tmp_path / "t").mkdir()
    timed = list(assumed_grid(model, 0.5, tmp_path / "t", source))
    assert all("predictors as cpu.toml" in label for label, _ in timed)
    cost = timed[0][1].host.predictors["stmoe-plus"]
    assert (cost.learn_s, cost.predict_s, cost.admission_s) == (4e-05, 3e-05, 1.5e-05)
    assert "ASSUMED: " in (tmp_path / "t" / f"{timed[0][1].name}.toml").read_text()
    plain, slower = (forecast(p[0][1], model, tail, profile(head), 0.5) for p in (points, timed))
    assert slower["stmoe-plus"] < plain["stmoe-plus"]
    assert slower["lru-only"] == plain["lru-only"] and slower["oracle"] == plain["oracle"]


def test_without_a_gpu_a_real_run_stops_after_the_environment_and_claims_nothing(tmp_path):
    """Not a dry run, but torch sees no GPU (a driver too old for the CUDA build, say): the
    environment stage records why, nothing else runs on the CPU's stand-in at full size,
    and no target is met or not."""
    seen = []
    stages = {"environment": STAGES["environment"],
              "h2d": lambda c: seen.append("h2d") or {}}
    doc = run_stages(tmp_path / "check.json", dry_run=False, stages=stages)
    assert list(doc["stages"]) == ["environment"] and seen == []
    assert "only the environment stage ran" in doc["note"]
    assert doc["targets"] and all(t["met"] is None for t in doc["targets"])


def test_a_store_that_cannot_be_pinned_loses_the_gpu_runs_not_the_table(tmp_path, monkeypatch):
    """The decode table pins the store once for its gpu runs; a refusal (a 6 GiB
    cudaHostRegister, say) is recorded, each gpu run then fails alone, recorded, and the
    gpu-disk runs, which pin nothing, still run."""
    from stmoe.runtime.gpu_check.decode import decode_table
    from stmoe.runtime.store.pinned import PinnedStore

    def refused(*args, **kwargs):
        raise OSError("cudaHostRegister: out of memory")

    monkeypatch.setattr(PinnedStore, "acquire", refused)
    doc = run_stages(tmp_path / "check.json", dry_run=True, stages={"decode_table": decode_table})
    table = doc["stages"]["decode_table"]
    assert table["status"] == "ok" and "out of memory" in table["pinned_store_error"]
    gpu = [r for r in table["runs"] if r["tier"] == "gpu"]
    disk = [r for r in table["runs"] if r["tier"] == "gpu-disk"]
    assert gpu and all("out of memory" in r["error"] for r in gpu)
    assert disk and all(r["identical"] is True and r["decode_tok_s"] > 0 for r in disk)


def test_a_split_that_cannot_be_sized_loses_its_run_not_the_table(tmp_path, monkeypatch):
    """stmoe-plus-split's caches are sized in the setup every stage shares: a refusal there
    (a head with too few decode tokens, say) is recorded, its run and simulated row left out,
    and every other run goes on."""
    from stmoe.evaluate import layer_capacity
    from stmoe.predictors.base import PredictorError
    from stmoe.runtime.gpu_check.baselines import calibrate_simulator
    from stmoe.runtime.gpu_check.decode import SYSTEMS, decode_table

    def refused(*args, **kwargs):
        raise PredictorError("too short to replay its decode tail")

    monkeypatch.setattr(layer_capacity, "size_split", refused)
    doc = run_stages(tmp_path / "check.json", dry_run=True,
                     stages={"decode_table": decode_table,
                             "calibrate_simulator": calibrate_simulator})
    table = doc["stages"]["decode_table"]
    assert table["status"] == "ok" and "too short" in table["split"]["error"]
    assert {r["system"] for r in table["runs"]} == set(SYSTEMS)
    assert all(r["identical"] is True for r in table["runs"])
    sim = doc["stages"]["calibrate_simulator"]
    assert sim["status"] == "ok" and [r["system"] for r in sim["systems"]] == list(SYSTEMS)


def test_the_gpu_disk_runs_leave_time_to_the_stages_after_the_table(tmp_path, monkeypatch):
    """On a slow disk the gpu-disk runs (last in the decode table) would take the time of
    the stages after it (accelerate, calibrate, the cuda-marked tests): they stop starting
    DISK_KEEPS_S before the budget's end; the gpu runs take the budget whole."""
    from stmoe.runtime.gpu_check import decode

    monkeypatch.setattr(decode, "DISK_KEEPS_S", 1e6)  # no time left for any gpu-disk run
    doc = run_stages(tmp_path / "check.json", dry_run=True,
                     stages={"decode_table": decode.decode_table})
    runs = doc["stages"]["decode_table"]["runs"]
    assert all("decode_tok_s" in r for r in runs if r["tier"] == "gpu")
    disk = [r for r in runs if r["tier"] == "gpu-disk"]
    assert disk and all("kept for the stages after" in r["skipped"] for r in disk)


def test_a_check_makes_its_work_folder_only_when_a_stage_asks_and_removes_it(tmp_path,
                                                                             monkeypatch):
    import tempfile

    # a temporary folder of this test's own (other checks, under pytest -n, make theirs in
    # the shared one as this one runs)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    c = Check(tmp_path / "c.json", True, "x", 60.0)
    assert not list(tmp_path.glob("stmoe-gpu-check-*"))
    work = c.work
    assert work.parent == tmp_path
    assert work.is_dir() and c.work == work  # one folder, made once
    c.remove_work()
    assert not work.exists()
