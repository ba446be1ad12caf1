"""Where a transformers MoE model keeps its experts, routers and pre-MoE norms.

Capture (recording the routing) and the runtime (serving the experts) both need
to find the same things in a model of any family: the routed-experts modules in
layer order, each MoE layer's router weight, and the norm a decoder layer applies
before its MoE block (for the *late* gate lookahead). This module is that one
piece of knowledge, by the class markers and attribute names transformers uses;
it reads the model and changes nothing. ``ModelLayout.of(model)`` computes it once;
``stmoe.offload`` hands that one layout to the store checks, the engine, the gate
lookahead and calibrate.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

from stmoe.hf.routers import Router, find_routers

# the norm a decoder layer applies right before its MoE block, by the names transformers uses
PRE_MOE_NORMS = ("pre_feedforward_layernorm", "pre_ff_layernorm", "post_attention_layernorm",
                 "ffn_norm")


@dataclass(frozen=True, eq=False)
class ModelLayout:
    """A model's MoE facts, found once: its routed-experts modules in layer order (name,
    module), each MoE layer's router (``hf.routers``) and its (decoder layer, pre-MoE norm)
    for the late gate lookahead (None where some layer's cannot be found)."""

    modules: list[tuple[str, torch.nn.Module]]
    routers: list[Router] | None
    late: list[tuple[torch.nn.Module, torch.nn.Module]] | None

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelLayout:
        modules = experts_modules(model)
        return cls(modules, find_routers(model, modules), late_points(model, modules))

    @property
    def num_layers(self) -> int:
        """MoE layers (the runtime's and the trace's L)."""
        return len(self.modules)

    def prefixes(self) -> tuple[str, ...]:
        """Every experts module's parameter-name prefix (``model.layers.0.mlp.experts.``)."""
        return tuple(f"{name}." for name, _ in self.modules)


def expert_params(module: torch.nn.Module, num_experts: int) -> list[tuple[str, torch.Tensor]]:
    """An experts module's per-expert parameters (first axis = experts), sorted by name:
    what a store's block holds, in order (the one definition the packers, the store's
    checks and the quantized formats share)."""
    return sorted((n, p) for n, p in module.named_parameters(recurse=False)
                  if p.dim() >= 1 and p.shape[0] == num_experts)


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The routed-experts modules of ``model`` in layer order (one per MoE layer).

    A module counts when its class was decorated by transformers'
    ``use_experts_implementation`` (its ``__init__`` sets ``is_concatenated`` and
    ``has_gate``, in every transformers 5 release we run: 5.17, the GPU machines', added
    ``_is_expert_parallel`` only later) and its forward takes the routing (hidden states,
    top-k indices, top-k weights); an enclosing block decorated too (GraniteMoe's) is
    skipped for its experts.
    """
    found = []
    for name, module in model.named_modules():
        if not (hasattr(module, "is_concatenated") and hasattr(module, "has_gate")):
            continue
        forward = inspect.unwrap(type(module).forward)
        params = [p for p in inspect.signature(forward).parameters if p != "self"]
        if len(params) >= 3:
            found.append((name, module))
    return found


def late_points(model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]
                ) -> list[tuple[torch.nn.Module, torch.nn.Module]] | None:
    """Each MoE layer's (decoder layer, pre-MoE norm), for the *late* gate lookahead
    (layer l's router on the residual stream entering layer l, through that norm), or
    None when some layer's cannot be found."""
    found = []
    for name, _ in modules:
        parts = name.split(".")
        point = None
        for cut in range(len(parts) - 1, 0, -1):
            parent = model.get_submodule(".".join(parts[:cut]))
            norms = [getattr(parent, n, None) for n in PRE_MOE_NORMS]
            norm = next((m for m in norms if isinstance(m, torch.nn.Module)), None)
            if norm is not None:
                if _post_norm_layer(parent):  # the MoE block reads the raw residual stream
                    norm = torch.nn.Identity()
                point = (parent, norm)
                break
        if point is None:
            return None
        found.append(point)
    return found


def _post_norm_layer(layer: torch.nn.Module) -> bool:
    """OLMo-2-style layers normalise each block's *output* (post_attention_layernorm,
    post_feedforward_layernorm) and feed the blocks the raw residual stream."""
    return (isinstance(getattr(layer, "post_feedforward_layernorm", None), torch.nn.Module)
            and getattr(layer, "pre_feedforward_layernorm", None) is None)


def late_hidden(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The late lookahead's router input: the decoder layer's input through its pre-MoE norm."""
    with torch.no_grad():
        return norm(hidden.detach())


def layer_number(name: str) -> int:
    """The decoder layer index in a module's name (``model.layers.3.mlp`` -> 3), or -1."""
    match = re.search(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else -1
