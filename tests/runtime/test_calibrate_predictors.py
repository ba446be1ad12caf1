"""`stmoe calibrate` times each predictor on the compute thread; `stmoe simulate` counts it."""

from __future__ import annotations

import json
import tomllib

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import stmoe
from stmoe.sim.specs import hardware_preset

FAST = ("--seconds", "0.2", "--tokens", "3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random checkpoint of the shipped model's shape, its store, tables profiled on
    one synthetic trace and another trace to simulate."""
    from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint
    from stmoe.hf.loading import load_causal_lm
    from stmoe.predictors import profile, save_tables
    from stmoe.runtime.store import pack

    root = tmp_path_factory.mktemp("calibrate-predictors")
    model_dir = make_checkpoint(plan_checkpoint("stmoe-tiny", layers=2, dtype="float32"),
                                root / "m")
    pack(load_causal_lm(model_dir), root / "store", source=model_dir)
    source = stmoe.synthesize(tokens=60, layers=2, experts=16, top_k=4, sequences=2, seed=1)
    save_tables(profile(source, fit_plus=True), root / "tables.npz")
    replayed = stmoe.synthesize(tokens=40, layers=2, experts=16, top_k=4, sequences=1, seed=2)
    stmoe.save_trace(replayed, root / "t.npz")
    return root, model_dir


def simulate(cli, root, hw, name):
    out = root / f"{name}.json"
    res = cli("simulate", root / "t.npz", "--model", "stmoe-tiny", "--layers", "2",
              "--hardware", hw, "--pipeline", "runtime", "--tables", root / "tables.npz",
              "--system", "lru-only", "--system", "stmoe-all", "--system", "stmoe-plus-all",
              "--system", "oracle", "--json", out)
    assert res.exit_code == 0, res.output
    return res.output, json.loads(out.read_text())["systems"]


def test_each_predictors_time_is_measured_written_and_simulated(tiny, cli):
    root, model_dir = tiny
    hw = root / "hw.toml"
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", hw,
              "--tables", root / "tables.npz", *FAST)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "per decode layer call: stmoe " in said and ", stmoe-plus " in said
    timed = hardware_preset(str(hw)).host.predictors
    assert set(timed) == {"stmoe", "stmoe-plus"}
    for cost in timed.values():  # microseconds, not nothing and not seconds
        for seconds in (cost.learn_s, cost.predict_s, cost.admission_s):
            assert 1e-7 < seconds < 0.05
    table = tomllib.loads(hw.read_text())["host"]["predictors"]
    line = next(x for x in hw.read_text().splitlines() if x.startswith('"stmoe-plus" ='))
    assert "# measured: 6 decode layer calls (6 asking" in line  # 3 tokens x 2 layers
    assert table["stmoe"]["learn_s"] == timed["stmoe"].learn_s

    output, systems = simulate(cli, root, hw, "timed")
    assert "predictor time not in the preset" not in output
    assert all(s["predictor_time"] for s in systems.values())

    # the same preset without its [host.predictors]: the predicting systems' compute thread
    # is spared their predictor's time at every decode layer call (admission off: every call
    # predicts), less what it hid of a stall (the reads in flight go on meanwhile: where the
    # link measured slow, as on a loaded machine, a stall shrinks by some of it)
    text = hw.read_text()
    bare = root / "hw-bare.toml"
    bare.write_text(text[: text.index("\n[host.predictors]")] + "\n")
    output, plain = simulate(cli, root, bare, "bare")
    assert "predictor time not in the preset for stmoe, stmoe-plus" in " ".join(output.split())
    assert not plain["stmoe-all"]["predictor_time"] and plain["oracle"]["predictor_time"]
    for system, name in (("stmoe-all", "stmoe"), ("stmoe-plus-all", "stmoe-plus")):
        calls = systems[system]["decode_tokens"] * 2
        cost = timed[name].learn_s + timed[name].predict_s  # (-all: admission's look none)
        extra = systems[system]["decode_s"] - plain[system]["decode_s"]
        hidden = plain[system]["stall_s"] - systems[system]["stall_s"]
        assert extra + hidden == pytest.approx(calls * cost, rel=1e-6), system
        assert -1e-9 <= hidden <= calls * cost * (1 + 1e-6), system  # (float noise: 1e-17)
    for system in ("lru-only", "oracle"):  # no predictor asked: no time added
        assert systems[system]["decode_s"] == plain[system]["decode_s"]


def test_no_tables_or_none_asked_writes_a_note_and_bad_names_are_refused(tiny, cli):
    root, model_dir = tiny
    for extra, note in (((), "not measured: no tables (--tables)"),
                        (("--tables", root / "tables.npz", "--predictors", "none"), None)):
        hw = root / "hw-none.toml"
        res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", hw,
                  *extra, *FAST)
        assert res.exit_code == 0, res.output
        assert note is None or note in " ".join(res.output.split())
        assert hardware_preset(str(hw)).host.predictors == {}
        assert "# [host.predictors] not measured" in hw.read_text()
    for bad in ("hybrid", "stmoe,nope", ","):
        res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o",
                  root / "x.toml", "--predictors", bad, *FAST)
        assert res.exit_code == 1 and "--predictors" in res.output, res.output
        assert "expected some of stmoe, stmoe-plus" in " ".join(res.output.split())
