"""Routing recorded where vLLM runs it: each request's experts, gate weights and tokens,
written as a stmoe trace when the request finishes.

Why here: the plugin already sees every MoE layer's top-k ids and weights as vLLM's router
chose them (before they are renumbered to slots), and which rows of the flat batch are
whose (``batches.Span``). A request's trace holds one row per token that ran through the
model, prompt then generated (the last sampled token never runs), in the router's order:
what vLLM's ``enable_return_routed_experts`` returns for it. A prompt whose start vLLM's
prefix cache held begins where it ran (``extra.cached_prompt_tokens`` says how many did not),
its decode tokens marked as such. ``stmoe profile`` builds
tables from the folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from stmoe.trace.io import save_trace
from stmoe.trace.schema import RoutingTrace, TraceMeta
from stmoe.vllm_plugin.batches import Span


class _Rows:
    """One request's rows so far: positions ``first`` to ``first + count - 1`` of its
    sequence. ``first`` > 0 where vLLM's prefix cache held the prompt's start: those tokens
    never ran, so they have no routing here."""

    def __init__(self) -> None:
        self.experts: list[np.ndarray] = []  # [n, L, K] per call
        self.weights: list[np.ndarray] = []
        self.tokens: list[np.ndarray] = []
        self.first = 0
        self.count = 0
        self.prompt = 0

    def add(self, span: Span, experts: np.ndarray, weights: np.ndarray,
            tokens: np.ndarray) -> None:
        end = self.first + self.count
        if not self.count or not self.first <= span.computed <= end:
            # the first rows, or rows not next to those kept (recomputed from before them):
            # from here on
            self.experts, self.weights, self.tokens = [], [], []
            self.first, self.count = span.computed, 0
        elif span.computed < end:  # recomputed (vLLM preempted it): from there on
            keep = span.computed - self.first
            self.experts = [np.concatenate(self.experts)[:keep]]
            self.weights = [np.concatenate(self.weights)[:keep]]
            self.tokens = [np.concatenate(self.tokens)[:keep]]
            self.count = keep
        self.experts.append(experts)
        self.weights.append(weights)
        self.tokens.append(tokens)
        self.count += len(tokens)
        self.prompt = span.prompt


class Capture:
    """The calls' routing per request, written to ``folder`` as each request finishes."""

    def __init__(self, folder: Path, num_layers: int, num_experts: int, model: str) -> None:
        self.folder, self.num_layers, self.num_experts, self.model = (folder, num_layers,
                                                                       num_experts, model)
        folder.mkdir(parents=True, exist_ok=True)
        self.rows: dict[str, _Rows] = {}
        self._call: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def start_call(self) -> None:
        self._call = [None] * self.num_layers

    def layer(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Layer ``layer``'s top-k ids and weights of the call, as the router chose them."""
        if self._call:
            self._call[layer] = (ids.detach().to("cpu", copy=True),
                                 weights.detach().to("cpu", torch.float32, copy=True))

    def end_call(self, spans: tuple[Span, ...], input_ids: torch.Tensor | None) -> None:
        """The call is done: each request's rows appended to its own."""
        seen, self._call = self._call, []
        if not spans or input_ids is None or any(x is None for x in seen):
            return  # a dummy run's, or a call that failed part way
        ids = np.stack([x[0].numpy() for x in seen], axis=1).astype(np.int16)  # type: ignore[index]
        gates = np.stack([x[1].numpy() for x in seen], axis=1)  # type: ignore[index]
        tokens = input_ids.detach().to("cpu").numpy().astype(np.int64)
        for s in spans:
            self.rows.setdefault(s.request, _Rows()).add(
                s, ids[s.start:s.end], gates[s.start:s.end], tokens[s.start:s.end])

    def finish(self, request: str) -> Path | None:
        """``request`` is over: its trace written (None: it never ran)."""
        rows = self.rows.pop(request, None)
        if rows is None or rows.count == 0:
            return None
        experts = np.concatenate(rows.experts)
        is_decode = rows.first + np.arange(rows.count) >= rows.prompt
        extra: dict[str, object] = {"request": request, "prompt_tokens": rows.prompt}
        if rows.first:  # the prompt's first tokens came from vLLM's prefix cache
            extra["cached_prompt_tokens"] = rows.first
        meta = TraceMeta(self.num_experts, int(experts.shape[2]), self.num_layers,
                         model=self.model, source="stmoe vLLM plugin (capture)", extra=extra)
        trace = RoutingTrace(experts, np.zeros(1, dtype=np.int64), is_decode, meta,
                             weights=np.concatenate(rows.weights),
                             token_ids=np.concatenate(rows.tokens))
        path = self.folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', request)}.npz"
        save_trace(trace, path)
        return path
