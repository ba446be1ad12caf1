"""The command line: every command explains itself, and the documented paths work."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REAL_NPZ, REAL_ROUTES, needs_shared
from stmoe import load_trace

COMMANDS = [
    "import",
    "info",
    "synth",
    "export",
    "demo",
    "profile",
    "eval",
    "analyze",
    "capture",
    "simulate",
    "train-tiny",
    "generate",
    "pack",
    "make-model",
    "calibrate",
    "serve",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(cli, command):
    result = cli(command, "--help")
    assert result.exit_code == 0
    assert "Usage: stmoe" in result.output and len(result.output) > 200
    assert cli(command, "-h").output == result.output  # (-h was "No such option")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_texts_keep_their_square_brackets(cli, command):
    """"[min, max]" is text, not a markup tag to drop (it was, in generate --repeat)."""
    import typer.main

    from stmoe.cli import app

    params = typer.main.get_command(app).commands[command].params
    shown = " ".join(cli(command, "--help").output.split())
    for p in params:
        for bracket in re.findall(r"\[[^\]]*\]", getattr(p, "help", None) or ""):
            assert " ".join(bracket.split()) in shown, (command, p.name, bracket)


@pytest.mark.parametrize(("command", "most"), [("generate", 95), ("serve", 90)])
def test_long_helps_group_every_option_under_a_heading(cli, command, most):
    """generate's --help was 129 lines in one list, serve's 108 (issue 45): the options are
    grouped by what they set, every one still listed once, each panel's options together."""
    import typer.main

    from stmoe.cli import app
    from stmoe.cli.help_panels import CACHE, TIER, WEIGHTS

    text = cli(command, "--help").output
    assert len(text.splitlines()) <= most, text
    params = typer.main.get_command(app).commands[command].params
    headings = [line[:-1] for line in text.splitlines() if line and not line[0].isspace()
                and line.endswith(":") and not line.startswith("Usage")]
    assert {CACHE, TIER, WEIGHTS} <= set(headings) and headings[-1] == "Other options"
    for p in params:
        panel = getattr(p, "rich_help_panel", None)
        assert panel in headings, (p.name, panel)  # every option has a heading
        section = text.split(f"\n{panel}:\n")[1].split("\n\n")[0]
        assert p.opts[0] + " " in section + " ", (p.name, panel)
        listed = re.findall(rf"^  {re.escape(p.opts[0])}[ /]", text, re.M)
        assert len(listed) == 1, p.name


def test_top_level_help_lists_commands(cli):
    result = cli("--help")
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


def test_synth_then_info_json_has_the_contract_keys(cli, tmp_path):
    path = tmp_path / "s.npz"
    result = cli(
        "synth",
        "-o",
        path,
        "--tokens",
        "400",
        "--layers",
        "6",
        "--experts",
        "16",
        "--top-k",
        "2",
        "--sequences",
        "4",
        "--spatial",
        "0.5",
        "--temporal",
        "0.2",
        "--seed",
        "7",
    )
    assert result.exit_code == 0, result.output
    assert "SYNTHETIC" in result.output
    result = cli("info", path, "--json", "-")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert {k: info[k] for k in ("tokens", "layers", "top_k", "num_experts", "sequences")} == {
        "tokens": 400,
        "layers": 6,
        "top_k": 2,
        "num_experts": 16,
        "sequences": 4,
    }
    assert info["decode_tokens"] == 300 and info["synthetic"] is True
    assert len(info["load_balance_max_over_mean"]) == 6


def test_synth_rejects_bad_values_clearly(cli, tmp_path):
    result = cli("synth", "-o", tmp_path / "s.npz", "--spatial", "2")
    assert result.exit_code == 1 and "spatial=2.0" in result.output and "[0, 1]" in result.output


