"""The README's section "Inside vLLM" and docs/vllm.md run as written, in vLLM's
environment: their install lines are exactly what this environment was made with (make
test-vllm), every other shell line runs (the servers in the background, stopped at the
end) in a scratch folder beside ``src``, and the Python block prints generated text. The
README's server (the plugin at 4 of 16 experts) answers greedy requests with plain vLLM's
tokens."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")

REPO = Path(__file__).resolve().parents[2]
INSTALL = ["pip install -e '.[hf,vllm]'", "pip uninstall -y torchvision torchaudio torchcodec"]


def _blocks(path: Path, section: str | None = None) -> list[tuple[str, str]]:
    text = path.read_text()
    if section is not None:
        start = text.index(f"## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end > 0 else None]
    return [(m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.M | re.S)]


def _commands(code: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", "", code)
    return [re.sub(r"\s+#.*$", "", line.strip()) for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _run_shell(blocks: list[tuple[str, str]], cwd: Path,
               while_up: Callable[[], object] | None = None) -> list[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    background, outputs = [], []
    try:
        for lang, code in blocks:
            if lang != "sh":
                continue
            for line in _commands(code):
                if line in INSTALL:
                    continue  # this environment: make test-vllm's very lines
                if line.endswith("&"):
                    background.append(subprocess.Popen(line[:-1], shell=True, cwd=cwd, env=env,
                                                       stdout=subprocess.DEVNULL,
                                                       stderr=subprocess.DEVNULL,
                                                       start_new_session=True))
                    continue
                p = subprocess.run(line, shell=True, cwd=cwd, env=env, capture_output=True,
                                   text=True, timeout=600)
                assert p.returncode == 0, (line, p.stdout[-2000:], p.stderr[-2000:])
                outputs.append(p.stdout)
        if while_up is not None:  # (the servers still up)
            outputs.append(json.dumps(while_up()))
    finally:
        for proc in background:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return outputs


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    (tmp_path / "src").symlink_to(REPO / "src")
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_the_install_lines_are_what_make_test_vllm_runs():
    make = (REPO / "Makefile").read_text()
    assert "pip install --quiet -e '.[hf,dev,vllm]'" in make
    assert "pip uninstall --quiet -y torchvision torchaudio torchcodec" in make
    for blocks in (_blocks(REPO / "README.md", "Inside vLLM"), _blocks(REPO / "docs/vllm.md")):
        assert _commands(blocks[0][1])[:2] == INSTALL


def _server_ids(port: int, prompt: str, n: int) -> list[int]:
    """The OpenAI server's greedy completion of ``prompt`` as token ids."""
    body = json.dumps({"model": "src/stmoe/models/tiny-moe", "prompt": prompt, "max_tokens": n,
                       "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        tokens = json.loads(r.read())["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_the_readme_section_runs_and_its_server_answers_as_plain_vllm(scratch, tmp_path):
    prompts = ["def fib(n):", "The history of Rome"]
    outputs = _run_shell(_blocks(REPO / "README.md", "Inside vLLM"), scratch,
                         lambda: [_server_ids(8001, p, 16) for p in prompts])
    assert '"text"' in outputs[-2] and '"completion_tokens":16' in outputs[-2].replace(" ", "")
    served = json.loads(outputs[-1])
    spec = {"model": str(REPO / "src/stmoe/models/tiny-moe"), "prompts": prompts,
            "runs": [{"name": "plain", "stmoe": None, "max_tokens": 16, "batches": [[0, 1]]}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, "-m", "stmoe.vllm_plugin.runs", str(tmp_path / "spec.json"),
                        str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    plain = json.loads((tmp_path / "out.json").read_text())["runs"][0]["tokens"][0]
    assert served == plain  # the plugin's server (4 of 16 experts) = plain vLLM, greedy


def test_docs_vllm_runs(scratch):
    blocks = _blocks(REPO / "docs/vllm.md")
    _run_shell(blocks, scratch)
    assert list((scratch / "routing").glob("*.npz")) and (scratch / "tables.npz").is_file()
    python = [code for lang, code in blocks if lang == "python"]
    assert len(python) == 1
    (scratch / "block.py").write_text(python[0])
    started = time.perf_counter()
    p = subprocess.run([sys.executable, "block.py"], cwd=scratch, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() and "stmoe: offloading 8 MoE layers" in p.stdout + p.stderr, (
        time.perf_counter() - started)
