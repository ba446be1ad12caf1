"""Real routing through the real runtime: a trace's expert choices replace the router's.

A random-weight checkpoint of a real shape (``stmoe make-model``) moves real
expert sizes but routes unrealistically. ``RoutingSource`` makes every MoE
layer of it use a recorded sequence's routing instead: the first forward call
(the prompt) takes the sequence's prefill tokens, decode call j its j-th decode
token, each MoE layer l the trace's layer l (the first L layers when the model
has L). The cache, the prefetch workers, the tiers, the predictors and the
expert arithmetic then run exactly as they would on that routing; the text
produced is meaningless (the output says so), the time, stalls, hits and bytes
are what is measured. Gate weights come from the trace when it has them, else
are uniform (1/K): they change the arithmetic's values, never its cost. Rows that
are sets (``trace.ranks``: no weights, no rank) are served in their canonical order;
a runtime predictor that reads rank refuses them (``OffloadedModel.force_routing``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stmoe.errors import StmoeError
from stmoe.trace.ranks import describe, is_ranked, set_order
from stmoe.trace.schema import RoutingTrace


class ForcedRoutingError(StmoeError):
    """A trace cannot drive this model (shape mismatch, no such sequence, wrong call)."""


@dataclass(frozen=True)
class RoutingPlan:
    """One sequence's routing, ready to serve: what generate must run to replay it."""

    experts: np.ndarray  # [T, L, K] int64, the model's L layers
    weights: np.ndarray  # [T, L, K] float32
    prefill: int  # tokens of the first forward call (the prompt)
    token_ids: list[int]  # the prompt to feed (the trace's ids where it has them)
    ranked: bool = True  # False: each row is a set (trace.ranks), in its canonical order
    source: str = ""  # the trace, for messages

    @property
    def decode_steps(self) -> int:
        return int(self.experts.shape[0]) - self.prefill

    @property
    def new_tokens(self) -> int:
        """Tokens generate must produce: every decode step's input is a generated token,
        and the last generated token is never fed back."""
        return self.decode_steps + 1


def plan_routing(trace: RoutingTrace, sequence: int, num_layers: int, num_experts: int,
                top_k: int, vocab_size: int, source: str | Path | None = None) -> RoutingPlan:
    """Sequence ``sequence`` of ``trace`` shaped for a model of this shape, or a clear error
    naming ``source`` (the trace's file; its model label when no file is given)."""
    where = str(source) if source is not None else f"--routing {trace.meta.model!r}"
    if trace.num_experts != num_experts or trace.top_k != top_k:
        raise ForcedRoutingError(f"{where}: the trace routes top-{trace.top_k} of "
                                 f"{trace.num_experts} experts but the model top-{top_k} of "
                                 f"{num_experts}; make the model with the trace's shape "
                                 "(stmoe make-model --like ...)")
    if trace.num_layers < num_layers:
        raise ForcedRoutingError(f"{where}: the trace has {trace.num_layers} MoE layers but "
                                 f"the model {num_layers}; use a model with at most "
                                 f"{trace.num_layers} (make-model --layers)")
    if not 0 <= sequence < trace.num_sequences:
        raise ForcedRoutingError(f"{where}: --sequence {sequence} is outside "
                                 f"0..{trace.num_sequences - 1}")
    a, b = int(trace.seq_starts[sequence]), int(trace.seq_ends[sequence])
    decode = np.asarray(trace.is_decode[a:b], dtype=bool)
    prefill = int(np.argmax(decode)) if decode.any() else b - a
    if prefill == 0 or decode[prefill:].sum() != len(decode) - prefill:
        raise ForcedRoutingError(f"{where}: sequence {sequence} is not a prompt followed by "
                                 "decode tokens; replay needs at least one prefill token "
                                 "first and decode tokens after")
    experts = np.asarray(trace.experts[a:b, :num_layers], dtype=np.int64)
    if (experts < 0).any():
        t, layer, _ = (int(i) for i in np.argwhere(experts < 0)[0])
        raise ForcedRoutingError(f"{where}: token {t} of sequence {sequence} has an empty "
                                 f"slot at layer {layer}; replay needs all top-{top_k} "
                                 "choices")
    if trace.weights is not None:
        weights = np.asarray(trace.weights[a:b, :num_layers], dtype=np.float32)
    else:
        weights = np.full(experts.shape, 1.0 / top_k, dtype=np.float32)
    ranked = is_ranked(trace)
    if not ranked:  # one order per set, so a run is a function of the sets
        ordered, kept = set_order(experts, weights)
        experts, weights = ordered.astype(np.int64), np.asarray(kept, dtype=np.float32)
    ids = trace.token_ids[a : a + prefill] if trace.token_ids is not None else None
    if ids is None or (np.asarray(ids) >= vocab_size).any() or (np.asarray(ids) < 0).any():
        ids = np.arange(1, prefill + 1) % vocab_size  # the model's vocabulary is not the trace's
    return RoutingPlan(experts, weights, prefill, [int(i) for i in ids], ranked,
                       str(source) if source is not None else describe(trace))