def test_outputs_named_for_another_format_are_refused_before_any_work(cli, tmp_path):
    """stmoe writes traces and tables as .npz whatever the name: `-o x.json` would hold an
    npz no JSON reader takes, so it is one line naming the file; no suffix is fine."""
    src = tmp_path / "in" / "s.npz"
    src.parent.mkdir()
    assert cli("synth", "-o", src, "--tokens", "60").exit_code == 0
    out = tmp_path / "out"
    out.mkdir()
    for args, name, what in ((("synth",), "x.json", "a trace"),
                             (("import", src), "x.JSONL", "a trace"),
                             (("profile", src), "t.pt", "a tables file")):
        result = cli(*args, "-o", out / name)
        assert result.exit_code == 1, result.output
        assert f"{out / name}: stmoe writes {what} as .npz" in result.output, result.output
        assert not any(out.iterdir())
    assert cli("synth", "-o", out / "plain", "--tokens", "20").exit_code == 0
    assert load_trace(out / "plain").meta.synthetic


def test_info_human_output(cli, tmp_path):
    cli("synth", "-o", tmp_path / "s.npz", "--tokens", "100", "--domains", "2", "--sequences", "2")
    result = cli("info", tmp_path / "s.npz")
    assert result.exit_code == 0
    for fragment in ("SYNTHETIC", "T=100 tokens", "synth-0", "synth-1", "load max/mean"):
        assert fragment in result.output


@needs_shared
def test_import_real_routes_matches_the_npz_sample(cli, tmp_path):
    out = tmp_path / "a.npz"
    result = cli("import", REAL_ROUTES, "-o", out, "--domain", "chat")
    assert result.exit_code == 0, result.output
    a, b = load_trace(out), load_trace(REAL_NPZ)
    assert np.array_equal(a.experts, b.experts)
    assert np.array_equal(a.is_decode, b.is_decode)
    assert np.array_equal(a.seq_starts, b.seq_starts)
    assert a.domains == ("chat",)
    info = json.loads(cli("info", out, "--json", "-").stdout)
    assert (info["tokens"], info["decode_tokens"], info["layers"], info["top_k"]) == (
        164,
        128,
        40,
        8,
    )


def test_export_and_reimport(cli, tmp_path):
    cli("synth", "-o", tmp_path / "s.npz", "--tokens", "80", "--sequences", "2")
    for fmt, name in (("jsonl", "s.jsonl"), ("npy", "s.npy")):
        result = cli("export", tmp_path / "s.npz", "-o", tmp_path / name, "--format", fmt)
        assert result.exit_code == 0, result.output
        result = cli(
            "import", tmp_path / name, "-o", tmp_path / f"{name}.npz", "--num-experts", "64"
        )
        assert result.exit_code == 0, result.output
        assert np.array_equal(
            load_trace(tmp_path / f"{name}.npz").experts, load_trace(tmp_path / "s.npz").experts
        )


def test_usage_error_exits_2(cli):
    assert cli("import").exit_code == 2
    assert cli("no-such-command").exit_code == 2


def test_console_script_and_import_stays_light(tmp_path):
    heavy = "('torch', 'transformers', 'matplotlib')"
    code = f"import sys, stmoe; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    exe = subprocess.run(
        [sys.executable, "-m", "stmoe", "--version"], capture_output=True, text=True
    )
    assert exe.returncode == 0 and exe.stdout.startswith("stmoe ")


def test_written_traces_follow_the_umask(cli, tmp_path):
    import os

    old = os.umask(0o027)
    try:
        res = cli("synth", "-o", tmp_path / "u.npz", "--tokens", "50", "--layers", "2")
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "u.npz").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("capacity", ["0", "150%", "99", "2", "lots"])
def test_a_refused_capacity_is_refused_before_torch_loads(command, capacity):
    """From config.json alone: under a second, torch never imported."""
    code = ("import sys, time; from typer.testing import CliRunner; from stmoe.cli import app; "
            "t = time.perf_counter(); r = CliRunner().invoke(app, sys.argv[1:]); "
            "print(r.exit_code, 'torch' in sys.modules, time.perf_counter() - t); "
            "print(r.output)")
    args = [command, "--capacity", capacity] + (["--prompt", "x"] if command == "generate" else [])
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         check=True).stdout
    status, torch_loaded, seconds = out.split("\n")[0].split()
    assert status == "1" and torch_loaded == "False", out
    assert float(seconds) < 1.0, out
    assert "capacity" in out, out
