"""Recorded routing in place of vLLM's router, for measurement only (``routing=TRACE``).

Why: a real-shape checkpoint made by ``stmoe make-model`` has random weights, so vLLM's
router routes it unlike any trained model (close to uniform: little for a predictor to
learn), and no trained weights can be downloaded here. With ``routing=TRACE`` each MoE
layer's top-k ids and weights are replaced, after vLLM's router and before stmoe's experts
path, by a recorded trace's (``runtime.forced_routing`` does the same in stmoe's own
runtime): the cache, the store's reads, the prefetch workers and the predictor run as they
would on that routing, and vLLM's kernel computes on it. The tokens are meaningless (the
log line says so); the time, hits and bytes are what is measured.

Which routing a row gets: the trace's tokens as one stream of T; a request whose prompt
hashes to h (CRC-32 of its token ids) starts at stream token ``h % T``, and its token at
position p takes stream token ``(start + p) % T``, layer l the trace's layer l (the
trace's first L layers for a model of L). So different prompts replay different
stretches of the routing, and the same prompt the same stretch in every engine and every
round (what a benchmark compares). Rows of no request (vLLM's dummy and profiling runs)
keep the router's.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from stmoe.errors import StmoeError
from stmoe.vllm_plugin.batches import Span
from stmoe.vllm_plugin.config import PluginConfigError


class ForcedRouting:
    """The trace's routing for each row of vLLM's calls (``begin_call``, then ``force`` at
    each MoE layer)."""

    def __init__(self, path: Path, layers: int, num_experts: int, top_k: int) -> None:
        from stmoe.trace import load_trace

        try:
            trace = load_trace(path)
        except (StmoeError, OSError, ValueError) as exc:
            raise PluginConfigError(f"STMOE_VLLM routing={path}: {exc}") from None
        where = f"STMOE_VLLM routing={path}"
        if trace.num_layers < layers or trace.top_k != top_k or trace.num_experts > num_experts:
            raise PluginConfigError(f"{where}: routing of {trace.num_layers} MoE layers, top-"
                                    f"{trace.top_k} of {trace.num_experts} experts cannot drive "
                                    f"a model of {layers} layers, top-{top_k} of {num_experts}")
        experts = trace.experts[:, :layers, :]
        if (experts < 0).any():
            raise PluginConfigError(f"{where}: some tokens route to fewer than top-{top_k} "
                                    "experts (empty slots, -1); give a trace of full rows")
        weights = (trace.weights[:, :layers, :] if trace.weights is not None
                   else np.full(experts.shape, 1.0 / top_k, np.float32))
        self.experts = torch.from_numpy(experts.astype(np.int64))  # [T, L, K]
        self.weights = torch.from_numpy(weights.astype(np.float32))
        self.tokens = int(experts.shape[0])
        self.label = f"{trace.meta.model} ({path.name}, {self.tokens} tokens)"
        self._start: dict[str, int] = {}
        self._rows: torch.Tensor | None = None  # the call's stream token per row
        self._n = 0

    def begin_call(self, spans: tuple[Span, ...],
                   prompt: Callable[[int], np.ndarray]) -> None:
        """A forward call starts: each of its requests' rows given its stream token
        (``prompt(i)``: the i-th span's prompt token ids, read for a request first seen)."""
        if not spans:
            self._rows = None
            return
        rows = np.empty(spans[-1].end, np.int64)
        for i, span in enumerate(spans):
            start = self._start.get(span.request)
            if start is None:
                ids = np.ascontiguousarray(prompt(i), dtype=np.int64)
                start = self._start[span.request] = zlib.crc32(ids.tobytes()) % self.tokens
            rows[span.start:span.end] = (start + span.computed
                                         + np.arange(span.end - span.start)) % self.tokens
        self._rows, self._n = torch.from_numpy(rows), len(rows)

    def finish(self, request: str) -> None:
        self._start.pop(request, None)

    def force(self, layer: int, ids: torch.Tensor,
              weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ids and weights with the requests' rows replaced by the trace's
        (the spans never hold more rows than the call: ``Steps._spans``)."""
        if self._rows is None:
            return ids, weights
        ids, weights = ids.clone(), weights.clone()
        ids[:self._n] = self.experts[self._rows, layer].to(ids.dtype)
        weights[:self._n] = self.weights[self._rows, layer].to(weights.dtype)
        return ids, weights
