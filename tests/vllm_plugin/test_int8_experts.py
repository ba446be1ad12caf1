"""Quantized experts inside vLLM: stmoe's shipped model quantized by ``stmoe quantize``
(routed experts int8, compressed-tensors W8A8), served by vLLM's CPU int8 kernel
(``CPUExpertsInt8``) with the plugin on gives plain vLLM's greedy tokens on the same
checkpoint, bit for bit, at top-k, 50% and 100% of the experts cached and at 8, 4 and 1
concurrent requests; the store holds the int8 bytes and their scales; and what the plugin
cannot serve of it (experts=stream) is refused in one line. Skipped where vLLM is not
installed (``make test`` runs these in ``.venv-vllm``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")

from stmoe.models import SHIPPED_MODEL
from stmoe.quant.vllm_checkpoint import quantize_checkpoint
from stmoe.runtime.store import ExpertStore
from vllm_runs import BATCHES, PROMPTS, drive, start

# vLLM 0.30's CPU int8 MoE kernel (CPUExpertsInt8) runs only where the CPU has AMX tiles; on
# one without (an AMD EPYC, a CI machine of 2026-12-06) plain vLLM cannot load the int8
# checkpoint at all ("No Int8 MoE backend supports the deployment configuration")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)(),
    reason="this CPU has no AMX tiles: vLLM's CPU int8 MoE kernel, plain vLLM's too, "
           "needs them (docs/vllm.md)")

NEW = 12
PLUGIN = [("top-k, stmoe-plus", "capacity=4,predictor=stmoe-plus"),
          ("50%, stmoe", "capacity=50%,predictor=stmoe"),
          ("100%, lru-only", "capacity=100%,predictor=ondemand")]


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-int8")
    model = tmp / "tiny-moe-int8"
    quantize_checkpoint(SHIPPED_MODEL, model, "int8")
    runs = [{"name": "plain", "stmoe": None, "max_tokens": NEW, "batches": BATCHES}]
    runs += [{"name": name, "stmoe": f"{text},store={tmp / 'store'}", "max_tokens": NEW,
              "batches": BATCHES} for name, text in PLUGIN]
    results, log = drive(tmp, model, runs, dtype="bfloat16", prefix_caching=False)
    return tmp, model, results, log


def test_int8_experts_give_plain_vllms_tokens_at_every_capacity_and_concurrency(driven):
    _, _, runs, log = driven
    plain = runs["plain"]["tokens"]
    assert all(len(t) == NEW for b in plain for t in b)
    for name, _ in PLUGIN:
        assert runs[name]["tokens"] == plain, name
    lines = [x for x in log.splitlines() if "stmoe: offloading 8 MoE layers" in x]
    assert len(lines) == len(PLUGIN)
    assert all("experts int8 W8A8 (the checkpoint's" in x for x in lines)  # named: lossy


def test_the_store_holds_the_int8_experts_and_their_scales(driven):
    tmp, _, _, _ = driven
    store = ExpertStore(tmp / "store")
    assert store.model["model_type"] == "qwen2_moe@vllm-cpu-CPUExpertsInt8-int8"
    block = store.blocks[(0, 0)]
    assert [t.name for t in block.tensors] == ["w13_weight", "w2_weight", "w13_weight_scale",
                                               "w2_weight_scale"]
    assert [t.dtype for t in block.tensors] == ["int8", "int8", "float32", "float32"]
    # a quarter of the float32 experts' bytes, give or take the scales and the kernel's packing
    float_bytes = 3 * 96 * 192 * 4
    assert block.nbytes < 0.3 * float_bytes


def test_streaming_quantized_experts_is_refused_in_one_line(driven, tmp_path):
    _, model, _, _ = driven
    p = start(tmp_path, {"model": str(model), "prompts": PROMPTS[:1], "dtype": "bfloat16",
                         "runs": [{"name": "stream", "stmoe": "capacity=4,experts=stream",
                                   "max_tokens": 2, "batches": [[0]]}]})
    assert p.returncode != 0
    assert ("stmoe: experts=stream reads unquantized checkpoints only; tiny-moe-int8's experts "
            "are int8 W8A8") in p.stdout + p.stderr
    assert not (tmp_path / "out.json").exists() or not json.loads(
        (tmp_path / "out.json").read_text())["runs"]
