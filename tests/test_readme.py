"""The README runs as written: its shell and Python blocks, in order, in a fresh clone
(a git repository of this checkout's ``.gitignore`` with ``src`` linked to its own), every
command exit 0; afterwards the clone's ``git status`` shows nothing new (the tour writes
only into its git-ignored scratch folder), nothing was written into ``STMOE_CACHE`` (no
second copy of a model's experts), and the scratch folder holds what the README says.

Excepted, by the marker that ends the line: ``# needs your own model`` (a checkpoint of
the reader's, never run here), ``# needs the shared traces`` (the recorded sample beside
the clone: run where it is, skipped otherwise, as every test of it) and the section
"Inside vLLM" (run in vLLM's environment: tests/vllm_plugin/test_docs.py). The setup
blocks of "Quick start" and "Installing" (make demo, make test, pip install, stmoe demo, pytest) are
what CI runs (.ci/run calls make test): here they are checked to be exactly those, and the
make targets with ``make -n``. One substitution keeps the tour fast: make-model writes
Qwen3.6-35B-A3B's routing dimensions with narrow layers (``--like`` a spec .toml, as the
README says it takes) instead of 12 GiB of experts (their size is checked with
``--dry-run``).
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
from stmoe.models import SHIPPED_MODEL

README = REPO / "README.md"
OWN_MODEL = "# needs your own model"
SHARED = "# needs the shared traces"
VLLM_SECTION = "Inside vLLM"  # run in vLLM's environment: tests/vllm_plugin/test_docs.py
SCRATCH = "tour"  # the tour's scratch folder, git-ignored
SETUP = {
    "Quick start: two commands": ["make demo", "make test"],
    "Installing into your own environment": ["pip install -e '.[hf,dev]'", "stmoe demo",
                                             "pytest -q"],
}
MAKE_MODEL = "stmoe make-model --like qwen3.6-35b-a3b --layers 8 -o qwen36-l8"
BUDGET_S = 150  # the tour takes about 60 s on 2 busy cores; far more means a slow command
OUTPUT_FLAGS = ("-o", "--output", "--json")


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


def _narrow_qwen36(folder: Path) -> Path:
    """Qwen3.6-35B-A3B's preset with narrow layers: the same routing, tiny weights."""
    presets = tomllib.loads(resources.files("stmoe.sim").joinpath("data/models.toml").read_text())
    spec = dict(presets["qwen3.6-35b-a3b"], hidden=64, expert_intermediate=32,
                attention_heads=4, kv_heads=2, source="README test: narrow layers")
    lines = [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in spec.items()]
    path = folder / "qwen36-narrow.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=folder, capture_output=True, text=True, check=True).stdout


def _fresh_clone(folder: Path) -> Path:
    """A git repository standing for a fresh clone: this checkout's .gitignore and a link
    to its src, committed."""
    folder.mkdir()
    shutil.copy(REPO / ".gitignore", folder / ".gitignore")
    (folder / "src").symlink_to(REPO / "src")
    _git(folder, "init", "-q")
    _git(folder, "add", ".gitignore", "src")
    _git(folder, "commit", "-q", "-m", "clone")
    return folder


def _size(folder: Path) -> int:
    """Bytes of the files under ``folder`` (links not followed)."""
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file()
               and not p.is_symlink())


