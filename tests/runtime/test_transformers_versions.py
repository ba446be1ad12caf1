"""What stmoe reads of transformers' modules holds in every transformers 5 release it runs
on, the GPU machines' 5.17 included (``make test-gpu-versions`` runs the glue's tests with
5.17 itself). Each case here is a difference found between 5.17 and newer releases that
broke stmoe silently or loudly: the experts modules' marker, the KV cache's keyword, the
post-expert norm's flag."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from stmoe.errors import OffloadError
from stmoe.hf.layout import experts_modules
from stmoe.runtime.batcher.step_forward import cache_keyword
from tiny_moe import tiny_model


def test_experts_modules_are_found_without_the_expert_parallel_flag_newer_releases_add():
    model, moe_layers = tiny_model("qwen3_moe")
    for _, m in experts_modules(model):
        m.__dict__.pop("_is_expert_parallel", None)  # what 5.17's decorator never sets
    assert len(experts_modules(model)) == moe_layers


@pytest.mark.parametrize(("name", "want"), [("cache", "cache"),
                                             ("past_key_values", "past_key_values")])
def test_the_kv_cache_goes_by_the_name_the_attention_forward_takes(name, want):
    ns: dict[str, object] = {}
    exec(f"def forward(hidden_states, attention_mask=None, {name}=None, **kwargs): pass", ns)
    assert cache_keyword(ns["forward"]) == want  # type: ignore[arg-type]


def test_an_attention_forward_with_no_known_cache_name_is_refused_not_run_without_it():
    def forward(hidden_states: torch.Tensor, **kwargs: object) -> None: ...

    with pytest.raises(OffloadError, match="cache, past_key_values"):
        cache_keyword(forward)


def test_the_shipped_families_attention_takes_the_cache_by_a_known_name():
    model, _ = tiny_model("qwen2_moe")
    attn = next(m for n, m in model.named_modules() if n.endswith("self_attn"))
    assert cache_keyword(attn.forward) in ("cache", "past_key_values")


def test_the_quantized_forward_runs_where_experts_have_no_post_expert_norm_flag():
    from stmoe.quant import parse_format
    from stmoe.quant.experts import quantize_model

    model, _ = tiny_model("qwen2_moe")
    quantize_model(model, parse_format("int8"))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for _, m in experts_modules(model):
            m.__dict__.pop("has_post_expert_norm", None)  # 5.17's decorator sets none
            assert not hasattr(m, "has_post_expert_norm")
        assert torch.equal(model(input_ids=ids).logits, want)
