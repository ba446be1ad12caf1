"""The plugin inside the real vLLM in bfloat16 on stmoe's shipped model (test_live.py is
float32's): bfloat16 takes another of vLLM's CPU kernels, allowed with ``kernel=variants``.
Skipped where vLLM is not installed (``make test`` runs these in ``.venv-vllm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")

from stmoe.models import SHIPPED_MODEL
from vllm_runs import BATCHES, drive

NEW = 12


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-bf16")
    runs = [{"name": name, "stmoe": text, "max_tokens": NEW, "batches": BATCHES}
            for name, text in (("plain bf16", None),
                               ("top-k bf16", "capacity=4,predictor=stmoe-plus,"
                                "kernel=variants"))]
    results, log = drive(tmp, SHIPPED_MODEL, runs, dtype="bfloat16")
    return tmp, results, log


def test_in_bfloat16_too(driven):
    """bfloat16 takes another of vLLM's CPU kernels (AMX where the CPU has it), allowed with
    kernel=variants: on the shipped model the same tokens as plain vLLM in bfloat16, at
    top-k, every concurrency (not at every shape: docs/vllm.md)."""
    _, runs, log = driven
    assert log.count("stmoe: offloading 8 MoE layers") == 1  # the plugin ran, once
    plain = runs["plain bf16"]["tokens"]
    assert all(len(t) == NEW for b in plain for t in b)
    assert runs["top-k bf16"]["tokens"] == plain
