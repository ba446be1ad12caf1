"""What to prefetch, for which layer, and when: the predictor driven through a run.

After each MoE layer routes, the predictor learns the router's choice (for every
row of the batch, in the protocol's order) and is asked for the experts of the
layer ``horizon`` ahead, wrapping to the next token's first layers after the last;
the answer goes to the prefetch queue before the layer computes, so loading
overlaps its compute. A prompt (prefill) is routed all at once, so its routing
is kept and taught token by token when the forward call ends. With the gate
lookahead, the next layer's router runs on this layer's MoE input (*early*), or
on the next layer's own input through its pre-MoE norm as that layer starts
(*late*: a hook per decoder layer; closer to what the router sees, less time to
load). The oracle (``run.future``) is asked nothing: it knows each layer's set.

A prompt's layer needs most of its experts at once, and the predictor has not been taught
the prompt yet; so during a prompt the next layer's loads come from its own router applied
to this layer's MoE input for every token (the early gate lookahead, whatever the
predictor): the experts the most tokens pick first, up to the cache's capacity, streamed
while this layer computes (``_stream_prompt``; where the routers cannot be found, the
predictor's set as for a decode step).
A predicted id outside the model's experts is a clear error here, on the compute
thread, before any of it is queued.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stmoe import cache_policy as cp
from stmoe.errors import OffloadError
from stmoe.hf.layout import ModelLayout, late_hidden
from stmoe.hf.routers import Router
from stmoe.predictors.base import Predictor, PredictorError
from stmoe.runtime.prefetch import Prefetcher
from stmoe.runtime.state import EngineState


@dataclass(frozen=True)
class GateLookahead:
    """The gate lookahead a run computes: each MoE layer's router, and with the late
    point each layer's (decoder layer, pre-MoE norm)."""

    routers: list[Router]
    late: list[tuple[torch.nn.Module, torch.nn.Module]] | None


def gate_lookahead(layout: ModelLayout, predictor: Predictor) -> GateLookahead | None:
    """The lookahead ``predictor`` takes from ``model`` (its point settled), or None when
    it takes none (beyond horizon 1: the tables alone)."""
    if not (predictor.uses_lookahead and predictor.horizon == 1):
        return None
    found = layout.routers
    if found is None:
        raise OffloadError(f"predictor {predictor.name!r} needs each MoE layer's router, "
                           "and this model's could not be found")
    late = layout.late
    try:
        point = predictor.resolve_lookahead_point(late is not None)
    except PredictorError as exc:
        raise OffloadError(str(exc)) from None
    predictor.use_lookahead_point(point)
    return GateLookahead(found, late if point == "late" else None)


