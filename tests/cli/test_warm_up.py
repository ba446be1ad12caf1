"""Compile before timing (issue 45): in a fresh environment the first stmoe-plus run
compiled numba's kernels inside its timed decode; `stmoe generate` now calls them first,
on a copy of the run's predictor."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

_PROBE = """
import numpy as np
from stmoe.models import SHIPPED_MODEL, SHIPPED_TABLES
from stmoe.predictors import load_tables, make
from stmoe.predictors.plus import steps
from stmoe.runtime.warm_up import warm_predictor

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


def test_every_predictor_warms_up_and_keeps_its_state():
    """Each registered predictor (hybrid and gate-lookahead with their lookahead) goes
    through the warm-up, its own slots and learned tables untouched."""
    import numpy as np

    from stmoe.models import SHIPPED_MODEL, SHIPPED_TABLES
    from stmoe.predictors import PredictorError, load_tables, make, names
    from stmoe.runtime.warm_up import warm_predictor

    tables = load_tables(SHIPPED_MODEL / SHIPPED_TABLES)
    warmed = []
    for name in names():
        try:
            p = make(name, tables.shape, tables)
        except PredictorError:
            continue  # stmoe-mix: tables of `profile --by-domain`
        if p.sees_future:
            continue  # the oracle: the runtime replays a first pass, no kernel to warm
        if p.uses_lookahead:
            p.use_lookahead_point("early")
        p.update(0, np.arange(tables.shape.top_k), 0)
        untouched = copy.deepcopy(p)  # random's draws too: the same generator state
        warm_predictor(p, 8)
        assert np.array_equal(p.predict(1, 0), untouched.predict(1, 0)), name
        assert list(p._current) == [0], name
        warmed.append(name)
    assert {"stmoe", "stmoe-plus", "hybrid", "cct-online"} <= set(warmed)
