"""The compute thread's path through one MoE layer call, from the router to the output.

``ExpertsPath.run`` is what an experts module's forward becomes once offloaded (the
engine calls it for a solo forward's layer, and for a server step's, ``serve_layer``):

1. hand the routing to the planner, which learns it and queues the next layer's
   prefetches (the predictor's work overlaps any wait for this layer's loads);
2. make sure the experts the router picked are in the layer's cache, waiting for
   in-flight prefetches or loading misses itself (this wait is the *stall*; the
   workers start no new load meanwhile: what is needed now comes first, and the
   next layer's loads start once this layer has its experts, during its compute);
3. compute: on the cache's slots in place where that gives the resident model's
   bits, else on a compact copy of those experts (ids renumbered in the same
   order), always with the model's own experts implementation, so the
   arithmetic, and so every output bit, is what the resident model computes.

Experts beyond the capacity (a long prompt's) are read into spare rows past it, given back
after the call (on the CPU; elsewhere into transient tensors, with the copy). Where the
tier's copies run asynchronously (a device cache), every read of a slot waits for its copy
and every rewrite for its readers (``slot_events``). One caller at a time: the engine's
step API claims the engine for the caller's thread first."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch

from stmoe.admission import record_call
from stmoe.errors import OffloadError
from stmoe.runtime.arrange import gather, load_transient, plan_id_order, read_extras
from stmoe.runtime.cache import READY, TEMP, LayerCache
from stmoe.runtime.demand import DemandLoads, Slots
from stmoe.runtime.device_path import DeviceSide, IdsToHost, SlotTable
from stmoe.runtime.hf_glue import GatheredExperts, any_expert_numbering, rows_independent
from stmoe.runtime.planning import PrefetchPlanner
from stmoe.runtime.prefetch import Prefetcher
from stmoe.runtime.state import CLOSED, EngineSettings, EngineState, closed_errors
from stmoe.runtime.store.tiers import aligned_buffer

Overflow = dict[int, dict[str, torch.Tensor]]  # expert -> its tensors, outside the cache
# each MoE layer's experts module and the experts implementation it had before offloading
Layers = list[tuple[torch.nn.Module, Callable[..., torch.Tensor]]]
Segments = tuple[list[slice], Executor | None]  # rows computed alone, and on which threads


class ExpertsPath:
    """Every MoE layer's experts calls, served from the caches of ``state``."""

    def __init__(self, state: EngineState, layers: Layers, settings: EngineSettings,
                 prefetcher: Prefetcher, planner: PrefetchPlanner) -> None:
        self.state, self.prefetcher, self.planner = state, prefetcher, planner
        self.layer_of = {id(module): i for i, (module, _) in enumerate(layers)}
        self.modules = [module for module, _ in layers]
        self.gathered = [GatheredExperts(module) for module, _ in layers]  # bound per call
        self.base = [forward for _, forward in layers]
        # implementations whose result does not depend on how experts are numbered (each
        # token's top-k outputs summed in routing order): they compute on the cache's
        # slots in place, where the others get a compact copy (``gather``)
        self.any_numbering = [any_expert_numbering(module) for module, _ in layers]
        # of those, the ones that compute each token alone: any call on the slots in place
        self.any_rows = [rows_independent(module) for module, _ in layers]
        self.policy = settings.policy
        self._buf = aligned_buffer(state.max_block)  # the compute thread's read buffer
        self.demand = DemandLoads(state, prefetcher, self._buf)
        self._ensure = self.demand.ensure  # (the stall: the name tests call)
        self._device: DeviceSide | None = None  # a device cache's helpers (``_on_device``)

    @closed_errors
    def run(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, *args: Any, segments: Segments | None = None,
            **kwargs: Any) -> tuple[torch.Tensor, float]:
        """Layer ``layer``'s experts call (the caller holds the engine's claim): the output
        and the seconds it waited for experts. ``segments``: several requests' rows, their
        experts loaded once, each segment computed alone (its solo bits), on the pool's
        threads side by side where one is given."""
        state = self.state
        if state.closed:
            raise OffloadError(CLOSED)
        ids = top_k_index.detach()
        dev = self._on_device()  # a device cache: the ids up once, pinned, non-blocking,
        early = None  # with the next layer's early gate lookahead where there is one
        counts = None  # or a prompt's counts for the next layer's loads: the same copy
        if dev:
            rows, early, counts = dev.ids.rows_and(
                ids, self.planner.early_lookahead(layer, hidden_states),
                self.planner.prompt_counts(layer, hidden_states))
        else:
            rows = (ids if ids.device.type == "cpu" else ids.to("cpu")).numpy()
        if rows.shape[-1] > state.caches[layer].capacity:
            raise OffloadError(f"the router picks {rows.shape[-1]} experts per token but the "
                               f"cache holds {state.caches[layer].capacity} at layer {layer}")
        # sorted distinct ids: plain Python beats torch.unique on a decode step's few ids
        needed = sorted(set(rows.ravel().tolist())) if rows.size <= 64 else np.unique(rows).tolist()
        cache = state.caches[layer]
        # the common decode call (the whole cache in expert order, or one token on the slots
        # in place) whose experts are all cached takes a short path: nothing to wait for
        quick = cache.identity or (self.any_numbering[layer] and (rows.shape[0] == 1
                                                                 or self.any_rows[layer]))
        predicted, held = self._begin(layer, cache, needed, quick)  # paused if it will wait
        if held is not None:
            return self._run_hits(layer, cache, needed, held, rows, predicted, hidden_states,
                                  top_k_index, top_k_weights, segments, args, kwargs,
                                  (early, counts))
        try:
            if dev is None:  # (on a device: after the layer's kernels are launched)
                self.planner.after_routing(layer, rows, hidden_states)
            params, n, index, in_place, spare, slots, stall = self._prepare(
                layer, cache, needed, rows, top_k_index, predicted)
        except BaseException:
            with state.cv:
                self.prefetcher.pause(False)
            raise
        if index is not top_k_index:
            index = index.to(top_k_index.device, top_k_index.dtype)
        with state.cv:  # the layer has its experts: the workers go on, the slots used now
            self.prefetcher.pause(False)
            for s in slots.values():
                cache.touch(s)
            if not in_place:  # the copy is made: the slots may change
                self._read(cache, slots.values())
                self._unpinned(cache)
        try:
            out = self._compute(layer, params, n, hidden_states, index, top_k_weights,
                                segments, args, kwargs)
            if dev is not None:  # the predictor's host time overlaps the device's compute
                self.planner.after_routing(layer, rows, hidden_states, early, counts)
            return out, stall
        finally:
            if in_place:  # computed from the rows: they stay pinned until now
                try:
                    cache.release_spare(spare)
                finally:
                    self._read(cache, slots.values())
                    self._unpin(cache)

    def _run_hits(self, layer: int, cache: LayerCache, needed: list[int], held: list[int],
                  rows: np.ndarray, predicted: frozenset[int], hidden_states: torch.Tensor,
                  top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  segments: Segments | None, args: tuple[Any, ...], kwargs: dict[str, Any],
                  brought: tuple[np.ndarray | None, np.ndarray | None]
                  ) -> tuple[torch.Tensor, float]:
        """``run`` where every needed expert was READY at ``_begin`` (``held``: their slots,
        touched there) and the call computes on the slots in place: the same counters and
        bits as the long path, with no wait (pinned, they cannot leave before the unpin)."""
        state = self.state
        launched = False  # the readers' free event recorded (else in ``finally``: a failed
        try:  # call's queued kernels may still read the slots a worker may now overwrite)
            if self._device is None:  # (on a device: after the layer's kernels are launched)
                self.planner.after_routing(layer, rows, hidden_states)
            state.run.stats.phases[state.run.phase].add(
                layer, 0.0, len(needed), len(needed), 0, len(predicted),
                len(predicted.intersection(needed)))
            if cache.identity:  # every expert has its own slot: the slabs are the full tensors
                params, n, index = cache.slabs, state.num_experts, top_k_index
            else:  # one token (or tokens computed alone): its experts' slots, any numbering
                params, n = cache.slabs, cache.capacity
                index = self._renumber(layer, dict(zip(needed, held, strict=True)), needed,
                                       rows, top_k_index)
                if index.dtype != top_k_index.dtype:  # (the host's numbering: int64)
                    index = index.to(top_k_index.device, top_k_index.dtype)
            self._reading(cache, held)
            out = self._compute(layer, params, n, hidden_states, index, top_k_weights,
                                segments, args, kwargs)
            self._read(cache, held)
            launched = True
            if self._device is not None:  # the predictor's host time overlaps the compute
                self.planner.after_routing(layer, rows, hidden_states, *brought)
            return out, 0.0
        finally:
            try:
                if not launched:
                    self._read(cache, held)
            finally:
                self._unpin(cache)

    def _on_device(self) -> DeviceSide | None:
        """Where the tier copies to a device: the ids' way to the host and each layer's
        expert -> slot table (made for the tier's device ops, again if the tier changes)."""
        ops = self.state.device_ops()
        if ops is None:
            self._device = None
        elif self._device is None or self._device.ids.ops is not ops:
            state = self.state
            self._device = DeviceSide(IdsToHost(ops), [
                SlotTable(state.num_experts, state.device) for _ in state.caches])
        return self._device

    def _renumber(self, layer: int, row_of: Slots, needed: list[int], rows: np.ndarray,
                  top_k_index: torch.Tensor) -> torch.Tensor:
        """The router's ids as the rows ``row_of`` gives their experts: through the layer's
        table on a device, else from the host's ``rows`` (``needed``: their sorted ids)."""
        if self._device is not None:
            return self._device.tables[layer].renumber(row_of, top_k_index)
        return torch.from_numpy(np.array([row_of[e] for e in needed])[
            np.searchsorted(needed, rows)])

    def _compute(self, layer: int, params: dict[str, torch.Tensor], n: int,
                 hidden_states: torch.Tensor, index: torch.Tensor, top_k_weights: torch.Tensor,
                 segments: Segments | None, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> torch.Tensor:
        """The model's own experts implementation on ``params`` (``n`` experts), or each
        segment's rows alone (on the pool's threads side by side)."""
        weights, base = self.gathered[layer].bind(params, n), self.base[layer]
        if segments is None:
            return base(weights, hidden_states, index, top_k_weights, *args, **kwargs)
        parts, pool = segments
        one = lambda s: base(weights, hidden_states[s], index[s], top_k_weights[s])  # noqa: E731
        if pool is not None and hidden_states.device.type == "cuda":
            # a pool thread's current stream is its own: launch on the caller's, where the
            # slots' ready and free events are waited on and recorded
            stream, plain = torch.cuda.current_stream(hidden_states.device), one

            def one(s: slice) -> torch.Tensor:
                with torch.cuda.stream(stream):
                    return plain(s)
        return torch.cat(list(pool.map(one, parts)) if pool else [one(s) for s in parts])

    def _prepare(self, layer: int, cache: LayerCache, needed: list[int], rows: np.ndarray,
                 top_k_index: torch.Tensor, predicted: frozenset[int]) -> tuple[
                     dict[str, torch.Tensor], int, torch.Tensor, bool, int, Slots, float]:
        """The needed experts made ready and laid out for the implementation: (weights,
        their number, the router's ids renumbered, in place or a copy, spare rows used,
        expert -> slot, the seconds waited); the layer's counters recorded."""
        state = self.state
        start = time.perf_counter()
        slots, extra, hits, late = self._ensure(cache, needed)
        self._reading(cache, slots.values())  # what follows reads them (a gather, moves, compute)
        stall = time.perf_counter() - start
        in_place = cache.identity or self.any_numbering[layer]
        spare = 0  # spare rows past the capacity this call uses
        if cache.identity:  # every expert has its own slot: the slabs are the full tensors
            params, n, index = cache.slabs, state.num_experts, top_k_index
        elif in_place and (rows.shape[0] == 1 or self.any_rows[layer]) and not extra:
            # one token (or tokens computed alone): the slots in any numbering
            params, n = cache.slabs, cache.capacity
            index = self._renumber(layer, slots, needed, rows, top_k_index)
        elif in_place and cache.reserved >= cache.capacity + len(extra):
            # several tokens: the slots renumbered only in the experts' id order gives the
            # resident model's bits (the implementation groups tokens by number; tested),
            # so the rows are moved into that order, the extra experts read into spare rows
            row_of, read_s = self._arrange(cache, needed, slots, extra)
            stall += read_s
            spare = len(extra)
            n = cache.capacity + spare
            params = {name: rows_[:n] for name, rows_ in cache.rows.items()}
            slots = {e: r for e, r in row_of.items() if r < cache.capacity}
            index = self._renumber(layer, row_of, needed, rows, top_k_index)
        else:  # a copy of the needed experts, ids renumbered 0..U-1 in the same order
            in_place = False
            t0 = time.perf_counter()
            overflow = {e: load_transient(state, cache, e, self._buf) for e in extra}
            stall += time.perf_counter() - t0
            params, n = gather(cache, needed, slots, overflow), len(needed)
            index = torch.from_numpy(np.searchsorted(needed, rows))
        state.run.stats.phases[state.run.phase].add(
            layer, stall, len(needed), hits, late, len(predicted),
            len(predicted.intersection(needed)),
        )
        return params, n, index, in_place, spare, slots, stall

    def _arrange(self, cache: LayerCache, needed: list[int], slots: Slots,
                 extra: list[int]) -> tuple[dict[int, int], float]:
        """Move the needed experts' rows into id order (``arrange``) and read ``extra`` into
        theirs; (expert -> row, the seconds spent reading). The copies run without the
        lock: their rows hold pinned experts (no worker evicts or writes them) or are
        spare rows. On any failure every row involved is freed (its expert loads again
        when next needed), the spare rows given back and the experts unpinned."""
        state = self.state
        target, moves = plan_id_order(needed, slots, len(extra), cache.capacity)
        try:
            temp = cache.row_buffer() if any(TEMP in m for m in moves) else {}
            for src, dst in moves:
                cache.copy_row(src, dst, temp)
            with state.cv:
                cache.place(target, slots)
            start = time.perf_counter()
            read_extras(state, cache, {e: target[e] for e in extra}, self._buf,
                        state.demand_stream)
        except BaseException:
            # copies already queued into these rows may still run: a worker's write into
            # one waits for them (their free event), as it waits for a layer's readers
            self._read(cache, {r for r in (*slots.values(), *target.values())
                               if r < cache.capacity})
            with state.cv:
                for row in slots.values():  # the rows moved, placed or being read
                    cache.abandon(row)
            try:
                cache.release_spare(len(extra))
            finally:
                self._unpin(cache)
            raise
        return target, time.perf_counter() - start

    def _begin(self, layer: int, cache: LayerCache, needed: list[int],
               quick: bool) -> tuple[frozenset[int], list[int] | None]:
        """The compute thread reaches ``layer``: a worker's failure is raised, requests for
        this layer turn stale, the needed experts are pinned; the prediction made for it,
        and where ``quick`` and every needed expert is READY, their slots (touched: used
        now), else None."""
        with self.state.cv:
            self.prefetcher.raise_error()
            run = self.state.run
            run.pos = (run.fwd, layer)
            pending, run.pending[layer] = run.pending[layer], None
            predicted = pending[1] if pending is not None and pending[0] == run.fwd else frozenset()
            cache.protected = frozenset()
            cache.pinned = frozenset(needed)
            # the layer will wait (a miss, a load in flight): no new load may compete with
            # what it waits for, from now (before the planner queues the next layer's) until
            # its experts are ready
            where, states = cache.where, cache.state
            held = [where.get(e) for e in needed]
            ready = all(s is not None and states[s] == READY for s in held)
            self.prefetcher.pause(not ready)
            if run.future is not None and not run.future:  # the oracle's recording pass
                run.routing_log[(run.fwd, layer)] = tuple(needed)
            # admission judges prefetches: without a predictor that makes them, nothing
            if run.admission is not None and run.phase == "decode" and self.planner.predicts:
                record_call(run, cache, layer, needed, time.perf_counter())
            if not (ready and quick):
                return predicted, None
            for s in held:
                cache.touch(s)  # type: ignore[arg-type]
        return predicted, held  # type: ignore[return-value]

    def _reading(self, cache: LayerCache, slots: Iterable[int]) -> None:
        """Kernels are about to read ``slots``: after their copies (``SlotEvents``, if any)."""
        if (events := self.state.slot_events(cache)) is not None:
            events.before_read(list(slots))

    def _read(self, cache: LayerCache, slots: Iterable[int]) -> None:
        """The call's readers of ``slots`` are launched (their ``free`` event, if any)."""
        if (events := self.state.slot_events(cache)) is not None:
            events.after_read(list(slots))

    def _unpin(self, cache: LayerCache) -> None:
        """The layer no longer reads its slots: they may be evicted (no reuse: dropped)."""
        with self.state.cv:
            self._unpinned(cache)

    def _unpinned(self, cache: LayerCache) -> None:
        """(lock held) ``_unpin``."""
        cache.pinned = frozenset()
        if self.policy == "none":
            self.state.run.stats.bytes_wasted += cache.drop_ready() * self.state.expert_bytes
