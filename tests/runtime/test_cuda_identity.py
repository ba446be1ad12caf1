"""On CUDA (the ``cuda`` marker; skipped on CI, which has no GPU): the offloaded model's
tokens and logits are the GPU-resident model's bit for bit in every family the CPU tests
cover, for every predictor, at capacities from top-k to all, from pinned memory (``gpu``)
and from disk (``gpu-disk``); and a race stress: capacity top-k, three prefetch workers,
hundreds of tokens, every copy racing the compute that reads the slots.

The CPU runs the same matrix on the disk tier (test_runtime.py) and the gpu tiers' event
protocol on its stand-in (test_slot_events.py); these are what only a GPU can show: CUDA's
own streams, events and kernels. The matrix is cut to what the GPU check's cuda stage has
time for: every family with two predictors at top-k and all, and every predictor on one
family at three capacities and both tiers.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.predictors import REGISTRY  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from tiny_moe import FAMILIES, packed_with_tables, tiny_model  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CI has none")]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
NEW = 6
PREDICTORS = ("ondemand", "stmoe", "random", "oracle", "stmoe-plus", "hybrid", "gate-lookahead")


def _generate(model: torch.nn.Module, new: int = NEW) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy tokens and logits of a batch of two (left padding) on CUDA, back on the CPU."""
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS]).cuda()
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS]).cuda()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences.cpu(), [x.cpu() for x in out.logits]


def _same(got, want, where: str) -> None:
    assert torch.equal(got[0], want[0]), where
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True)), where


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    model, store, tables = packed_with_tables(name, tmp_path_factory.mktemp(name))
    want = _generate(model.cuda())
    return name, store, tables, want


def _offloaded(name, store, tables, predictor, capacity, tier, workers=None, new=NEW,
               **changes):
    fresh, _ = tiny_model(name, **changes)
    with offload(fresh, store, capacity=capacity, predictor=predictor,
                 tables=tables if REGISTRY[predictor].needs_tables else None, tier=tier,
                 **({"workers": workers} if workers is not None else {})) as om:
        got, _ = om.measure(lambda om=om: _generate(om.model, new))  # (the oracle's two passes)
        om.engine.check()
    return got


def test_every_family_offloaded_on_cuda_is_the_gpu_resident_model(family):
    name, store, tables, want = family
    top_k, n = 2, 8  # every tiny family routes 2 of 8
    for predictor in ("ondemand", "stmoe-plus"):
        for capacity in (top_k, n):
            _same(_offloaded(name, store, tables, predictor, capacity, "gpu"), want,
                  f"{name}, {predictor}, capacity {capacity}, gpu")
    _same(_offloaded(name, store, tables, "stmoe-plus", top_k, "gpu-disk"), want,
          f"{name}, stmoe-plus, capacity {top_k}, gpu-disk")


@pytest.mark.parametrize("predictor", PREDICTORS)
def test_every_predictor_offloaded_on_cuda_is_the_gpu_resident_model(predictor, tmp_path):
    model, store, tables = packed_with_tables("qwen3_moe", tmp_path)
    want = _generate(model.cuda())
    for tier in ("gpu", "gpu-disk"):
        for capacity in (2, 5, 8):
            _same(_offloaded("qwen3_moe", store, tables, predictor, capacity, tier), want,
                  f"qwen3_moe, {predictor}, capacity {capacity}, {tier}")


@pytest.mark.parametrize("tier", ["gpu", "gpu-disk"])
def test_a_race_stress_of_hundreds_of_tokens_at_top_k_with_three_workers(tier, tmp_path):
    """Capacity top-k: every slot is rewritten nearly every layer while the kernels of the
    layer before may still read it; three workers' copies race the compute's. Any copy that
    lands before a slot's readers are done, or a read before its copy landed, changes a
    token or a logit somewhere in 300."""
    longer = {"max_position_embeddings": 512}  # (the tiny models' 128 positions)
    model, store, tables = packed_with_tables("qwen2_moe", tmp_path, **longer)
    want = _generate(model.cuda(), 300)
    got = _offloaded("qwen2_moe", store, tables, "stmoe-plus", 2, tier, workers=3, new=300,
                     **longer)
    _same(got, want, f"race stress, {tier}")
