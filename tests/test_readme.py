"""The README's Python example runs as written (on a synthetic stand-in for chat.npz)."""

from __future__ import annotations

import re
import runpy

from conftest import REPO
from stmoe import save_trace, synthesize


def test_readme_python_example_runs(tmp_path, monkeypatch):
    text = (REPO / "README.md").read_text()
    api = text[text.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", api, re.S).group(1)
    save_trace(synthesize(tokens=400, sequences=2), tmp_path / "chat.npz")
    (tmp_path / "example.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(tmp_path / "example.py"))
    assert (tmp_path / "decode.npz").exists()
