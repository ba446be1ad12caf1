"""Record expert routing from transformers MoE models, as a ``RoutingTrace``.

The recorder hooks the inputs of every experts module (the classes transformers
decorates with ``use_experts_implementation``): their arguments are exactly the
router's top-k expert indices and weights, whatever the family computes before
(softmax, sigmoid with bias correction, group-limited routing, sparsemixer). Dense
layers have no experts module, so MoE layer numbers come out right; shared
experts are plain MLPs and are never recorded. A hook on the model's own forward
tells the recorder the batch shape, the attention mask (padding is never
recorded) and when a new generation starts. Hooks only read: outputs are
bit-identical with and without recording (tested). Where the experts modules,
routers and pre-MoE norms are is ``stmoe.hf.layout``'s knowledge, shared
with the runtime; this module only records.

    with RoutingRecorder(model) as rec:
        model.generate(**inputs)          # or any loop of model(...) calls
    trace = rec.trace()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stmoe.errors import StmoeError
from stmoe.hf.layout import (
    ModelLayout,
    late_hidden,
    layer_number,
)
from stmoe.trace.assemble import order_by_weight
from stmoe.trace.schema import UNLABELLED, RoutingTrace, TraceMeta, validate


class CaptureError(StmoeError):
    """The model cannot be recorded (no experts modules, inconsistent calls)."""


@dataclass
class _Step:
    """One forward call of the model: its batch shape, mask and each layer's routing."""

    batch: int
    length: int
    mask: np.ndarray | None  # [B, S] bool, real (not padding) positions of this call
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    look: list[torch.Tensor] = field(default_factory=list)  # [B*S, J] per layer 1..L-1
    look_late: list[torch.Tensor] = field(default_factory=list)  # the same, late lookahead
    top_k: int = 0  # the router's K (from the first MoE layer's call)


