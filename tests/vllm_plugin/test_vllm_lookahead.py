"""The gate lookahead inside vLLM ranks experts as vLLM's router chooses them: the layer's
router's own routing (grouped top-k with DeepSeek-V3's score-correction bias here) on the
gate's logits, checked against transformers' DeepSeek-V3 router on the same weights, where
the logits alone pick others."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm")
import torch

N, K, GROUPS, KEPT, H = 64, 4, 8, 4, 32


def _vllm_layer(weight: torch.Tensor, bias: torch.Tensor):
    """A model tree as vLLM's: a block with its gate, a runner holding vLLM's CPU router and
    the routed experts."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    router = CPURouter(top_k=K, global_num_experts=N, use_grouped_topk=True,
                       num_expert_group=GROUPS, topk_group=KEPT, renormalize=True,
                       scoring_func="sigmoid", e_score_correction_bias=bias)
    experts = SimpleNamespace(global_num_experts=N)
    runner = torch.nn.Module()
    runner.router = router
    block = torch.nn.Module()
    block.gate = torch.nn.Linear(H, N, bias=False)
    block.gate.weight.data.copy_(weight)
    block.experts = runner
    model = torch.nn.Module()
    model.mlp = block
    return model, experts


def test_the_lookaheads_first_k_are_vllms_grouped_biased_choice():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from stmoe.hf.routers import Router
    from stmoe.vllm_plugin.layers import _router

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(N, H, generator=gen)
    bias = torch.randn(N, generator=gen) + 5  # DeepSeek-V3's are +2 or more
    model, experts = _vllm_layer(weight, bias)
    router = _router(model, "mlp.experts.routed", experts)
    assert router is not None and router.picks is not None
    reference = DeepseekV3TopkRouter(DeepseekV3Config(
        n_routed_experts=N, num_experts_per_tok=K, n_group=GROUPS, topk_group=KEPT,
        hidden_size=H, norm_topk_prob=True))
    with torch.no_grad():
        reference.weight.copy_(weight)
        reference.e_score_correction_bias.copy_(bias)
        x = torch.randn(16, H, generator=gen)
        want = [set(r.tolist()) for r in reference(x)[2]]
    ranked = router.ranked(x, 2 * K)
    assert [set(r.tolist()) for r in ranked[:, :K]] == want
    assert all(len(set(r.tolist())) == 2 * K for r in ranked)
    alone = [set(r.tolist()) for r in Router(weight).ranked(x, K)]
    assert alone != want  # (what the lookahead ranked before: the logits alone)