class PrefetchPlanner:
    """Teaches ``predictor`` the routing and queues its predictions on ``prefetcher``."""

    def __init__(self, state: EngineState, predictor: Predictor, prefetcher: Prefetcher,
                 lookahead: GateLookahead | None, max_loads: int,
                 capacities: tuple[int, ...],
                 prompt_routers: list[Router] | None = None) -> None:
        self.state, self.predictor, self.prefetcher = state, predictor, prefetcher
        self.predicts = predictor.prefetches  # else nothing to learn or queue
        self.horizon = predictor.horizon
        self.top_k = predictor.shape.top_k
        self.routers = lookahead.routers if lookahead is not None else None
        self.late = lookahead.late if lookahead is not None else None  # the late point's
        self.max_loads = max_loads  # loads one prediction may start (its most confident first)
        # layer calls taught; ``quiet``: a layer call made again for a step's parts left
        # after a failed one had taught its routing (``runtime.step_layer``), not taught again
        self.lessons, self.quiet = 0, False
        self.capacities = capacities  # each layer's: what its predictions are cut to
        # cache policy score: each prediction's scores go to the layer's cache (its victims)
        self.scored = bool(state.caches) and state.caches[0].policy == "score"
        if self.scored and not predictor.scores_experts:  # (offload() says so first)
            raise OffloadError(f"cache policy 'score' needs a predictor that scores every "
                               f"expert; {predictor.name!r} scores none")
        self.prompt_routers = prompt_routers  # each layer's router, for a prompt's loads

    # ---- the model's forward calls (hf_glue.ForwardHooks) ----------------------------
    def forward_started(self) -> None:
        """A forward call started: a prompt starts each row's sequence afresh."""
        run = self.state.run
        if run.phase == "prefill" and run.future is None:
            for slot in run.slot_ids():
                self.predictor.reset(slot)

    def forward_ended(self) -> None:
        """A forward call ended: after a prompt, teach it and predict the next token's."""
        run = self.state.run
        if run.phase == "prefill" and run.future is None and run.prefill_routing:
            self._replay_prefill()
            for fwd, target in self._targets(self.state.num_layers - 1)[-self.horizon :]:
                self._plan(fwd, target)

    def layer_started(self, layer: int, hidden: torch.Tensor) -> None:
        """Before MoE layer ``layer``'s decoder layer runs: the late lookahead (its router
        on its input through its pre-MoE norm), then the prefetch for ``layer``."""
        run = self.state.run
        if run.future is not None:
            return
        assert self.late is not None
        self._lookahead(layer, hidden, self.late[layer][1])  # a prompt's too: it learns
        if not self._streams_prompt():
            self._plan(run.fwd, layer)

    # ---- each MoE layer (experts_path.ExpertsPath) ----------------------------------
    def early_lookahead(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The early gate lookahead ``after_routing(layer, ...)`` will take, computed where
        ``hidden`` is ([rows, K'] ids, not yet on the host), or None where it takes none.
        Why: on a device, its ids go up with the router's in the layer call's one copy to
        the host, queued before the experts' kernels, where ``.to("cpu")`` after them would
        make the host wait for the whole layer (``experts_path``)."""
        return self._lookahead_ids(layer + 1, hidden) if self._takes_early(layer) else None

    def prompt_counts(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The counts ``after_routing(layer, ...)`` will stream the prompt's next layer by,
        computed where ``hidden`` is, or None where it streams none (``early_lookahead``'s
        reason: on a device they go up with the router's ids, before the experts' kernels)."""
        if not (self.predicts and self._streams_prompt()
                and layer + 1 < self.state.num_layers):
            return None
        return self._prompt_counts(layer + 1, hidden)

    def after_routing(self, layer: int, rows: np.ndarray, hidden: torch.Tensor,
                      early: np.ndarray | None = None,
                      counts: np.ndarray | None = None) -> None:
        """Learn what the router chose and queue the prefetch ``horizon`` layers ahead
        (``early``: ``early_lookahead``'s ids on the host, ``counts``: ``prompt_counts``',
        where the caller brought them)."""
        if not self.predicts or self.quiet:
            return
        self.lessons += 1
        run = self.state.run
        last = layer == self.state.num_layers - 1
        if run.phase == "prefill" and run.future is None:
            run.prefill_routing.append(rows.astype(np.int16))
            if self._streams_prompt():
                if self._takes_early(layer):
                    self._lookahead(layer + 1, hidden, early=early)  # it still learns
                if not last:
                    self._stream_prompt(layer + 1, hidden, counts)
                return
            targets = [] if last else self._targets(layer)
        else:
            if run.future is None:
                length = run.batch[1]
                for row, slot in enumerate(run.slot_ids()):
                    self.predictor.update(layer, rows[row * length + length - 1], slot)
            targets = self._targets(layer)
        if self.late is not None:  # the next layer is predicted as it starts (layer_started)
            targets = [(f, t) for f, t in targets if f != run.fwd]
        elif self._takes_early(layer):
            self._lookahead(layer + 1, hidden, early=early)
        for fwd, target in targets:
            self._plan(fwd, target)

    # ---- helpers -----------------------------------------------------------------------
    def _takes_early(self, layer: int) -> bool:
        """Whether ``after_routing(layer, ...)`` teaches the early gate lookahead of layer
        ``layer + 1`` (the one condition ``early_lookahead`` and it share)."""
        return (self.predicts and self.late is None and self.routers is not None
                and self.state.run.future is None and layer + 1 < self.state.num_layers)

    def _streams_prompt(self) -> bool:
        return (self.prompt_routers is not None and self.state.run.phase == "prefill"
                and self.state.run.future is None)

    def _prompt_counts(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """How many of the prompt's tokens pick each expert at ``layer``: its router on
        ``hidden`` (the layer before's MoE input, every token), where ``hidden`` is."""
        assert self.prompt_routers is not None
        router = self.prompt_routers[layer]
        picks = router.ranked(hidden.reshape(-1, hidden.shape[-1]),
                              min(self.top_k, router.num_experts)).reshape(-1)
        return torch.bincount(picks, minlength=router.num_experts)

    def _stream_prompt(self, layer: int, hidden: torch.Tensor,
                       counts: np.ndarray | None = None) -> None:
        """Queue ``layer``'s loads for the prompt: the experts the most tokens pick first
        (``_prompt_counts``, or ``counts``: those, already on the host), up to capacity."""
        if counts is None:
            counts = self._prompt_counts(layer, hidden).to("cpu").numpy()
        ranked = np.argsort(-counts, kind="stable")[: self.capacities[layer]]  # ties: smaller id
        experts = [int(e) for e in ranked if counts[e] > 0]
        # not through admission: its precisions are a decode step's, and a prompt's layer
        # needs most of these anyway
        self._prefetch(self.state.run.fwd, layer, experts, admit=False)

    def _replay_prefill(self) -> None:
        """Teach the predictor the prompt token by token (the protocol's order)."""
        run = self.state.run
        batch, length = run.batch
        routing = np.stack(run.prefill_routing, axis=1)  # [B*S, L, K]
        for row, slot in enumerate(run.slot_ids()[:batch]):
            self.predictor.reset(slot)
            for t in range(length):
                if run.mask is not None and not run.mask[row, t]:
                    continue
                for layer in range(self.state.num_layers):
                    self.predictor.update(layer, routing[row * length + t, layer], slot)

    def _targets(self, layer: int) -> list[tuple[int, int]]:
        """(forward call, layer) to predict once ``layer`` is known: ``horizon`` ahead,
        wrapping to the next token's first layers after the last."""
        h, n, fwd = self.horizon, self.state.num_layers, self.state.run.fwd
        out = [(fwd, layer + h)] if layer + h < n else []
        if layer == n - 1:
            out += [(fwd + 1, t) for t in range(min(h, n))]
        return out

    def _lookahead_ids(self, layer: int, hidden: torch.Tensor,
                       norm: torch.nn.Module | None = None) -> torch.Tensor:
        """Layer ``layer``'s router on ``hidden`` (the previous layer's MoE input; with the
        late lookahead, layer ``layer``'s input through ``norm``), each row's last token:
        its top 2K ids, where ``hidden`` is."""
        assert self.routers is not None
        batch, length = self.state.run.batch
        last_rows = hidden.reshape(batch, length, -1)[:, -1]
        if norm is not None:
            last_rows = late_hidden(norm, last_rows)
        router = self.routers[layer]
        return router.ranked(last_rows, min(2 * self.top_k, router.num_experts))

    def _lookahead(self, layer: int, hidden: torch.Tensor,
                   norm: torch.nn.Module | None = None, early: np.ndarray | None = None) -> None:
        """Gate lookahead: ``_lookahead_ids`` taught to the predictor (``early``: those ids,
        already on the host)."""
        run = self.state.run
        ids = early if early is not None else self._lookahead_ids(
            layer, hidden, norm).to("cpu").numpy()
        for row, slot in enumerate(run.slot_ids()):
            self.predictor.lookahead(layer, ids[row], slot)

    def _predicted(self, fwd: int, layer: int) -> tuple[list[int], np.ndarray | None]:
        """The prediction for (``fwd``, ``layer``), up to capacity, and with cache policy
        score the scores it was ranked from."""
        run = self.state.run
        capacity = self.capacities[layer]
        if run.future is not None:
            return list(run.future.get((fwd, layer), ()))[:capacity], None
        slots, scores = run.slot_ids(), None
        if self.scored:
            ids, scores = self.predictor.predict_batch_scored(layer, slots, capacity)
        else:
            ids = self.predictor.predict_batch(layer, slots, max_size=capacity)
        # Python ints (one call, not one per id)
        out = np.asarray(ids)[:capacity].astype(np.int64, copy=False).tolist()
        n = self.state.num_experts
        if out and (min(out) < 0 or max(out) >= n):  # checked here, not as a worker's KeyError
            bad = next(e for e in out if not 0 <= e < n)
            raise OffloadError(f"predictor {self.predictor.name!r} predicted expert {bad} for "
                               f"layer {layer}, outside this model's experts 0..{n - 1} (its "
                               "tables were profiled on another model?)")
        if scores is not None and len(scores) != n:
            raise OffloadError(f"predictor {self.predictor.name!r} scored {len(scores)} experts "
                               f"for layer {layer}; this model has {n}")
        return out, scores

    def _plan(self, fwd: int, layer: int) -> None:
        """Predict (call ``fwd``, ``layer``) and queue its loads, unless admission has the
        layer's prefetch off: then the predictor is not asked (its cost on the compute
        thread is what prefetch would have to repay); it still learns every routing."""
        run = self.state.run
        off = run.admission is not None and run.future is None and not run.admission.wants(layer)
        if off:  # no prediction, so policy score's victims go by LRU until the next one
            experts, scores = [], (cp.NO_SCORES if self.scored else None)
        else:
            experts, scores = self._predicted(fwd, layer)
        self._prefetch(fwd, layer, experts, scores=scores)

    def _prefetch(self, fwd: int, layer: int, experts: list[int], admit: bool = True,
                  scores: np.ndarray | None = None) -> None:
        """Record the prediction for (``fwd``, ``layer``), keep its experts from eviction
        and queue the loads of those not cached (``admit``: those admission admits);
        ``scores`` (policy score) rank the layer's victims from now on (none: as LRU)."""
        with self.state.cv:
            if scores is not None:
                self.state.caches[layer].scores = scores
            run = self.state.run
            if admit and run.admission is not None and run.future is None:  # the oracle: bound
                experts = run.admission.admit(fwd, layer, experts)
            chosen = frozenset(experts)
            run.pending[layer] = (fwd, chosen)
            self.state.caches[layer].protected = chosen
            self.prefetcher.request(fwd, layer, experts, self.max_loads)
