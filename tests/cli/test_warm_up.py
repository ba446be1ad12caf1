"""Compile before timing (issue 45): in a fresh environment the first stmoe-plus run
compiled numba's kernels inside its timed decode; `stmoe generate` now calls them first,
on a copy of the run's predictor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import numpy as np
from stmoe.models import SHIPPED_MODEL, SHIPPED_TABLES
from stmoe.predictors import load_tables, make
from stmoe.predictors.plus import steps
from stmoe.cli.warm_up import warm_predictor

tables = load_tables(SHIPPED_MODEL / SHIPPED_TABLES)
p = make("stmoe-plus", tables.shape, tables)
kernels = (steps.plus_predict, steps.plus_learn)
assert all(not k.signatures for k in kernels), "compiled before the warm-up"
before = p.predict(1, 0)
warm_predictor(p, 8)
assert all(k.signatures for k in kernels), "the warm-up left a kernel uncompiled"
assert np.array_equal(p.predict(1, 0), before) and not p._current, "the run's state changed"
print("ok")
"""


def test_the_warm_up_compiles_the_predictors_kernels_on_a_copy():
    """In a fresh process (a kernel compiles, or loads from numba's cache, at its first call
    in each process): none compiled before, both after, the predictor's state unchanged."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_generate_warms_up_before_timing_and_says_so(cli, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    report = tmp_path / "run.json"
    result = cli("generate", "--prompt", "def f(x):", "--max-new-tokens", "2",
                 "--predictor", "stmoe-plus", "--json", report)
    assert result.exit_code == 0, result.output
    assert "before timing: the predictor's and the cache's kernels compiled or loaded" in (
        " ".join(result.output.split()))
    assert json.loads(report.read_text())["warm_up_s"] >= 0
