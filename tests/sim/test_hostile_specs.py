"""Spec files as a careless or hostile user writes them: each refused in one clear line
naming the file and what was expected, never a traceback or a nonsense result."""

from __future__ import annotations

import re

import pytest
from test_simulator import HOST_TOML as SIM_HOST_TOML

import stmoe
from conftest import one_line_error
from stmoe.sim.specs import SpecError, hardware_preset, model_preset

MODEL_TOML = """source = "a test model"
layers = 4
dense_layers = 0
hidden = 2048
expert_intermediate = 1024
num_experts = 16
top_k = 2
shared_intermediate = 0
attention_heads = 16
kv_heads = 16
dtype_bytes = 2
"""

HOST_TOML = SIM_HOST_TOML.format(pe=1.0, bw=1e9, par=1e9, tier="disk", touch=0.0)


def edited(text: str, key: str, value: str) -> str:
    """``text`` with the line ``key = ...`` set to ``key = value``."""
    new, n = re.subn(rf"^{re.escape(key)} = .*$", f"{key} = {value}", text, count=1,
                     flags=re.M)
    assert n == 1, key
    return new


def refused(tmp_path, load, text: str, *fragments: str) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load(str(path))
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert str(path) in str(info.value)


def test_the_base_specs_load(tmp_path):
    (tmp_path / "m.toml").write_text(MODEL_TOML)
    (tmp_path / "h.toml").write_text(HOST_TOML)
    assert model_preset(str(tmp_path / "m.toml")).top_k == 2
    assert hardware_preset(str(tmp_path / "h.toml")).host is not None


def test_a_spec_file_is_read_whatever_its_name_ends_with(tmp_path, monkeypatch):
    """A path (or a file there) is a spec file, not a preset's name: before, ``hw.spec``
    or ``specs/hw`` was refused as an unknown preset."""
    (tmp_path / "hw.spec").write_text(HOST_TOML)
    (tmp_path / "m").write_text(MODEL_TOML)
    assert hardware_preset(str(tmp_path / "hw.spec")).name == "hw"
    monkeypatch.chdir(tmp_path)
    assert model_preset("m").top_k == 2  # a file here by that name
    with pytest.raises(SpecError, match="no such hardware spec file"):
        hardware_preset(str(tmp_path / "absent"))
    with pytest.raises(SpecError, match="unknown hardware 'absent'; presets"):
        hardware_preset("absent")


@pytest.mark.parametrize(("key", "value", "fragment"), [
    # infinite figures: times of inf, normalized times of nan, energies of inf
    ("link_bytes_per_s", "inf", "link_bytes_per_s is inf"),
    ("link_latency_s", "inf", "link_latency_s is inf"),
    ("clock_hz", "inf", "clock_hz is inf"),
    ("static_w", "inf", "static_w is inf"),
    ("pe_macs_per_cycle", "-inf", "pe_macs_per_cycle is -inf"),
    # divisors: a ZeroDivisionError in the accelerator pipeline, or log2(0) groups
    ("router_macs_per_cycle", "0", "router_macs_per_cycle must be positive"),
    ("pe_groups", "0", "pe_groups must be positive"),
    # the [host] table's seconds
    ("layer_s", "inf", "host.layer_s is inf"),
    ("token_s", "inf", "host.token_s is inf"),
    ("first_touch_s", "inf", "host.first_touch_s is inf"),
])
def test_infinite_or_zero_hardware_figures_are_refused(tmp_path, key, value, fragment):
    refused(tmp_path, hardware_preset, edited(HOST_TOML, key, value), fragment)


RANGE = "expected 0 < peak <= 1 and a finite half >= 0"