class RoutingSource:
    """Hands each (forward call, layer) the trace's routing in place of the router's."""

    def __init__(self, plan: RoutingPlan) -> None:
        self.plan = plan
        # the whole plan on each (device, dtypes) it is asked for, copied once: a copy per
        # call and layer from pageable memory would make a GPU's host wait at every layer
        self._on: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def positions(self, fwd: int, rows: int) -> slice:
        """The trace tokens forward call ``fwd`` computes (``rows`` of them)."""
        plan = self.plan
        if fwd == 0:
            start, want = 0, plan.prefill
        else:
            start, want = plan.prefill + fwd - 1, 1
        if rows != want or start + want > plan.experts.shape[0]:
            raise ForcedRoutingError(f"routing replay: forward call {fwd} computes {rows} "
                                     f"token(s), the trace has {want} at position {start} of "
                                     f"{plan.experts.shape[0]}; replay one prompt with "
                                     f"{plan.new_tokens} new tokens at most")
        return slice(start, start + want)

    def routing(self, fwd: int, layer: int, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace's (ids, weights) for this call and layer, in the router's dtypes."""
        span = self.positions(fwd, int(top_k_index.shape[0]))
        key = (top_k_index.device, top_k_index.dtype, top_k_weights.device, top_k_weights.dtype)
        if key not in self._on:
            self._on[key] = (
                torch.from_numpy(self.plan.experts).to(top_k_index.device, top_k_index.dtype),
                torch.from_numpy(self.plan.weights).to(top_k_weights.device,
                                                       top_k_weights.dtype))
        ids, weights = self._on[key]  # copies: a caller may change its routing in place
        return ids[span, layer].clone(), weights[span, layer].clone()


class ForcedRouting:
    """``plan``'s routing forced on a resident transformers model (forward hooks on its
    experts modules): the plain-transformers reference a replay through the runtime is
    compared with, bit for bit (tests) and in speed (benchmarks). ``reset`` before each
    generation; ``remove`` to take the hooks off."""

    def __init__(self, model: torch.nn.Module, plan: RoutingPlan) -> None:
        from stmoe.hf.layout import experts_modules

        self.replay, self.fwd = RoutingSource(plan), -1
        self.handles = [model.register_forward_pre_hook(self._count)]
        for layer, (_, module) in enumerate(experts_modules(model)):
            self.handles.append(module.register_forward_pre_hook(
                functools.partial(self._force, layer), with_kwargs=True))

    def reset(self) -> None:
        self.fwd = -1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _count(self, module: torch.nn.Module, args: tuple) -> None:
        self.fwd += 1

    def _force(self, layer: int, module: torch.nn.Module, args: tuple,
               kwargs: dict) -> tuple[tuple, dict]:
        index, weights = self.replay.routing(self.fwd, layer, args[1], args[2])
        return (args[0], index, weights, *args[3:]), kwargs


# the former names, for one release
RoutingReplayError = ForcedRoutingError
ReplayPlan = RoutingPlan
RoutingReplay = RoutingSource
plan_replay = plan_routing
