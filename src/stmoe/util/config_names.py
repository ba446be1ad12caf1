"""The names under which transformers' MoE configs give their sizes: one table (no torch).

Why one table: the runtime (``stmoe.offload``'s top-k), the CLI (a --capacity checked from
config.json before torch loads) and the simulator (a spec from a config) read the same
fields; a family added to one list and not the others read differently in each.
"""

from __future__ import annotations

from collections.abc import Mapping

# routed experts per MoE layer: Qwen-MoE / OLMoE, Mixtral / GPT-OSS, DeepSeek
NUM_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
# experts each token is routed to (the router's top-k), most common name first
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k",
         "experts_per_token", "n_activated_experts")


def config_int(config: object, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``config`` gives as an int above zero, the config itself
    first and then its text sub-config (a multimodal model's); None if none does.
    ``config`` is a transformers config or its config.json read as a dict."""
    for cfg in (config, _field(config, "text_config")):
        for name in names:
            value = _field(cfg, name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _field(config: object, name: str) -> object:
    if config is None:
        return None
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
