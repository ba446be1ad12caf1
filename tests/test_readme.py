"""The README runs as written: its shell and Python blocks, in order, in a fresh folder
standing for a clone's root (``src`` linked to this checkout's), every command exit 0.

Excepted, by the marker that ends the line: ``# needs your own model`` (a checkpoint of
the reader's, never run here) and ``# needs ../shared/traces`` (the recorded sample beside
the clone: run where it is, skipped otherwise, as every test of it). The setup blocks of
"Quick start" and "Installing" (make demo, make test, pip install, stmoe demo, pytest) are
what CI runs (.ci/run calls make test): here they are checked to be exactly those, and the
make targets with ``make -n``. One substitution keeps the tour fast: make-model writes
Qwen3.6-35B-A3B's routing dimensions with narrow layers (``--like`` a spec .toml, as the
README says it takes) instead of 12 GiB of experts.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest

from conftest import REPO, SHARED_TRACES, Cli

README = REPO / "README.md"
OWN_MODEL = "# needs your own model"
SHARED = "# needs ../shared/traces"
SETUP = {
    "Quick start: two commands": ["make demo", "make test"],
    "Installing into your own environment": ["pip install -e '.[hf,dev]'", "stmoe demo",
                                             "pytest -q"],
}
MAKE_MODEL = "stmoe make-model --like qwen3.6-35b-a3b --layers 8 -o qwen36-l8"
SUBSTITUTE = {MAKE_MODEL: MAKE_MODEL.replace("qwen3.6-35b-a3b", "qwen36-narrow.toml")}
BUDGET_S = 150  # the tour takes about 60 s on 2 busy cores; far more means a slow command


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(section heading, language, code) of every fenced block, in order."""
    found = []
    for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.M | re.S):
        headings = re.findall(r"^## (.+)$", text[: m.start()], re.M)
        found.append((headings[-1] if headings else "", m.group(1), m.group(2)))
    return found


def commands(code: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", "", code)
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _narrow_qwen36(folder: Path) -> None:
    """Qwen3.6-35B-A3B's preset with narrow layers: the same routing, tiny weights."""
    presets = tomllib.loads(resources.files("stmoe.sim").joinpath("data/models.toml").read_text())
    spec = dict(presets["qwen3.6-35b-a3b"], hidden=64, expert_intermediate=32,
                attention_heads=4, kv_heads=2, source="README test: narrow layers")
    lines = [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in spec.items()]
    (folder / "qwen36-narrow.toml").write_text("\n".join(lines) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _on_free_port(text: str, port: int) -> str:
    """The README's server port (8000) replaced by one free here."""
    return text.replace(":8000", f":{port}").replace("--port 8000", f"--port {port}")


def _run(line: str, cli: Cli, folder: Path, background: list[subprocess.Popen],
         port: int) -> str:
    """One command in ``folder``: ``stmoe`` in this process (one import of torch for the
    whole tour), anything else through bash; a line ending in ``&`` (the server) in a
    process of its own, stopped when the tour ends. Returns its output; fails on exit
    status."""
    line = SUBSTITUTE.get(line.split("  #")[0].strip(), line)
    line = _on_free_port(line.replace("../shared/traces/", f"{SHARED_TRACES}/"), port)
    if line.endswith("&"):
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        background.append(subprocess.Popen(line[:-1], shell=True, cwd=folder, env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True))
        return ""
    argv = shlex.split(line, comments=True)
    if argv[0] == "stmoe":
        res = cli(*argv[1:])
        assert res.exit_code == 0, f"{line}\n{res.output}"
        return res.output
    proc = subprocess.run(line, shell=True, cwd=folder, capture_output=True, text=True)
    assert proc.returncode == 0, f"{line}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


@pytest.fixture
def one_torch_thread():
    """torch on one thread: with two on a busy 2-core machine its threads wait on each
    other (a 32-token replay took 60 s instead of 11); the outputs are the same."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tour(tmp_path: Path, cli: Cli, has_shared: bool, skipped: list[str],
          timed: Callable[[str, Callable[[], object]], None],
          background: list[subprocess.Popen], port: int) -> None:
    """Every block of the README, in order."""
    for i, (section, lang, code) in enumerate(blocks(README.read_text())):
        if section in SETUP:
            bare = [re.sub(r"\s+#.*$", "", line) for line in commands(code)]
            assert lang == "sh" and bare == SETUP[section], (section, code)
        elif lang == "python":
            (tmp_path / f"block{i}.py").write_text(_on_free_port(code, port))
            with contextlib.redirect_stdout(io.StringIO()):
                timed(f"python block {i}", functools.partial(runpy.run_path, f"block{i}.py"))
        elif lang == "sh":
            for line in commands(code):
                if line.endswith(OWN_MODEL) or (line.endswith(SHARED) and not has_shared):
                    skipped.append(line)
                else:
                    timed(line, functools.partial(_run, line, cli, tmp_path, background, port))


def test_every_readme_block_runs_as_written(tmp_path, monkeypatch, cli, one_torch_thread):
    (tmp_path / "src").symlink_to(REPO / "src")
    _narrow_qwen36(tmp_path)
    monkeypatch.chdir(tmp_path)
    has_shared = (SHARED_TRACES / "qwen3.6-35b-a3b_chat-1prompt.routes.json").exists()
    skipped, times = [], {}  # times: (wall, CPU) seconds of each command or block run

    def timed(key: str, fn: Callable[[], object]) -> None:
        t, c = time.perf_counter(), time.process_time()
        fn()
        times[key] = (round(time.perf_counter() - t, 1), round(time.process_time() - c, 1))

    background: list[subprocess.Popen] = []  # the server the serve section starts
    port = free_port()
    start = time.perf_counter()
    try:
        _tour(tmp_path, cli, has_shared, skipped, timed, background, port)
    finally:
        for proc in background:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    took = time.perf_counter() - start
    assert background, "the serve section starts a server"
    # the excepted lines are the few the README says; the tour wrote what it says it writes
    assert sum(line.endswith(OWN_MODEL) for line in skipped) == 2, skipped
    assert len(times) + len(skipped) >= 27, times  # every other line ran
    for made in ("tiny.npz", "sglang.npz", "report/report.html", "sim/normalized_time.png",
                 "qwen36-l8/config.json", "qwen36-l8.tables.npz", "decode.npz"):
        assert (tmp_path / made).exists(), made
    assert json.loads((tmp_path / "run.json").read_text())["repeat"]["runs"] == 3
    assert (tmp_path / "chat.npz").exists() == has_shared
    slowest = sorted(times.items(), key=lambda kv: -kv[1][0])
    print(*slowest, sep="\n")  # shown when the test fails
    assert took < BUDGET_S, f"the tour took {took:.0f} s; slowest: {slowest[:5]}"


def test_the_substituted_line_is_in_the_readme_and_documents_its_fast_form():
    tour = [line for _, lang, code in blocks(README.read_text()) if lang == "sh"
            for line in commands(code)]
    assert set(SUBSTITUTE) <= set(tour)
    assert "`--like` also" in README.read_text() and "spec .toml" in README.read_text()


def test_make_targets_resolve_and_ci_runs_make_test(tmp_path):
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", ci, re.M), ci
    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    for target, expect in (("demo", "stmoe demo"), ("test", "pytest -q")):
        proc = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert expect in proc.stdout and "-m venv" in proc.stdout, proc.stdout


def test_what_make_demo_writes_is_ignored_by_git():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("stmoe-demo/index.html", ".venv/bin/python", ".venv-ci/bin/python"):
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert proc.returncode == 0, f"{path} is not ignored by .gitignore"
