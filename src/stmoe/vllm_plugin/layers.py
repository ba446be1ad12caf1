"""vLLM's routed-experts layers as the plugin finds, checks and computes them.

Why these checks: the plugin keeps the experts in stmoe's slots and renumbers the router's
ids to slot numbers before vLLM's own MoE kernel runs. That is lossless only where the
kernel's result for a token does not depend on how its experts are numbered, nor on the
other tokens of the batch (vLLM's CPU grouped-GEMM kernels, ``CPUUnquantizedExperts`` and
its ISA variants such as the AMX one bfloat16 takes: each token's top-k outputs weighted
and summed in routing order; tested bit for bit in tests/vllm_plugin, float32 and
bfloat16), and where one expert's weights are one row of each weight tensor (unquantized
weights; no expert parallelism, no biases). Anything else is refused in one line naming
the layer and why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stmoe.vllm_plugin.config import PluginConfigError

# the per-expert weights the plugin moves, in block order (vLLM's names)
WEIGHTS = ("w13_weight", "w2_weight")


@dataclass(frozen=True)
class MoeLayer:
    """One routed-experts layer of a vLLM model: its module, its router's weight (the
    gate beside it, for the gate lookahead; None where not found) and its place."""

    name: str
    module: torch.nn.Module  # vLLM's RoutedExperts
    router: torch.Tensor | None
    index: int  # its number among the model's MoE layers


def routed_experts_class() -> type:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return RoutedExperts


def find_layers(model: torch.nn.Module, variants: bool = False) -> list[MoeLayer]:
    """The model's routed-experts layers in order, each checked (``check_layer``)."""
    cls = routed_experts_class()
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]
    if not found:
        raise PluginConfigError(f"stmoe: {type(model).__name__} has no routed-experts layer "
                                "(RoutedExperts) to offload")
    layers = []
    for i, (name, module) in enumerate(found):
        check_layer(name, module, variants)
        layers.append(MoeLayer(name, module, _router(model, name, module), i))
    shapes = {(w, tuple(getattr(m.module, w).shape[1:])) for m in layers for w in WEIGHTS}
    if len(shapes) != len(WEIGHTS):
        raise PluginConfigError("stmoe: the MoE layers' experts differ in shape; the plugin "
                                "serves models whose MoE layers are alike")
    return layers


def check_layer(name: str, module: torch.nn.Module, variants: bool = False) -> None:
    """Refuse a layer whose kernel the plugin cannot feed slots losslessly."""
    method = module.quant_method
    why = None
    if type(method).__name__ != "UnquantizedFusedMoEMethod":
        why = f"its weights are quantized by vLLM ({type(method).__name__})"
    elif getattr(method, "is_monolithic", False):
        why = "its kernel routes inside itself (monolithic), so no ids can be renumbered"
    elif getattr(module, "expert_map", None) is not None:
        why = "it uses expert parallelism (an expert map)"
    elif module.global_num_experts != module.local_num_experts:
        why = "its experts are split across ranks"
    elif hasattr(module, "w13_bias") or hasattr(module, "w2_bias"):
        why = "its experts have biases"
    elif getattr(method, "moe_kernel", None) is None:
        why = "vLLM built no MoE kernel for it"
    else:
        kernel = type(method.moe_kernel.fused_experts)
        family = {c.__name__ for c in kernel.__mro__}
        if "CPUUnquantizedExperts" not in family or getattr(
                method.moe_kernel.fused_experts, "_use_zentorch", False):
            why = (f"its kernel is {kernel.__name__}; the plugin serves vLLM's CPU "
                   "grouped-GEMM kernels only (CPUUnquantizedExperts and its ISA variants)")
        elif kernel.__name__ != "CPUUnquantizedExperts" and not variants:
            why = (f"its kernel is {kernel.__name__} (vLLM picks it for "
                   f"{str(module.w13_weight.dtype).removeprefix('torch.')} here), which is not "
                   "checked bit for bit: at a real shape and 8 requests its tokens differed "
                   "from plain vLLM's, and plain vLLM's from run to run; use float32 (the "
                   "portable kernel), or allow it with kernel=variants (docs/vllm.md)")
    rows = 1 if getattr(module, "_stmoe_streamed", False) else module.global_num_experts
    if why is None:  # (streamed: one stand-in expert, the store holds them all)
        for w in WEIGHTS:
            t = getattr(module, w, None)
            if t is None or t.dim() != 3 or t.shape[0] != rows:
                why = f"{w} is not one row per expert"
                break
    if why is not None:
        raise PluginConfigError(f"stmoe: cannot offload MoE layer {name}: {why}")


def _router(model: torch.nn.Module, name: str, module: torch.nn.Module) -> torch.Tensor | None:
    """The router weight [N, H] beside the layer: a ``gate`` child of an enclosing block."""
    n = module.global_num_experts
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[:cut]))
        gate = getattr(parent, "gate", None)
        w = getattr(gate, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == n:
            return w
    return None
