"""``install`` undone by ``uninstall``, so that several engines run one after another in one
process each take their own settings (``stmoe.vllm_plugin.runs``' in-process runs, which
most live tests use). Skipped where vLLM is not installed (``make test`` runs these in
``.venv-vllm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")

from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from stmoe.vllm_plugin.install import install, uninstall

PATCHED = [(CPUModelRunner, "load_model"), (CPUWorker, "shutdown"),
           (DefaultModelLoader, "get_all_weights"),
           (DefaultModelLoader, "track_weights_loading"),
           (UnquantizedFusedMoEMethod, "process_weights_after_loading")]


def methods() -> list[object]:
    """Each patched method as its class answers it, and whether the class holds its own."""
    return [(getattr(owner, name), name in owner.__dict__) for owner, name in PATCHED]


def test_uninstall_restores_every_method_and_the_next_install_takes_its_own_settings():
    uninstall()  # (whatever an earlier test of this process left)
    before = methods()
    install("capacity=4,experts=stream")
    assert all(a[0] is not b[0] for a, b in zip(methods(), before, strict=True))
    assert CPUModelRunner._stmoe_config.experts == "stream"
    install("capacity=6")  # installed already: the first settings stay (vLLM's hook, again)
    assert CPUModelRunner._stmoe_config.experts == "stream"
    uninstall()
    assert methods() == before and CPUModelRunner._stmoe_config is None
    install("capacity=6")  # loaded experts: vLLM's loader left as it is
    assert CPUModelRunner._stmoe_config.experts == "loaded"
    assert methods()[2:] == before[2:] and methods()[:2] != before[:2]
    uninstall()
    uninstall()  # twice: nothing to undo
    assert methods() == before