class RoutingRecorder:
    """Context manager that records the routing of every forward call of ``model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        layout = ModelLayout.of(model)
        self.modules = layout.modules
        if not self.modules:
            raise CaptureError(
                f"{type(model).__name__} has no routed-experts module that stmoe recognises "
                "(transformers' use_experts_implementation); is it a MoE model?"
            )
        self.batches: list[list[_Step]] = []
        self._handles: list[Any] = []
        self.routers = layout.routers  # for the gate lookahead
        self.late = layout.late if self.routers is not None else None
        self._last_cache: int | None = None

    # ---- hooks -----------------------------------------------------------------
    def __enter__(self) -> RoutingRecorder:
        self._handles.append(
            self.model.register_forward_pre_hook(self._on_model_call, with_kwargs=True)
        )
        for layer, (_, module) in enumerate(self.modules):
            self._handles.append(
                module.register_forward_pre_hook(self._layer_hook(layer), with_kwargs=True)
            )
        if self.late is not None:
            for layer, (decoder_layer, _) in enumerate(self.late[1:], start=1):
                self._handles.append(decoder_layer.register_forward_pre_hook(
                    self._late_hook(layer), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_model_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = tuple((ids if ids is not None else embeds).shape[:2])
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # renamed in transformers 5.x
        # A generation starts with no cache, a cache object not seen before, or an empty one
        # (hybrid caches of linear-attention models cannot always report their length).
        length = None if cache is None else _cache_length(cache)
        new_object = cache is None or id(cache) != self._last_cache
        fresh = new_object if length is None else length == 0
        self._last_cache = id(cache) if cache is not None else None
        mask = kwargs.get("attention_mask")
        real = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            real = mask[:, -shape[1] :].detach().to("cpu", torch.bool).numpy()
        elif mask is not None and shape[0] > 1:
            raise CaptureError("a batched call without a 2-D attention mask: padding could not "
                               "be told apart (use a dynamic cache)")
        if fresh or not self.batches:
            self.batches.append([])
        self.batches[-1].append(_Step(batch=shape[0], length=shape[1], mask=real))

    def _layer_hook(self, layer: int):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.batches:
                return  # called outside a model forward: nothing to attribute it to
            step = self.batches[-1][-1]
            index = args[1] if len(args) > 1 else _first(kwargs, "top_k_index", "router_indices")
            weight = (
                args[2] if len(args) > 2 else _first(kwargs, "top_k_weights", "routing_weights")
            )
            if len(step.layers) != layer:
                raise CaptureError(f"MoE layer {layer} ran out of order in one forward call")
            step.top_k = int(index.shape[-1])
            step.layers.append((index.detach().to("cpu", copy=True),
                                weight.detach().to("cpu", torch.float32, copy=True)))
            if self.routers is not None and layer + 1 < len(self.modules):
                hidden = args[0] if args else kwargs["hidden_states"]
                hidden = hidden.reshape(-1, hidden.shape[-1])
                router = self.routers[layer + 1]
                width = min(2 * index.shape[-1], router.num_experts)
                step.look.append(router.ranked(hidden, width).to("cpu"))

        return hook

    def _late_hook(self, layer: int):  # type: ignore[no-untyped-def]
        """Before decoder layer ``layer`` runs: its router on its input (the late lookahead)."""

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.batches:
                return
            assert self.late is not None and self.routers is not None
            step = self.batches[-1][-1]
            if step.top_k == 0 or len(step.look_late) != layer - 1:
                raise CaptureError(f"decoder layer of MoE layer {layer} ran before MoE layer 0 "
                                   "or out of order in one forward call")
            hidden = args[0] if args else kwargs["hidden_states"]
            router = self.routers[layer]
            width = min(2 * step.top_k, router.num_experts)  # top-K: known from MoE layer 0
            x = late_hidden(self.late[layer][1], hidden).reshape(-1, hidden.shape[-1])
            step.look_late.append(router.ranked(x, width).to("cpu"))

        return hook

    # ---- result ------------------------------------------------------------------
    def trace(
        self,
        decode_lengths: Sequence[Sequence[int]] | None = None,
        domains: Sequence[str] | None = None,
        token_ids: Sequence[np.ndarray] | None = None,
        model_name: str | None = None,
    ) -> RoutingTrace:
        """The recorded routing, one sequence per (generation, batch row).

        A generation's first call is its prefill (real positions per its attention
        mask), each later call one decode token per row. ``decode_lengths[g][b]``
        keeps only that many decode tokens of row b of generation g (rows that
        stopped early); default: all.
        """
        if not self.batches:
            raise CaptureError("nothing was recorded: no forward call ran inside the recorder")
        if decode_lengths is not None and len(decode_lengths) != len(self.batches):
            raise CaptureError(f"{len(self.batches)} generations were recorded but decode lengths "
                               f"were given for {len(decode_lengths)}")
        experts, weights, decode, starts = [], [], [], []
        looks: dict[str, list[np.ndarray | None]] = {"look": [], "look_late": []}
        n_tokens = 0
        for g, steps in enumerate(self.batches):
            for b in range(steps[0].batch):
                keep = None if decode_lengths is None else decode_lengths[g][b]
                ex, w, dec = self._row(steps, b, keep)
                starts.append(n_tokens)
                n_tokens += len(ex)
                experts.append(ex)
                weights.append(w)
                decode.append(dec)
                for which, rows in looks.items():
                    rows.append(self._look_row(steps, b, keep, which))
        ex, w = np.concatenate(experts), np.concatenate(weights)
        look, late = (None if any(x is None for x in rows) else np.concatenate(rows)  # type: ignore[arg-type]
                      for rows in looks.values())
        ex, w, _ = order_by_weight(ex, w)  # some routers return top-k unsorted (DeepSeek-V3)
        first = self.modules[0][1]
        meta = TraceMeta(
            num_experts=int(getattr(first, "num_experts", int(ex.max()) + 1)),
            top_k=ex.shape[2],
            num_layers=len(self.modules),
            model=model_name or str(getattr(self.model.config, "_name_or_path", "") or "unknown"),
            source="stmoe capture (transformers)",
            extra={
                "model_type": getattr(self.model.config, "model_type", ""),
                "model_layer_ids": [layer_number(n) for n, _ in self.modules],
            },
        )
        return validate(
            RoutingTrace(
                experts=ex.astype(np.int16),
                seq_starts=np.asarray(starts, dtype=np.int64),
                is_decode=np.concatenate(decode),
                weights=w.astype(np.float32),
                token_ids=None if token_ids is None else np.concatenate(token_ids).astype(np.int64),
                lookahead=look,
                lookahead_late=late,
                domains=tuple(domains) if domains is not None else (UNLABELLED,) * len(starts),
                meta=meta,
            )
        )

    def _row(self, steps: list[_Step], b: int, keep: int | None):  # type: ignore[no-untyped-def]
        """[T, L, K] ids, [T, L, K] weights and [T] decode flags of batch row ``b``."""
        ids, ws, dec = [], [], []
        for j, step in enumerate(steps):
            if keep is not None and j > keep:
                break
            if len(step.layers) != len(self.modules):
                raise CaptureError(
                    f"a forward call ran {len(step.layers)} of {len(self.modules)} MoE layers"
                )
            rows = np.ones(step.length, dtype=bool) if step.mask is None else step.mask[b]
            per_layer = [(i.reshape(step.batch, step.length, -1)[b].numpy(),
                          w.reshape(step.batch, step.length, -1)[b].numpy())
                         for i, w in step.layers]
            ids.append(np.stack([i for i, _ in per_layer], axis=1)[rows])
            ws.append(np.stack([w for _, w in per_layer], axis=1)[rows])
            dec.append(np.full(int(rows.sum()), j > 0))
        return np.concatenate(ids), np.concatenate(ws), np.concatenate(dec)

    def _look_row(self, steps: list[_Step], b: int, keep: int | None,
                  which: str = "look") -> np.ndarray | None:
        """[T, L, J] gate lookahead (``which``: "look" or "look_late") of batch row ``b``
        (layer 0: -1), or None."""
        if self.routers is None or len(self.modules) < 2:
            return None
        if which == "look_late" and self.late is None:
            return None
        out = []
        for j, step in enumerate(steps):
            if keep is not None and j > keep:
                break
            rows = np.ones(step.length, dtype=bool) if step.mask is None else step.mask[b]
            per = [x.reshape(step.batch, step.length, -1)[b].numpy() for x in getattr(step, which)]
            first = np.full_like(per[0], -1)
            out.append(np.stack([first, *per], axis=1)[rows])
        return np.concatenate(out).astype(np.int16)


def _first(kwargs: dict, *names: str) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs[name]
    raise CaptureError(f"the experts module was called without {' or '.join(names)}")


def _cache_length(cache: Any) -> int | None:
    """Tokens already in the cache, or None when this kind of cache cannot say."""
    try:
        return int(cache.get_seq_length())
    except (AttributeError, TypeError, ValueError):
        return None
