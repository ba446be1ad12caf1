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

Quantized experts: a checkpoint quantized for vLLM's CPU int8 kernel (``CPUExpertsInt8``,
compressed-tensors W8A8: int8 weights with one scale per output row, activations quantized
per token as the kernel runs; ``stmoe quantize`` writes one) is served the same way, each
expert's scales moving with its weights (``QUANTIZED``): its tokens are plain vLLM's on the
same quantized checkpoint, bit for bit (tested). The quantization is the checkpoint's,
chosen by whoever made it, and named in the plugin's log line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stmoe.hf.routers import Router, picks_top_k
from stmoe.vllm_plugin.config import PluginConfigError

# the per-expert weights the plugin moves, in block order (vLLM's names)
WEIGHTS = ("w13_weight", "w2_weight")


@dataclass(frozen=True)
class QuantizedKernel:
    """One of vLLM's quantized CPU MoE kernels the plugin serves: the methods that build it,
    the per-expert scales moved with the weights, after them in a block,
    each with the kernel's quant_config field that holds it (``_w1.scale``: the kernel reads
    it there, not from its arguments), and what the log calls the format."""

    methods: tuple[str, ...]
    scales: tuple[tuple[str, str, str], ...]
    name: str


QUANTIZED = {
    "CPUExpertsInt8": QuantizedKernel(
        ("CompressedTensorsW8A8Int8MoEMethod",),
        (("w13_weight_scale", "_w1", "scale"), ("w2_weight_scale", "_w2", "scale")),
        "int8 W8A8 (the checkpoint's: int8 weights, one scale per row; activations "
        "quantized per token by vLLM's kernel)"),
}


@dataclass(frozen=True)
class MoeLayer:
    """One routed-experts layer of a vLLM model: its module, its router (the
    gate beside it, for the gate lookahead; None where not found) and its place."""

    name: str
    module: torch.nn.Module  # vLLM's RoutedExperts
    router: Router | None
    index: int  # its number among the model's MoE layers

    @property
    def quantized(self) -> QuantizedKernel | None:
        """Its quantized kernel, or None (unquantized weights)."""
        return QUANTIZED.get(kernel_name(self.module))

    @property
    def scales(self) -> tuple[tuple[str, str, str], ...]:
        """Its per-expert scales (a quantized kernel's): (parameter, quant_config desc,
        field); none for an unquantized layer."""
        return self.quantized.scales if self.quantized is not None else ()

    @property
    def params(self) -> tuple[str, ...]:
        """Its per-expert tensors, in the order a store block holds them."""
        return (*WEIGHTS, *(p for p, _, _ in self.scales))


def kernel_name(module: torch.nn.Module) -> str:
    """The class name of the layer's vLLM MoE kernel (its fused experts)."""
    return type(module.quant_method.moe_kernel.fused_experts).__name__


def routed_experts_class() -> type:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return RoutedExperts


def find_layers(model: torch.nn.Module, variants: bool = False,
                own: bool = False) -> list[MoeLayer]:
    """The model's routed-experts layers in order, each checked (``check_layer``; ``own``:
    computed by stmoe's kernels, not vLLM's)."""
    cls = routed_experts_class()
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]
    if not found:
        raise PluginConfigError(f"stmoe: {type(model).__name__} has no routed-experts layer "
                                "(RoutedExperts) to offload")
    layers = []
    for i, (name, module) in enumerate(found):
        check_layer(name, module, variants, own)
        layers.append(MoeLayer(name, module, _router(model, name, module), i))
    shapes = {(w, tuple(getattr(m.module, w).shape[1:])) for m in layers for w in m.params}
    if len(shapes) != len(layers[0].params):
        raise PluginConfigError("stmoe: the MoE layers' experts differ in shape; the plugin "
                                "serves models whose MoE layers are alike")
    return layers


def check_layer(name: str, module: torch.nn.Module, variants: bool = False,
                own: bool = False) -> None:
    """Refuse a layer whose kernel the plugin cannot feed slots losslessly (``own``: its
    experts computed by stmoe's kernels, so vLLM's kernel is not checked; an unquantized
    checkpoint still, as ``own_format.check_own`` checks the rest)."""
    method = module.quant_method
    kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    quantized = QUANTIZED.get(type(kernel).__name__)
    why = None
    if type(method).__name__ != "UnquantizedFusedMoEMethod" and (
            quantized is None or type(method).__name__ not in quantized.methods):
        why = (f"its weights are quantized by vLLM ({type(method).__name__}, kernel "
               f"{type(kernel).__name__}); the plugin serves unquantized experts and vLLM's "
               "CPU int8 kernel (CPUExpertsInt8: a compressed-tensors W8A8 checkpoint)")
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
    elif own and quantized is not None:
        why = ("the checkpoint's experts are quantized already; format= quantizes an "
               "unquantized checkpoint's")
    elif own:
        pass
    elif quantized is not None:
        why = _check_scales(module, quantized.scales)
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
        scales = quantized.scales if quantized is not None else ()
        for w in (*WEIGHTS, *(p for p, _, _ in scales)):
            t = getattr(module, w, None)
            if t is None or t.dim() != 3 or t.shape[0] != rows:
                why = f"{w} is not one row per expert"
                break
    if why is not None:
        raise PluginConfigError(f"stmoe: cannot offload MoE layer {name}: {why}")