@pytest.mark.parametrize(("flow", "fragment"), [
    ("{ peak = 0.0, half = 0.0 }", f"{{'peak': 0.0, 'half': 0.0}}; {RANGE}"),  # 1/0
    ("{ peak = -1.0, half = 0.0 }", "'peak': -1.0"),  # negative compute times
    ("{ peak = 5.0, half = 0.0 }", "'peak': 5.0"),  # a PE array 5x its own peak
    ("{ peak = nan, half = 0.0 }", "'peak': nan"),
    ("{ peak = 1.0, half = -1.0 }", f"'half': -1.0}}; {RANGE}"),  # 1/0 at one token
    ("{ peak = 1.0, half = inf }", "'half': inf}"),
    ('{ peak = "1", half = 0.0 }', "weight_stationary.peak is '1', expected float"),
    ("{ peak = true, half = 0.0 }", "weight_stationary.peak is True, expected float"),
    ("{ peak = 1.0, half = 0.0, halff = 3 }", "'halff': 3}; it needs peak and half, nothing"),
    ("{ peak = 1.0 }", "it needs peak and half"),
])
def test_bad_dataflows_are_refused(tmp_path, flow, fragment):
    text = HOST_TOML.replace("{ peak = 1.0, half = 0.0 }", flow)
    refused(tmp_path, hardware_preset, text, "weight_stationary", fragment)


SHAPE = "expected top_k <= num_experts and kv_heads dividing attention_heads"


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("top_k", "17", f"top_k 17, kv_heads 16: {SHAPE}"),
    ("attention_heads", "0", "attention_heads must be positive"),  # ZeroDivisionError
    ("kv_heads", "0", "kv_heads must be positive"),
    ("kv_heads", "32", f"top_k 2, kv_heads 32: {SHAPE}"),
    ("kv_heads", "3", f"top_k 2, kv_heads 3: {SHAPE}"),
    ("expert_intermediate", "0", "expert_intermediate must be positive"),  # 0-byte experts
    ("dtype_bytes", "0", "dtype_bytes must be positive"),
    ("hidden", "inf", "hidden is inf, expected int"),
])
def test_impossible_model_shapes_are_refused(tmp_path, key, value, fragment):
    refused(tmp_path, model_preset, edited(MODEL_TOML, key, value), fragment)


@pytest.mark.parametrize("table", ["[host]\ntier = 'disk'\n", "[dataflows]\nws = 1\n"])
def test_a_hardware_table_in_a_model_spec_is_not_ignored(tmp_path, table):
    refused(tmp_path, model_preset, MODEL_TOML + table, "unknown keys")


def test_a_folder_or_a_file_not_utf8_is_one_clear_error(tmp_path, cli):
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    with pytest.raises(SpecError, match=r"folder\.toml: not valid TOML for a hardware spec"):
        hardware_preset(str(folder))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"layers = 4\n\xff\xfe\n")
    with pytest.raises(SpecError, match=r"binary\.toml: not valid TOML for a models spec"):
        model_preset(str(binary))
    trace = stmoe.synthesize(tokens=20, layers=4, experts=16, top_k=2, sequences=1, seed=0)
    stmoe.save_trace(trace, tmp_path / "t.npz")
    one_line_error(cli("simulate", tmp_path / "t.npz", "--model", binary),
                   "binary.toml", "not valid TOML", "utf-8")