def outputs(command: str) -> list[str]:
    """The files and folders a command line names as its outputs (-o, --output, --json)."""
    argv = shlex.split(command, comments=True)
    return [argv[i + 1] for i, a in enumerate(argv[:-1])
            if a in OUTPUT_FLAGS and argv[i + 1] != "-"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _on_free_port(text: str, port: int) -> str:
    """The README's server port (8000) replaced by one free here."""
    return text.replace(":8000", f":{port}").replace("--port 8000", f"--port {port}")


def _run(line: str, cli: Cli, substitute: dict[str, str], background: list[subprocess.Popen],
         port: int) -> str:
    """One command in the current folder: ``stmoe`` in this process (one import of torch
    for the whole tour), anything else through bash, a final ``cd DIR`` here (the tour's
    scratch folder); a line ending in ``&`` (the server) in a process of its own, stopped
    when the tour ends. Returns its output; fails on exit status."""
    folder = Path.cwd()
    line = substitute.get(line.split("  #")[0].strip(), line)
    line = _on_free_port(line.replace("../../shared/traces/", f"{SHARED_TRACES}/"), port)
    if m := re.fullmatch(r"(?:(.+?)\s*&&\s*)?cd (\S+)", line):
        if m.group(1):
            _run(m.group(1), cli, substitute, background, port)
        os.chdir(folder / m.group(2))
        return ""
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


def _tour(scripts: Path, cli: Cli, has_shared: bool, skipped: list[str],
          timed: Callable[[str, Callable[[], object]], None], substitute: dict[str, str],
          background: list[subprocess.Popen], port: int) -> None:
    """Every block of the README, in order (Python blocks from files in ``scripts``)."""
    for i, (section, lang, code) in enumerate(blocks(README.read_text())):
        if section == VLLM_SECTION:
            continue
        if section in SETUP:
            bare = [re.sub(r"\s+#.*$", "", line) for line in commands(code)]
            assert lang == "sh" and bare == SETUP[section], (section, code)
        elif lang == "python":
            script = scripts / f"block{i}.py"
            script.write_text(_on_free_port(code, port))
            with contextlib.redirect_stdout(io.StringIO()):
                timed(f"python block {i}", functools.partial(runpy.run_path, str(script)))
        elif lang == "sh":
            for line in commands(code):
                if line.endswith(OWN_MODEL) or (line.endswith(SHARED) and not has_shared):
                    skipped.append(line)
                else:
                    timed(line, functools.partial(_run, line, cli, substitute, background,
                                                  port))


def test_every_readme_block_runs_as_written(tmp_path, monkeypatch, cli, one_torch_thread):
    clone = _fresh_clone(tmp_path / "clone")
    cache = tmp_path / "stmoe-cache"  # the tour must write nothing here
    monkeypatch.setenv("STMOE_CACHE", str(cache))
    scripts = tmp_path / "blocks"
    scripts.mkdir()
    substitute = {MAKE_MODEL: MAKE_MODEL.replace("qwen3.6-35b-a3b",
                                                 str(_narrow_qwen36(tmp_path)))}
    monkeypatch.chdir(clone)
    shipped = sorted(p.name for p in SHIPPED_MODEL.iterdir())
    has_shared = (SHARED_TRACES / "qwen3.6-35b-a3b_chat-1prompt.routes.json").exists()
    skipped, times = [], {}  # times: (wall, CPU) seconds of each command or block run

    printed: dict[str, str] = {}  # what each command printed

    def timed(key: str, fn: Callable[[], object]) -> None:
        t, c = time.perf_counter(), time.process_time()
        result = fn()
        times[key] = (round(time.perf_counter() - t, 1), round(time.process_time() - c, 1))
        if isinstance(result, str):
            printed[key] = result

    background: list[subprocess.Popen] = []  # the server the serve section starts
    port = free_port()
    start = time.perf_counter()
    try:
        _tour(scripts, cli, has_shared, skipped, timed, substitute, background, port)
    finally:
        for proc in background:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    took = time.perf_counter() - start
    assert background, "the serve section starts a server"
    # the excepted lines are the few the README says; the tour wrote what it says it writes
    assert sum(line.endswith(OWN_MODEL) for line in skipped) == 2, skipped
    assert len(times) + len(skipped) >= 30, times  # every other line ran
    tour = clone / SCRATCH
    for made in ("tiny.npz", "sglang.npz", "report/report.html", "sim/normalized_time.png",
                 "qwen36-l8/config.json", "qwen36-l8.index/index.json", "qwen36-l8.tables.npz",
                 "decode.npz", "store/index.json"):
        assert (tour / made).exists(), made
    assert json.loads((tour / "run.json").read_text())["repeat"]["runs"] == 3
    assert (tour / "chat.npz").exists() == has_shared
    # nothing written beside the scratch folder: not in the clone, not into the shipped
    # model's folder, not into the cache (generate and serve used the tour's stores)
    assert _git(clone, "status", "--porcelain", "--untracked-files=all") == ""
    assert sorted(p.name for p in SHIPPED_MODEL.iterdir()) == shipped
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))
    # the disk the README says the tour takes (less the real-size checkpoint, narrow here)
    stated = int(re.search(r"The whole tour writes about (\d+) MiB",
                           " ".join(README.read_text().split()))[1])
    written = (_size(tour) - _size(tour / "qwen36-l8")) / 2**20
    assert 0.6 * stated <= written <= 1.2 * stated, f"{written:.0f} MiB, README: {stated}"
    _eval_says_what_the_readme_says(next(v for k, v in printed.items()
                                         if k.startswith("stmoe eval tiny.npz")))
    slowest = sorted(times.items(), key=lambda kv: -kv[1][0])
    print(f"the tour wrote {written:.1f} MiB", *slowest, sep="\n")  # shown when it fails
    assert took < BUDGET_S, f"the tour took {took:.0f} s; slowest: {slowest[:5]}"


