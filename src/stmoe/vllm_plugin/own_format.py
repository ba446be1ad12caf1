"""Experts in stmoe's own weight formats inside vLLM (``format=int4`` or ``format=int8``).

Why: vLLM 0.30's CPU build has no int4 MoE kernel a checkpoint reaches (docs/vllm.md says
what was tried), while stmoe has weight-only int4 and int8 experts of its own: a store
packed from the checkpoint's files (``stmoe pack --format``: the very store ``stmoe
generate`` and ``stmoe serve`` use) and torch's weight-only CPU kernels computing on it in
place (``quant.experts.quantized_experts_forward``). With a format asked for, vLLM never
loads the routed experts (``streamed.skip_experts``) and each layer's experts call is
stmoe's quantized forward on the slots the engine binds.

Lossless, here, means: the plugin's tokens at any capacity equal its tokens with every
expert cached (``capacity=100%``: the model resident in that format; vLLM has no int4
model to compare with), bit for bit (tested). That holds because each token is computed
alone: an expert's rows go through the kernel as one group, torch's weight-only kernels
give each row the same bits whatever rows are beside it (tested), and each token's top-k
outputs are summed in routing order. The quantization is the user's choice (lossy), named
in vLLM's log line; its quality is measured by ``benchmarks/bench_vllm.py --quality``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from stmoe.quant.experts import FORMAT_ATTR, quantized_experts_forward
from stmoe.quant.formats import WeightFormat
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.packing import default_store_dir, open_store, pack_folder
from stmoe.vllm_plugin.config import PluginConfigError
from stmoe.vllm_plugin.layers import MoeLayer

# the implementation name the experts path knows this forward by (``runtime.hf_glue``: each
# token's result the same bits under any numbering, whatever the call's other tokens)
IMPL = "vllm_stmoe_quantized"
# what a block of stmoe's quantized store holds for a gated expert (``quant.experts``)
TENSORS = ("down_proj_qscale", "down_proj_qweight", "gate_up_proj_qscale",
           "gate_up_proj_qweight")


class OwnExperts:
    """One vLLM routed-experts layer as ``quantized_experts_forward`` reads a transformers
    experts module: its format, a gated activation on vLLM's w13 order (gate rows, then up
    rows: ``silu(gate) * up``, what vLLM's SiLU-and-mul computes), no biases and no norm
    after the experts; anything else is read from the layer."""

    has_gate = True
    has_bias = False
    has_post_expert_norm = False

    def __init__(self, layer: MoeLayer, weights: WeightFormat) -> None:
        self.__dict__.update({"layer": layer.module, FORMAT_ATTR: weights,
                              "config": SimpleNamespace(_experts_implementation=IMPL)})

    def _apply_gate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["layer"], name)


def own_forward(experts: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, shared_experts: Any = None,
                shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's routed experts in stmoe's format, on the weights the path bound. The
    shared experts are not the kernel's to run here: vLLM's runner runs them beside it
    wherever the kernel does not overlap them (``check_own`` refuses a layer whose does)."""
    return quantized_experts_forward(experts, hidden_states, top_k_index, top_k_weights)


def check_own(layer: MoeLayer, weights: WeightFormat) -> None:
    """Refuse, in one line naming the layer, one stmoe's quantized forward cannot compute
    as vLLM's kernel would (its other checks are ``layers.check_layer``'s)."""
    module = layer.module
    activation = getattr(module.activation, "name", str(module.activation))
    kernel = module.quant_method.moe_kernel
    finalize = getattr(getattr(kernel, "impl", None), "prepare_finalize", None)
    why = None
    if activation.upper() != "SILU":
        why = f"its activation is {activation}; stmoe's kernels compute SiLU-gated experts"
    elif module.apply_router_weight_on_input:
        why = "it applies the router's weights to the input"
    elif finalize is not None and finalize.supports_async():
        why = "its kernel runs the shared experts inside itself"
    if why is not None:
        raise PluginConfigError(f"stmoe: cannot serve MoE layer {layer.name} in "
                                f"{weights.name}: {why}")


def open_own_store(path: Path | None, layers: list[MoeLayer], model_dir: Path,
                   weights: WeightFormat) -> tuple[ExpertStore, bool]:
    """stmoe's own store of the checkpoint in ``weights``: the one at ``path`` (packed there
    first when it has none), else the model's cached one (packed when missing), opened and
    checked as ``runtime.store.packing.open_store`` does; (store, packed now). It must hold
    gated experts for the layers vLLM built."""
    made = not ((path or default_store_dir(model_dir, weights)) / "index.json").exists()
    if path is not None and made:
        pack_folder(model_dir, path, weights=weights)
    store = open_store(model_dir, path, weights=weights)
    module = layers[0].module
    want = (len(layers), int(module.global_num_experts), int(module.hidden_size))
    held = (int(store.model["moe_layers"]), int(store.model["num_experts"]),
            int(store.model["hidden_size"]))
    if held != want:
        raise PluginConfigError(f"stmoe: {store.path} holds {held[0]} MoE layers of {held[1]} "
                                f"experts (hidden size {held[2]}), vLLM's model {want[0]} of "
                                f"{want[1]} ({want[2]})")
    names = tuple(t.name for t in store.blocks[(0, 0)].tensors)
    if tuple(sorted(names)) != TENSORS:
        raise PluginConfigError(f"stmoe: {store.path}'s experts hold {', '.join(names)}; "
                                f"format={weights.name} serves gated experts "
                                f"({', '.join(TENSORS)})")
    return store, made
