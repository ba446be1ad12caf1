"""Each MoE layer's router as the gate lookahead reads it (``Router``).

The lookahead ranks a layer's experts for hidden states that are not yet its own input (the
layer before's, or its decoder layer's input through the pre-MoE norm). Ranked by
``hidden @ weight.T`` alone, it misses what a family's router adds before it chooses:
DeepSeek-V3's, Kimi K2's and GLM-4.5's score-correction bias (a few units, where the
sigmoid scores lie in 0..1) and grouped top-k, GPT-OSS's router bias. transformers' router
modules compute their layer's own top-k (they return the logits, the top-k weights and the
top-k ids), so where a layer's does, the lookahead asks it: its first K are the family's very
choice for that input, the rest ranked by logit. It only predicts: the router still routes,
so the lookahead changes which loads are queued, never an output. It calls the module's
``forward``, not the module: transformers records a forward's router logits with hooks on
these modules (``output_router_logits``, and the auxiliary loss from them), and the
lookahead's calls must not add to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the router's child names beside a layer's experts, as transformers' families name them
ROUTER_NAMES = ("gate", "router", "gate_proj", "wg")


@dataclass(frozen=True, eq=False)
class Router:
    """One MoE layer's router: its weight [N, H], and the module that picks its top-k
    (``hidden [T, H] -> (logits [T, N], weights [T, K], ids [T, K])``) where it has one."""

    weight: torch.Tensor
    picks: torch.nn.Module | None = None

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    def ranked(self, hidden: torch.Tensor, width: int) -> torch.Tensor:
        """The top ``width`` experts for each row of ``hidden`` ([T, H]), ranked: with
        ``picks``, its top-k first (by weight), then the rest by logit."""
        with torch.no_grad():
            if self.picks is None:
                return torch.topk(_logits(hidden, self.weight), width, dim=-1).indices
            logits, weights, ids = self.picks.forward(hidden.detach())  # (not its hooks)
            rows = hidden.shape[0]
            ids = ids.reshape(rows, -1)
            order = torch.argsort(weights.reshape(ids.shape).to(torch.float32), dim=-1,
                                  descending=True, stable=True)
            chosen = ids.gather(-1, order)
            if width <= chosen.shape[-1]:
                return chosen[:, :width]
            rest = logits.reshape(rows, -1).to(torch.float32).scatter(-1, chosen,
                                                                      float("-inf"))
            more = torch.topk(rest, width - chosen.shape[-1], dim=-1).indices
            return torch.cat([chosen, more], dim=-1)


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden.detach().to(torch.float32) @ weight.detach().to(torch.float32).T


def find_routers(model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]
                 ) -> list[Router] | None:
    """Each MoE layer's ``Router`` (the gate next to its experts), or None when some
    layer's cannot be found (then no gate lookahead)."""
    found = []
    for name, experts in modules:
        n = int(getattr(experts, "num_experts", 0))
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        router = None
        for child_name, child in parent.named_children():
            w = getattr(child, "weight", None)
            if child is experts or not isinstance(w, torch.Tensor) or w.dim() != 2:
                continue
            if w.shape[0] == n and child_name in ROUTER_NAMES:
                router = Router(w, child if picks_top_k(child, w) else None)
                break
        if router is None:
            return None
        found.append(router)
    return found


def picks_top_k(module: torch.nn.Module, weight: torch.Tensor) -> bool:
    """Whether ``module`` returns (logits, weights, ids) for one row, as transformers'
    top-k routers do (a plain linear gate returns the logits alone): asked once, on a
    row of zeros (no weights on the meta device: not asked)."""
    if weight.device.type == "meta":
        return False
    n = weight.shape[0]
    try:
        with torch.no_grad():
            out = module.forward(torch.zeros(1, weight.shape[1], dtype=weight.dtype,
                                             device=weight.device))
    except Exception:  # (a router that takes more than the hidden states: MiniMax-M2's)
        return False
    if not (isinstance(out, tuple) and len(out) == 3
            and all(isinstance(t, torch.Tensor) for t in out)):
        return False
    logits, weights, ids = out
    return (logits.shape[-1] == n and logits.numel() == n and not ids.is_floating_point()
            and 0 < ids.numel() <= n and weights.numel() == ids.numel())
