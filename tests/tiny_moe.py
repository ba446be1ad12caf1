"""Tiny random-weight MoE models of every family capture supports (no download).

Shapes are cut to the bone (hidden 32, 2-4 layers, 8 experts) but keep each
family's structure: DeepSeek's leading dense layers, Qwen2-MoE's shared expert
and ``mlp_only_layers``, group-limited routing.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

COMMON: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": False,
}

FAMILIES: dict[str, tuple[str, dict[str, Any], int]] = {
    # name: (config class, overrides, expected MoE layers)
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}, 3),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 16,
                                     "shared_expert_intermediate_size": 32,
                                     "decoder_sparse_step": 1, "mlp_only_layers": [1]}, 2),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 16, "head_dim": 8,
                                     "decoder_sparse_step": 1, "mlp_only_layers": []}, 3),
    "deepseek_v2": ("DeepseekV2Config", {"n_routed_experts": 8, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 16, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "kv_lora_rank": 16,
                                         "q_lora_rank": None, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1,
                                         "topk_group": 1, "topk_method": "greedy",
                                         "num_key_value_heads": 4}, 2),
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 8, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 16, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "kv_lora_rank": 16,
                                         "q_lora_rank": 16, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1,
                                         "topk_group": 1, "num_key_value_heads": 4}, 2),
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2}, 3),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 8,
                                 "sliding_window": 16,
                                 "layer_types": ["sliding_attention", "full_attention",
                                                 "sliding_attention"]}, 3),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}, 3),
    "phimoe": ("PhimoeConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}, 3),
    # hybrid linear/full attention: its cache cannot always report a length
    "qwen3_next": ("Qwen3NextConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 16, "head_dim": 8,
                                       "shared_expert_intermediate_size": 16,
                                       "decoder_sparse_step": 1, "mlp_only_layers": [],
                                       "num_hidden_layers": 4}, 4),
}


def tiny_model(family: str, seed: int = 0, **changes: Any) -> tuple[torch.nn.Module, int]:
    """A random tiny model of ``family`` in eval mode, and its number of MoE layers."""
    config_name, overrides, moe_layers = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **overrides, **changes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # bias-free random routers can tie; spread their weights out
        for name, p in model.named_parameters():
            if "gate" in name or "router" in name:
                p.normal_(0, 1.0)
    return model.eval(), moe_layers


def packed_with_tables(family: str, root: Any,
                       **changes: Any) -> tuple[torch.nn.Module, Any, Any]:
    """A tiny ``family`` model (``changes`` to its config), its store packed under ``root``
    and ST-MoE tables profiled on its own routing (two short prompts): what a test of the
    runtime with prefetch needs."""
    from stmoe.hf.capture_generate import capture_generation
    from stmoe.predictors import profile, save_tables
    from stmoe.runtime.store import pack

    model, _ = tiny_model(family, **changes)
    store = pack(model, root / "store")
    trace = capture_generation(model, [[20, 21, 22, 23], [30, 31]], max_new_tokens=8)
    return model, store, save_tables(profile(trace), root / "tables.npz")
