"""`stmoe calibrate`: this machine measured as a hardware preset `stmoe simulate` takes."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import stmoe
from stmoe.sim.specs import load_hardware

FAST = ("--seconds", "0.2", "--tokens", "2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random checkpoint of the shipped model's shape and its store."""
    from stmoe.capture_generate import load_causal_lm
    from stmoe.checkpoints import make_checkpoint, plan_checkpoint
    from stmoe.runtime.store import pack

    root = tmp_path_factory.mktemp("calibrate")
    model_dir = make_checkpoint(plan_checkpoint("stmoe-tiny", layers=2, dtype="float32"),
                                root / "m")  # fmt: skip
    pack(load_causal_lm(model_dir), root / "store", source=model_dir)
    return root, model_dir


def test_the_preset_loads_says_how_each_number_was_found_and_simulates(tiny, cli):
    root, model_dir = tiny
    out = root / "hw.toml"
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", out, *FAST)
    assert res.exit_code == 0, res.output
    assert "GB/s alone" in res.output and "per decode token" in res.output
    spec = load_hardware(str(out))
    host = spec.host
    assert host is not None and host.tier == "disk" and host.workers == 2
    assert spec.cache_experts_per_layer == 8  # 50% of 16 experts
    assert spec.link_bytes_per_s > 0 and host.read_parallel_bytes_per_s > 0
    assert spec.pe_macs_per_cycle > 0 and host.layer_s > 0
    text = out.read_text()
    keys = [line for line in text.splitlines() if "=" in line and not line.startswith("#")]
    table = tomllib.loads(text)
    assert len(keys) == len(table) - 2 + len(table["host"]) + len(table["dataflows"])
    for line in keys:  # every number says where it comes from
        assert "#" in line, line
    measured = [line for line in keys if "# measured" in line]
    assert len(measured) >= 7  # speed, latency, compute, parallel reads, layer, token, touch
    assert "on " in table["source"] and "UTC" in table["source"]

    trace = stmoe.synthesize(tokens=30, layers=8, experts=16, top_k=4, sequences=1, seed=2)
    stmoe.save_trace(trace, root / "t.npz")
    for pipeline in ("runtime", "accelerator"):
        res = cli("simulate", root / "t.npz", "--model", "stmoe-tiny", "--layers", "2",
                  "--hardware", out, "--pipeline", pipeline, "--system", "oracle",
                  "--system", "stmoe", "--json", root / f"{pipeline}.json")  # fmt: skip
        assert res.exit_code == 0, res.output
    import json

    data = json.loads((root / "runtime.json").read_text())
    oracle = data["systems"]["oracle"]
    decode = int(np.count_nonzero(trace.is_decode))
    assert oracle["decode_tokens"] == decode and oracle["decode_s"] > 0
    assert data["capacity"] == 8 and "IN-SAMPLE" in data["tables"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tier", "gpu"), "calibrate measures --tier disk or emulated"),
        (("--tier", "emulated"), "needs a bandwidth"),
        (("--bandwidth", "1GB"), "--bandwidth applies to --tier emulated only"),
        (("--seconds", "0"), "--seconds 0.0: expected a number strictly between 0 and 600"),
        (("--tokens", "0"), "--tokens 0: expected an integer from 1 to 1000"),
        (("--capacity", "2"), "below the router's top-4"),
    ],
)  # fmt: skip
def test_bad_requests_are_one_clear_line(tiny, cli, args, message):
    root, model_dir = tiny
    out = root / "bad.toml"
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", out,
              *FAST, *args)  # fmt: skip
    assert res.exit_code == 1, res.output
    assert message in res.output and "Traceback" not in res.output
    assert not out.exists()


def test_bad_paths_are_refused_before_measuring(tiny, cli):
    root, model_dir = tiny
    res = cli("calibrate", "--model", root / "nowhere", "--store", root / "store",
              "-o", root / "x.toml", *FAST)  # fmt: skip
    assert res.exit_code == 1 and "nowhere" in res.output
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", root / "x.txt")
    assert res.exit_code == 1 and "expected a .toml file name" in res.output
    (root / "d.toml").mkdir()
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", root / "d.toml")
    assert res.exit_code == 1 and "is a directory" in res.output


def test_reads_follow_a_traces_routing(tiny, tmp_path, cli):
    """--routing: the blocks read are the trace's routed ones, token by token and layer by
    layer (each layer's experts sorted); a trace of another shape is one clear line."""
    from stmoe.runtime.calibrate import routed_blocks
    from stmoe.runtime.store import ExpertStore, StoreError
    from stmoe.trace import save_trace
    from stmoe.trace.synth import synthesize

    root, model_dir = tiny
    store = ExpertStore(root / "store")
    trace = synthesize(tokens=5, layers=3, experts=16, top_k=4, sequences=1)
    save_trace(trace, tmp_path / "t.npz")
    order = routed_blocks(store, tmp_path / "t.npz")
    want = [(layer, e) for t in range(5) for layer in range(2)
            for e in sorted(set(trace.experts[t, layer].tolist()))]  # fmt: skip
    assert [(b.layer, b.expert) for b in order] == want
    other = synthesize(tokens=5, layers=3, experts=8, top_k=2, sequences=1)
    save_trace(other, tmp_path / "o.npz")
    with pytest.raises(StoreError, match="routes 3 layers of 8 experts; the store has 2 of 16"):
        routed_blocks(store, tmp_path / "o.npz")
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "--routing",
              tmp_path / "t.npz", "-o", tmp_path / "hw.toml", *FAST)  # fmt: skip
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(("args", "message"), [
    (("--pipeline", "runtime", "--policy", "lfu"), "--policy: an option of --pipeline accelerator"),
    (("--pipeline", "runtime", "--batch", "4"), "--batch: an option of --pipeline accelerator"),
    (("--capacity", "25%"), "--capacity: an option of --pipeline runtime"),
    (("--pipeline", "runtime", "--capacity", "nan%"), "expected 1 to 16 experts per layer"),
    (("--pipeline", "runtime", "--capacity", "-5%"), "expected 1 to 16 experts per layer"),
])  # fmt: skip
def test_simulate_refuses_what_its_pipeline_would_ignore(tiny, tmp_path, cli, args, message):
    """An option of the other pipeline, or an absurd capacity, is one line, not ignored."""
    from stmoe.trace import save_trace
    from stmoe.trace.synth import synthesize

    root, model_dir = tiny
    hw = root / "hw-sim.toml"
    if not hw.exists():
        res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", hw, *FAST)
        assert res.exit_code == 0, res.output
    save_trace(synthesize(tokens=40, layers=2, experts=16, top_k=4, sequences=1),
               tmp_path / "t.npz")  # fmt: skip
    res = cli("simulate", tmp_path / "t.npz", "--model", "stmoe-tiny", "--layers", "2",
              "--hardware", hw, *args)  # fmt: skip
    assert res.exit_code == 1 and message in res.output, res.output