@pytest.mark.parametrize(("key", "value", "pipelines"), [
    ("link_bytes_per_s", "1e-300", "both"),  # a read of inf seconds: times of inf, nan ratios
    ("clock_hz", "1e-300", "both"),  # compute of inf seconds
    ("static_w", "1.7e308", "accelerator"),  # an energy of inf joules
    ("token_s", "1e300", "host"),  # a host pipeline's decode of 1e301 s: 0.0 tokens/s
    # (a reliability review) an energy-delay product of inf: "inf" shown, "Infinity" in JSON
    ("verify_cycles", "1e308", "accelerator"),  # (static_w set too: an energy to multiply)
    ("read_parallel_bytes_per_s", "1e-300", "host"),  # 6.78e-305 tokens/s, exit 0
])
def test_figures_that_overflow_are_refused_not_simulated(tmp_path, key, value, pipelines):
    """Each figure finite, yet together out of any real range: the accelerator pipeline
    said inf and nan with exit 0, the host pipeline "a bug" or a ValueError."""
    from stmoe.sim.accelerator.simulate import simulate
    from stmoe.sim.host.systems import HostOptions, simulate_runtime

    (tmp_path / "m.toml").write_text(MODEL_TOML)
    text = edited(HOST_TOML, key, value)
    (tmp_path / "h.toml").write_text(edited(text, "static_w", "1.0") if key == "verify_cycles"
                                     else text)
    model, hw = model_preset(str(tmp_path / "m.toml")), hardware_preset(str(tmp_path / "h.toml"))
    trace = stmoe.synthesize(tokens=24, layers=4, experts=16, top_k=2, sequences=2, seed=0)
    if pipelines != "host":  # the accelerator pipeline reads no [host]
        said = (r"systems\.stmoe\.edp is inf" if key == "verify_cycles"  # (time, energy finite)
                else "a figure of the specs is out of any real range")
        with pytest.raises(SpecError, match=said):
            simulate(trace, model, hw, ["gpu-baseline", "oracle", "stmoe"], ablation=False)
    if pipelines != "accelerator":  # the host pipeline counts no energy
        with pytest.raises(SpecError, match=r"s to compute .*; expected each under 1e\+06 s"):
            simulate_runtime(trace, model, hw, ["on-demand"], HostOptions(capacity=8))


@pytest.mark.parametrize(("args", "message"), [
    (("--threads", "100000"), "--threads 100000: expected an integer from 1 to 1024"),  # segfault
    (("--workers", "100000"), "--workers 100000: expected an integer from 0 to 64"),
])
def test_calibrate_bounds_its_threads_as_generate_does(tmp_path, cli, args, message):
    """Before: 100000 torch threads crashed the process; 100000 prefetch workers were
    measured and written into the preset the simulator reads."""
    one_line_error(cli("calibrate", "--model", tmp_path, "-o", tmp_path / "hw.toml", *args),
                   message)
    assert not (tmp_path / "hw.toml").exists()


@pytest.mark.parametrize("tier", ["disk", "gpu-disk"])
def test_the_gpu_checks_forecast_refuses_a_preset_of_another_tier(tmp_path, tier):
    """benchmarks/gpu_forecast.py --hardware FILE: the check replays the gpu tier (the store
    in pinned host memory); a disk's preset forecast it with exit 0."""
    from stmoe.predictors import profile
    from stmoe.runtime.gpu_check.forecast import forecast

    (tmp_path / "m.toml").write_text(MODEL_TOML)
    (tmp_path / "hw.toml").write_text(HOST_TOML.replace('tier = "disk"', f'tier = "{tier}"'))
    model, hw = model_preset(str(tmp_path / "m.toml")), hardware_preset(str(tmp_path / "hw.toml"))
    trace = stmoe.synthesize(tokens=40, layers=4, experts=16, top_k=2, sequences=1, seed=0)
    with pytest.raises(SpecError, match=f"hardware 'hw': a preset of the {tier} tier.*--tier gpu"):
        forecast(hw, model, trace, profile(trace, fit_plus=False), 0.5)


def test_the_gpu_forecast_refuses_bad_input_in_one_line(tmp_path, capsys):
    """benchmarks/gpu_forecast.py's command line (a reliability review: every bad input ended
    in a traceback, and a missing --hardware only after the tables were profiled)."""
    from stmoe.runtime.gpu_check.forecast_cli import main

    routing = tmp_path / "r.npz"  # (SYNTHETIC: the check's own routing may not be here)
    stmoe.save_trace(stmoe.synthesize(tokens=200, layers=8, experts=16, top_k=2, sequences=1,
                                      seed=0), routing)
    for args, said in ((["--hardware", str(tmp_path / "none.toml")], "no such hardware spec"),
                       (["--routing", str(routing), "--layers", "0"], "--layers 0: there are")):
        assert main(args, tmp_path) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and said in err, err