def _check_scales(module: torch.nn.Module, scales: tuple[tuple[str, str, str], ...]) -> str | None:
    """Why the quantized kernel's scales cannot move with the experts (None: they can): each
    must be the very tensor its quant_config field holds, which the kernel reads."""
    config = module.quant_method.moe_kernel.fused_experts.quant_config
    for param, desc, field in scales:
        held = getattr(getattr(config, desc, None), field, None)
        if held is None or held is not getattr(module, param, None):
            return f"its kernel's quant_config.{desc}.{field} is not the layer's {param}"
    return None


def _router(model: torch.nn.Module, name: str, module: torch.nn.Module) -> Router | None:
    """The router beside the layer: a ``gate`` child of an enclosing block, its weight [N, H]
    (or where vLLM's CPU linear dispatch packed it away, read back: ``_unpacked``), with vLLM's
    own routing of its logits where the layer's runner has one (``VllmRouting``)."""
    n = module.global_num_experts
    parts = name.split(".")
    routing = None
    for cut in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[:cut]))
        routing = routing or _routing(getattr(parent, "router", None))
        gate = getattr(parent, "gate", None)
        w = getattr(gate, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == n:
            return _with_routing(w, routing)
        if (gate is not None and getattr(gate, "output_size", None) == n
                and callable(getattr(gate, "cpu_linear", None))):
            return _with_routing(_unpacked(gate), routing)
    return None


class VllmRouting(torch.nn.Module):
    """vLLM's own routing of a gate's logits, for the gate lookahead: the layer's router's
    ``_compute_routing`` (the pure step of its ``select_experts``: no routing capture, no
    expert-load record), so the lookahead's first K are vLLM's choice for that input,
    grouped top-k and a score-correction bias included (DeepSeek-V3's, GLM-4.5's), as
    transformers' router modules give it (``hf.routers``)."""

    def __init__(self, weight: torch.Tensor, router: object) -> None:
        super().__init__()
        self.gate_weight, self.router = weight.detach(), router
        self.eval()  # (a routing step, never training)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = hidden.detach().to(torch.float32) @ self.gate_weight.to(torch.float32).T
        weights, ids = self.router._compute_routing(hidden, logits, None)  # type: ignore[attr-defined]
        return logits, weights, ids


# vLLM's routers whose routing step is pure (a routing simulator draws from torch's global
# random state; a zero-expert router keeps state and gives duplicate ids: not asked)
PURE_ROUTERS = ("CPURouter", "GroupedTopKRouter", "FusedTopKRouter", "FusedTopKBiasRouter")


def _routing(router: object) -> object | None:
    """``router`` where it is one of vLLM's routers with a pure routing step, else None."""
    return (router if type(router).__name__ in PURE_ROUTERS
            and callable(getattr(router, "_compute_routing", None)) else None)


def _with_routing(weight: torch.Tensor, routing: object | None) -> Router:
    """The gate's ``Router``: with vLLM's routing where it answers as a top-k router does
    and ranks otherwise than the logits (``hf.routers.picks_top_k``: grouped top-k, a bias),
    else ranked by its logits alone (a softmax router's top-k is theirs)."""
    if routing is None:
        return Router(weight)
    picks = VllmRouting(weight, routing)
    return Router(weight, picks if picks_top_k(picks, weight) else None)


def _unpacked(gate: torch.nn.Module) -> torch.Tensor:
    """A gate's weight [N, H] that vLLM's CPU dispatch (``dispatch_cpu_unquantized_gemm``)
    packed for its own kernel, leaving ``weight`` empty: read back through that kernel as
    its product with the identity (each output one weight times 1, plus zeros: exact). The
    gate lookahead (``hybrid``) needs it; before, hybrid could not start."""
    dtype = getattr(gate, "params_dtype", None)  # (vLLM's linears: the model's dtype)
    eye = torch.eye(int(gate.input_size),
                    dtype=dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype())
    with torch.no_grad():
        return gate.cpu_linear(eye, gate.weight, None).T.contiguous()
