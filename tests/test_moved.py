"""stmoe._moved: every old module path still imports, as the very module at its new path
(with a DeprecationWarning), and nothing in the project imports an old path."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from stmoe._moved import MOVED

REPO = Path(__file__).resolve().parents[1]
TORCH_SIDE = ("stmoe.hf.", "stmoe.runtime.", "stmoe.cli.calibrate", "stmoe.demo.")


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_is_the_module_at_its_new_path(old, new):
    if new.startswith(TORCH_SIDE):
        pytest.importorskip("torch")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # the real module keeps its own spec


def test_no_project_file_imports_an_old_path():
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, MOVED)) + r")(?![\w])")
    offenders = []
    for folder in ("src", "tests", "benchmarks", "scripts"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name in ("_moved.py", "test_moved.py", "equivalence.py"):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_former_names_stay_for_one_release():
    from stmoe.evaluate import systems
    from stmoe.sim import specs
    from stmoe.sim.accelerator import systems as paper

    assert systems.COMPARED_SYSTEMS is systems.OFFLOAD_SYSTEMS
    assert paper.PAPER_SYSTEMS == paper.DEFAULT_SYSTEMS == (*paper.PAPER_BASELINES, "stmoe",
                                                             "oracle")
    assert specs.load_model is specs.model_preset and specs.load_hardware is specs.hardware_preset


def test_the_runtime_s_former_names_stay_for_one_release():
    pytest.importorskip("torch")
    from stmoe.errors import OffloadError, StoreError
    from stmoe.runtime import forced_routing as fr
    from stmoe.runtime.api import OffloadedModel

    assert issubclass(StoreError, OffloadError)
    assert OffloadedModel.replay is OffloadedModel.force_routing
    assert fr.plan_replay is fr.plan_routing and fr.ReplayPlan is fr.RoutingPlan
    assert fr.RoutingReplay is fr.RoutingSource and fr.RoutingReplayError is fr.ForcedRoutingError
