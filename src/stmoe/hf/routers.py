"""Each MoE layer's router as the gate lookahead reads it (``Router``).

The lookahead ranks a layer's experts for hidden states that are not yet its own input (the
layer before's, or its decoder layer's input through the pre-MoE norm). Ranked by
``hidden @ weight.T`` alone, it misses what a family's router adds before it chooses:
DeepSeek-V3's, Kimi K2's and GLM-4.5's score-correction bias (a few units, where the
sigmoid scores lie in 0..1) and grouped top-k, GPT-OSS's router bias. transformers' router
modules compute their layer's own top-k (they return the logits, the top-k weights and the
top-k ids), so where a layer's does and its choice is not simply its logits' top-k (asked
once, at load, on random rows), the lookahead asks it: its first K are the family's very
choice for that input, the rest ranked by logit. A softmax router ranks as its logits do, so
it is not asked (its forward would only cost time); nor is a router in training mode, where
one may draw random numbers or add noise in place. It only predicts: the router still routes,
so the lookahead changes which loads are queued, never an output. It calls the module's
``forward``, not the module: transformers records a forward's router logits with hooks on
these modules (``output_router_logits``, and the auxiliary loss from them), and the
lookahead's calls must not add to them. A router whose forward takes more than the hidden
states is given each further input from the attribute of that name on its MoE block, as the
block passes it (MiniMax-M2's and HY-V3's ``e_score_correction_bias``, LFM2's and AFMoE's
``expert_bias``); one with an input found nowhere (DeepSeek-V4's token ids) is ranked by its
logits.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# the router's child names beside a layer's experts, as transformers' families name them
ROUTER_NAMES = ("gate", "router", "gate_proj", "wg")


@dataclass(frozen=True, eq=False)
class Router:
    """One MoE layer's router: its weight [N, H], and the module that picks its top-k
    (``hidden [T, H] -> (logits [T, N], weights [T, K], ids [T, K])``) where it has one
    that ranks otherwise than its logits (``picks_top_k``); ``inputs`` names the attributes of
    ``block`` (its MoE block) that its forward takes after the hidden states."""

    weight: torch.Tensor
    picks: torch.nn.Module | None = None
    block: torch.nn.Module | None = None
    inputs: tuple[str, ...] = ()

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    def ranked(self, hidden: torch.Tensor, width: int) -> torch.Tensor:
        """The top ``width`` experts for each row of ``hidden`` ([T, H]), ranked: with
        ``picks``, its top-k first (by weight), then the rest by logit."""
        with torch.no_grad():
            if self.picks is None or self.picks.training:  # (see picks_top_k)
                return torch.topk(_logits(hidden, self.weight), width, dim=-1).indices
            logits, weights, ids = _ask(self.picks, hidden.detach(), self.block, self.inputs)
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


def _ask(router: torch.nn.Module, hidden: torch.Tensor, block: torch.nn.Module | None,
         inputs: tuple[str, ...]) -> object:
    """The router's forward (not its hooks) on ``hidden``, given its further inputs by name
    from ``block`` as they are now (a buffer moved to another device is a new tensor)."""
    return router.forward(hidden, **{name: getattr(block, name) for name in inputs})


def router_inputs(router: torch.nn.Module, block: torch.nn.Module) -> tuple[str, ...] | None:
    """The names of ``router``'s forward parameters after the hidden states that ``block``
    holds as attributes (read there at each call), or None when one it needs is nowhere:
    neither on ``block`` nor given a default."""
    try:
        params = list(inspect.signature(router.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    names = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind != p.POSITIONAL_ONLY and hasattr(block, p.name):
            names.append(p.name)
        elif p.default is p.empty:
            return None
    return tuple(names)


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
                inputs = router_inputs(child, parent)
                if inputs is not None and picks_top_k(child, w, parent, inputs):
                    router = Router(w, child, parent, inputs)
                else:
                    router = Router(w)
                break
        if router is None:
            return None
        found.append(router)
    return found


PROBE_ROWS = 64  # random rows a router is asked at load (a generator of its own)


def picks_top_k(module: torch.nn.Module, weight: torch.Tensor,
                block: torch.nn.Module | None = None, inputs: tuple[str, ...] = ()) -> bool:
    """Whether the lookahead should ask ``module``: it returns (logits [T, N], weights
    [T, K], ids [T, K] in 0..N-1) as transformers' top-k routers do (a plain linear gate
    returns the logits alone), and its top-k is not simply the logits' (a bias or groups:
    a softmax router ranks as its logits do, and asking it would only cost time). Asked
    once, on ``PROBE_ROWS`` random rows; never in training mode (a router may draw random
    numbers or add noise in place there, PhiMoE's does) nor on the meta device. ``inputs``:
    its further inputs, read from ``block`` (``router_inputs``)."""
    if weight.device.type == "meta" or module.training:
        return False
    n, rows = weight.shape[0], PROBE_ROWS
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(weight.device, weight.dtype)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # (a router's own draws)
            out = _ask(module, x, block, inputs)
    except Exception:  # (a module that is not a router after all: it is not asked)
        return False
    if not (isinstance(out, tuple) and len(out) == 3
            and all(isinstance(t, torch.Tensor) for t in out)):
        return False
    logits, weights, ids = out
    if (logits.shape != (rows, n) or ids.is_floating_point() or ids.dim() != 2
            or ids.shape[0] != rows or not 0 < ids.shape[1] <= n
            or weights.numel() != ids.numel()
            or not bool(((ids >= 0) & (ids < n)).all())):
        return False
    by_logit = torch.topk(_logits(x, weight), ids.shape[1], dim=-1).indices
    return not torch.equal(ids.sort(dim=-1).values.cpu(), by_logit.sort(dim=-1).values.cpu())
