"""Old module paths, kept importable for one release after the restructure of 0.2.

Why: code outside the project imports stmoe's modules by path; moving a module must not
break it at once. An import of an old path gets the module at its new path (the same
object, so patches and ``isinstance`` agree) and a ``DeprecationWarning`` naming the new
path. Nothing in the project imports an old path (a test checks that). Remove in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    "stmoe._numba": "stmoe.util.jit",
    "stmoe._progress": "stmoe.util.progress",
    "stmoe.fileio": "stmoe.util.fileio",
    "stmoe.metrics": "stmoe.evaluate.metrics",
    "stmoe.replay": "stmoe.evaluate.replay",
    "stmoe.cache_replay": "stmoe.evaluate.cache_replay",
    "stmoe.systems": "stmoe.evaluate.systems",
    "stmoe.demo_report": "stmoe.demo.report",
    "stmoe.demo_text": "stmoe.demo.text",
    "stmoe.demo_plots": "stmoe.demo.plots",
    "stmoe.capture": "stmoe.hf.capture",
    "stmoe.capture_generate": "stmoe.hf.capture_generate",
    "stmoe.checkpoints": "stmoe.hf.checkpoints",
    "stmoe.train_tiny": "stmoe.hf.train_tiny",
    "stmoe.model_introspect": "stmoe.hf.layout",
    "stmoe.runtime.loading": "stmoe.hf.loading",
    "stmoe.runtime.store_index": "stmoe.runtime.store.index",
    "stmoe.runtime.store_check": "stmoe.runtime.store.check",
    "stmoe.runtime.pack_stream": "stmoe.runtime.store.pack_stream",
    "stmoe.runtime.tiers": "stmoe.runtime.store.tiers",
    "stmoe.sim.pipeline": "stmoe.sim.accelerator.pipeline",
    "stmoe.sim.systems": "stmoe.sim.accelerator.systems",
    "stmoe.sim.simulate": "stmoe.sim.accelerator.simulate",
    "stmoe.sim.plots": "stmoe.sim.accelerator.plots",
    "stmoe.sim.host_link": "stmoe.sim.host.link",
    "stmoe.sim.host_systems": "stmoe.sim.host.systems",
    "stmoe.sim.calibrated": "stmoe.sim.host.calibrated",
    "stmoe.sim.check_plot": "stmoe.sim.host.check_plot",
    "stmoe.predictors.stmoe": "stmoe.predictors.st_moe",
    "stmoe.cli._common": "stmoe.cli.common",
    "stmoe.cli.analyze_cmd": "stmoe.cli.analyze",
    "stmoe.cli.calibrate_cmd": "stmoe.cli.calibrate",
    "stmoe.cli.capture_cmd": "stmoe.cli.capture",
    "stmoe.cli.generate_cmd": "stmoe.cli.generate",
    "stmoe.cli.make_model_cmd": "stmoe.cli.make_model",
    "stmoe.cli.pack_cmd": "stmoe.cli.pack",
    "stmoe.cli.predict_cmds": "stmoe.cli.predict",
    "stmoe.cli.simulate_cmd": "stmoe.cli.simulate",
    "stmoe.cli.trace_cmds": "stmoe.cli.trace",
    "stmoe.cli.train_cmd": "stmoe.cli.train_tiny",
    "stmoe.runtime.routing_replay": "stmoe.runtime.forced_routing",
    "stmoe.runtime.admission": "stmoe.admission",
    "stmoe.runtime.serve": "stmoe.runtime.experts_path",
    "stmoe.runtime.batching": "stmoe.runtime.batcher",
    "stmoe.runtime.requests": "stmoe.runtime.batcher.requests",
    "stmoe.runtime.step_forward": "stmoe.runtime.batcher.step_forward",
    "stmoe.runtime.step_rows": "stmoe.runtime.batcher.step_rows",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds only the names in ``MOVED``; loads each as its new module."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}  # old name -> real spec

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the real module: give it its own back
        module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    """Put the finder last on ``sys.meta_path`` (real modules are always found first)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