def _eval_says_what_the_readme_says(printed: str) -> None:
    """The README's figures of the tour's `stmoe eval`: stmoe-plus's points over ST-MoE at
    equal set size, and both predictors' own set sizes."""
    text = " ".join(README.read_text().split())
    gain, size = re.search(r"the first table shows stmoe-plus \([^)]*\) ([+-][\d.]+) points "
                           r"above ST-MoE at ([\d.]+) experts", text).groups()
    assert f"At equal set size: {size} experts per prediction" in " ".join(printed.split())
    first = printed[: printed.index("each predictor at its own set size")]
    rows = {m[0]: m[1:] for m in re.findall(r"^│ (\S+)\s*│\s*(\S+)\s*│\s*(\S+)\s*│\s*(\S+)",
                                            first, re.M)}
    assert rows["stmoe-plus"][1] == gain, (rows["stmoe-plus"], gain)  # the first table's
    own = re.search(r"names K = (\d) experts where ST-MoE names ([\d.]+)", text).groups()
    table = printed[printed.index("each predictor at its own set size"):]
    sizes = {m[0]: m[1] for m in re.findall(r"^│ (\S+)\s*│(?:\s*\S+\s*│){2}\s*(\S+)", table,
                                            re.M)}
    assert (sizes["stmoe-plus"], sizes["stmoe"]) == (f"{own[0]}.00", own[1]), sizes


def test_every_tour_block_says_what_it_writes():
    """Each output a tour command names (-o, --output, --json) is named in its block's
    comments, and the Python blocks' save_trace files too."""
    for section, lang, code in blocks(README.read_text()):
        if section in SETUP:
            continue
        notes = " ".join(re.findall(r"#(.*)$", code, re.M))
        named = ([out for line in commands(code) for out in outputs(line)] if lang == "sh"
                 else re.findall(r"save_trace\([^,]+, \"([^\"]+)\"\)", code))
        for out in named:  # a file inside a folder the block says it writes is named
            assert out in notes or f"{Path(out).parts[0]}/" in notes, (section, out, notes)


def test_the_real_size_block_states_the_disk_it_takes(cli):
    """The 12 GiB the README gives the real-size checkpoint is what make-model writes."""
    result = cli(*shlex.split(MAKE_MODEL)[1:], "--dry-run")
    assert result.exit_code == 0, result.output
    gib = float(re.search(r"([\d.]+) GiB in all", result.output)[1])
    text = " ".join(README.read_text().split())
    assert f"qwen36-l8/, {round(gib)} GiB" in text and f"checkpoint, {round(gib)} GiB" in text


def test_the_substituted_line_is_in_the_readme_and_documents_its_fast_form():
    tour = [line for _, lang, code in blocks(README.read_text()) if lang == "sh"
            for line in commands(code)]
    assert MAKE_MODEL in tour
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
    # the report's place is the demo's own last line: never a guess that ARGS="-o" makes wrong
    proc = subprocess.run(["make", "-n", "demo", f"VENV={tmp_path / 'venv'}", "ARGS=-o elsewhere"],
                          cwd=REPO, capture_output=True, text=True)
    assert "stmoe demo -o elsewhere" in proc.stdout and "stmoe-demo" not in proc.stdout, (
        proc.stdout)


def test_what_make_demo_writes_is_ignored_by_git():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("stmoe-demo/index.html", ".venv/bin/python", ".venv-ci/bin/python",
                 f"{SCRATCH}/tiny.npz", f"{SCRATCH}/qwen36-l8/model.safetensors"):
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert proc.returncode == 0, f"{path} is not ignored by .gitignore"


def test_every_journal_entry_is_in_the_journals_index():
    """docs/journal/README.md lists every entry, newest first (four of one day's were left
    out once, so the index hid them)."""
    folder = REPO / "docs" / "journal"
    index = (folder / "README.md").read_text()
    entries = sorted(p.name for p in folder.glob("*.md") if p.name != "README.md")
    assert [e for e in entries if f"]({e})" not in index] == []
    listed = re.findall(r"^- (\d{4}-\d{2}-\d{2}): \[.*\]\((\S+\.md)\)", index, re.M)
    assert [date for date, _ in listed] == sorted((d for d, _ in listed), reverse=True)
    assert all(name.startswith(date) for date, name in listed)
