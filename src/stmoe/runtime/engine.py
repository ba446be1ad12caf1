"""The offload engine: transformers' experts call us; we bring the weights.

``register()`` adds the ``stmoe_offload`` implementation to transformers'
``ExpertsInterface``. With it selected, every experts module's forward comes
here with the router's decision (hidden states, top-k ids, top-k weights). The
model keeps its own routing code; only where the expert weights come from
changes. For each MoE layer the engine:

1. makes sure the experts the router picked are in the layer's cache, waiting
   for in-flight prefetches or loading misses itself (this wait is the *stall*);
2. gathers those experts into a compact tensor (ids renumbered in the same
   order) and runs the model's own experts implementation on it, so the
   arithmetic, and so every output bit, is what the resident model computes;
3. tells the predictor what the router chose and queues the predicted experts
   of the next layer (most confident first) for the prefetch workers, before
   computing, so loading overlaps this layer's compute. With the *late* gate
   lookahead the next layer is predicted instead as it starts (a pre-hook on
   its decoder layer runs its router on its input), overlapping its attention.

Prefetch workers drop requests whose layer the compute thread has reached
(stale); a worker's I/O error is raised on the compute thread at its next
layer, with the cache left consistent.
"""

from __future__ import annotations

import heapq
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stmoe.capture import experts_modules, late_hidden, late_points, lookahead_ids
from stmoe.predictors.base import Predictor, PredictorError
from stmoe.runtime.cache import LOADING, POLICIES, READY, LayerCache, param_specs
from stmoe.runtime.stats import RuntimeStats
from stmoe.runtime.store import Block, ExpertStore, StoreError
from stmoe.runtime.tiers import Tier, aligned_buffer, padded

IMPL_NAME = "stmoe_offload"
Slots = dict[int, int]  # expert -> cache slot
Overflow = dict[int, dict[str, torch.Tensor]]  # expert -> its tensors, outside the cache


def _offloaded_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    engine = getattr(self, "_stmoe_engine", None)
    if engine is None:
        raise StoreError(f"{type(self).__name__} uses experts implementation {IMPL_NAME!r} but "
                         "is not offloaded; call stmoe.offload(model, ...)")  # fmt: skip
    return engine.experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)


def register() -> None:
    """Make ``stmoe_offload`` a valid ``config._experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, _offloaded_forward)


class _Weights:
    """Stands in for an experts module: the gathered experts' weights, all else delegated."""

    def __init__(self, module: torch.nn.Module, params: dict[str, torch.Tensor], n: int) -> None:
        self.__dict__.update(params)
        self.__dict__["num_experts"] = n
        self.__dict__["_module"] = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


class OffloadEngine:
    """Serves one model's experts from ``store`` through ``tier`` into bounded caches."""

    def __init__(
        self,
        model: torch.nn.Module,
        store: ExpertStore,
        tier: Tier,
        capacity: int,
        predictor: Predictor,
        policy: str = "predicted",
        workers: int = 2,
        device: torch.device | None = None,
        budget: int | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise StoreError(f"unknown cache policy {policy!r}; choose from {', '.join(POLICIES)}")
        if workers < 0:
            raise StoreError(f"workers must be >= 0, got {workers}")
        store.check_model(model)
        modules = experts_modules(model)
        self.model, self.store, self.tier, self.predictor = model, store, tier, predictor
        self.policy = policy
        self.num_layers = len(modules)
        self.num_experts = int(store.model["num_experts"])
        if not 1 <= capacity <= self.num_experts:
            raise StoreError(
                f"capacity {capacity} experts per layer is outside 1..{self.num_experts}"
            )
        self.capacity = capacity
        self.top_k = predictor.shape.top_k
        self._predicts = predictor.name != "ondemand"  # on-demand: nothing to learn or queue
        # how many layers ahead predictions are made (stmoe-plus's horizon knob; else 1)
        self.horizon = int(getattr(getattr(predictor, "config", None), "horizon", 1))
        self._routers = None
        # the late lookahead: (decoder layer, pre-MoE norm) per MoE layer, when in use
        self._late: list[tuple[torch.nn.Module, torch.nn.Module]] | None = None
        if predictor.uses_lookahead and self.horizon == 1:  # (beyond: the tables alone)
            from stmoe.capture import routers

            self._routers = routers(model, modules)
            if self._routers is None:
                raise StoreError(f"predictor {predictor.name!r} needs each MoE layer's router, "
                                 "and this model's could not be found")  # fmt: skip
            late = late_points(model, modules)
            try:
                point = predictor.resolve_lookahead_point(late is not None)
            except PredictorError as exc:
                raise StoreError(str(exc)) from None
            predictor.use_lookahead_point(point)
            self._late = late if point == "late" else None
        # loads a prediction may start per layer (the most confident experts not yet cached)
        self.budget = min(capacity, budget if budget is not None else capacity)
        if self.budget < 0:
            raise StoreError(f"the prefetch budget must be >= 0, got {budget}")
        if capacity < self.top_k:
            raise StoreError(f"capacity {capacity} experts per layer is below top-{self.top_k}: "
                             "one token's experts would not fit; use at least "
                             f"{self.top_k}")  # fmt: skip
        self.device = device or _resident_device(model)
        self.layer_of = {id(m): i for i, (_, m) in enumerate(modules)}
        self.base: list[Callable[..., torch.Tensor]] = []
        self.caches: list[LayerCache] = []
        for layer, (_name, module) in enumerate(modules):
            self.base.append(_base_forward(module))
            specs = param_specs(store.blocks[(layer, 0)])
            self.caches.append(LayerCache(layer, capacity, specs, self.num_experts, policy,
                                          self.device))  # fmt: skip
            _release_experts(module, self.num_experts)
            module._stmoe_engine = self  # type: ignore[assignment]
        self.expert_bytes = store.blocks[(0, 0)].nbytes
        self._max_block = max(padded(b) for b in store.blocks.values())
        lock = threading.Lock()
        self.cv = threading.Condition(lock)  # the compute thread waits here for slots
        self.closed = False
        self._threads: list[threading.Thread] = []
        self.work = threading.Condition(lock)  # the workers wait here for requests
        self._buf = aligned_buffer(self._max_block)  # the compute thread's read buffer
        self._stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self.reset(future=None)
        self._closing = False
        self._threads = [threading.Thread(target=self._worker, name=f"stmoe-prefetch-{i}",
                                          daemon=True) for i in range(workers)]  # fmt: skip
        for t in self._threads:
            t.start()
        self._hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       model.register_forward_hook(self._after_forward)]  # fmt: skip
        if self._late is not None:  # predict layer l as layer l starts (the late lookahead)
            self._hooks += [decoder_layer.register_forward_pre_hook(self._late_hook(layer),
                                                                    with_kwargs=True)
                            for layer, (decoder_layer, _) in enumerate(self._late)
                            if layer > 0]  # fmt: skip

    # ---- runs ----------------------------------------------------------------
    def reset(self, future: dict[tuple[int, int], tuple[int, ...]] | None = None,
              cold: bool = True) -> None:  # fmt: skip
        """Start a measured run: fresh counters, empty caches (``cold``), predictor slots
        reset. ``future`` (the oracle) maps (forward call, layer) to the experts it needs."""
        with self.cv:
            self.queue: list[tuple[int, int, int, int]] = []
            # loads of the previous run still in flight finish first: they must not
            # land in (or be counted by) the new run
            self._drain()
            if cold:
                for cache in self.caches:
                    for s in range(cache.capacity):
                        if cache.state[s] == READY:
                            cache.abandon(s)
            self.stats = RuntimeStats(self.num_layers, self.expert_bytes)
            self.fwd = -1
            self.pos = (-1, -1)
            self.batch = (1, 1)
            self.phase = "prefill"
            self.pending: list[tuple[int, frozenset[int]] | None] = [None] * self.num_layers
            self.routing_log: dict[tuple[int, int], tuple[int, ...]] = {}
            self.future = future
            self.forward_ends: list[float] = []
            self.started = time.perf_counter()
            self.error: BaseException | None = None
            self._prefill_routing: list[np.ndarray] = []
            self._mask: np.ndarray | None = None

    def _drain(self) -> None:
        """(lock held) Wait until no worker is loading (workers that died cannot hold a
        slot: their failures free it)."""
        while any(st == LOADING for c in self.caches for st in c.state):
            if not any(t.is_alive() for t in self._threads):
                break
            self.cv.wait(timeout=0.5)

    def finish(self) -> RuntimeStats:
        """End of a run: the last prefetches land (or fail: raised here), prefetched
        experts never used count as wasted; the final counters."""
        with self.cv:
            self.queue.clear()
            self._drain()
            self._raise_worker_error()
            unused = sum(c.unused_prefetches() for c in self.caches)
            self.stats.bytes_wasted += unused * self.expert_bytes
            for c in self.caches:  # count them once only
                for s in range(c.capacity):
                    c.prefetched[s] = False
            for phase in self.stats.phases.values():
                phase.sync()
            return self.stats

    def close(self) -> None:
        """Stop the workers and the tier; the model cannot run its experts afterwards."""
        with self.cv:
            self.closed = True
            self._closing = True
            self.work.notify_all()
        for t in self._threads:
            t.join()
        for h in self._hooks:
            h.remove()
        self.tier.close()

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    # ---- model hooks -----------------------------------------------------------
    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise StoreError("an offloaded model needs input_ids or inputs_embeds")
        batch, length = int(ids.shape[0]), int(ids.shape[1])
        mask = kwargs.get("attention_mask")
        with self.cv:
            self.fwd += 1
            self.batch = (batch, length)
            self.phase = "prefill" if length > 1 or self.fwd == 0 else "decode"
            self._prefill_routing = []
            self._mask = None
            if mask is not None and mask.dim() == 2:
                self._mask = mask[:, -length:].detach().to("cpu").bool().numpy()
        if self.phase == "prefill" and self.future is None:
            for slot in range(batch):
                self.predictor.reset(slot)

    def _after_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.forward_ends.append(time.perf_counter())
        if self.phase == "prefill" and self.future is None and self._prefill_routing:
            self._replay_prefill()
            for fwd, target in self._targets(self.num_layers - 1)[-self.horizon :]:
                self._prefetch(fwd, target, self._predicted(fwd, target))

    def _replay_prefill(self) -> None:
        """Teach the predictor the prompt token by token (the protocol's order)."""
        batch, length = self.batch
        routing = np.stack(self._prefill_routing, axis=1)  # [B*S, L, K]
        for slot in range(batch):
            self.predictor.reset(slot)
            for t in range(length):
                if self._mask is not None and not self._mask[slot, t]:
                    continue
                for layer in range(self.num_layers):
                    self.predictor.update(layer, routing[slot * length + t, layer], slot)

    # ---- the experts forward ------------------------------------------------------
    def experts_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        if self.closed:
            raise StoreError("this offloaded model was closed; offload it again to run it")
        layer = self.layer_of[id(module)]
        rows = top_k_index.detach().to("cpu").numpy()
        if rows.shape[-1] > self.capacity:
            raise StoreError(f"the router picks {rows.shape[-1]} experts per token but the "
                             f"cache holds {self.capacity} per layer")  # fmt: skip
        # sorted distinct ids: plain Python beats torch.unique on a decode step's few ids
        needed = sorted(set(rows.ravel().tolist())) if rows.size <= 64 else np.unique(rows).tolist()
        cache = self.caches[layer]
        with self.cv:
            self._raise_worker_error()
            self.pos = (self.fwd, layer)
            pending, self.pending[layer] = self.pending[layer], None
            predicted = (
                pending[1] if pending is not None and pending[0] == self.fwd else frozenset()
            )
            cache.protected = frozenset()
            cache.pinned = frozenset(needed)
            if self.future is not None and not self.future:  # the oracle's recording pass
                self.routing_log[(self.fwd, layer)] = tuple(needed)
        start = time.perf_counter()
        slots, overflow, hits, late = self._ensure(cache, needed)
        self.stats.phases[self.phase].add(
            layer, time.perf_counter() - start, len(needed), hits, late, len(predicted),
            len(predicted.intersection(needed)),
        )  # fmt: skip
        if cache.identity:  # every expert has its own slot: the slabs are the full tensors
            params, n, index = cache.slabs, self.num_experts, top_k_index
        else:
            params = self._gather(cache, needed, slots, overflow)
            compact = np.searchsorted(np.asarray(needed), rows)  # same order, ids 0..U-1
            n = len(needed)
            index = torch.from_numpy(compact).to(top_k_index.device, top_k_index.dtype)
        with self.cv:
            for s in slots.values():
                cache.touch(s)
            cache.pinned = frozenset()
            if self.policy == "none":
                self.stats.bytes_wasted += cache.drop_ready() * self.expert_bytes
        self._after_routing(layer, rows, hidden_states)
        weights = _Weights(module, params, n)
        return self.base[layer](weights, hidden_states, index, top_k_weights, *args, **kwargs)

    def _after_routing(self, layer: int, rows: np.ndarray, hidden: torch.Tensor) -> None:
        """Learn what the router chose and queue the prefetch ``horizon`` layers ahead."""
        if not self._predicts:
            return
        last = layer == self.num_layers - 1
        if self.phase == "prefill" and self.future is None:
            self._prefill_routing.append(rows.astype(np.int16))
            targets = [] if last else self._targets(layer)
        else:
            if self.future is None:
                batch, length = self.batch
                for slot in range(batch):
                    self.predictor.update(layer, rows[slot * length + length - 1], slot)
            targets = self._targets(layer)
        if self._late is not None:  # the next layer is predicted as it starts (_late_hook)
            targets = [(f, t) for f, t in targets if f != self.fwd]
        elif self._routers is not None and self.future is None and layer + 1 < self.num_layers:
            self._lookahead(layer + 1, hidden)
        for fwd, target in targets:
            self._prefetch(fwd, target, self._predicted(fwd, target))

    def _late_hook(self, layer: int) -> Callable[..., None]:
        """Before MoE layer ``layer``'s decoder layer runs: the late lookahead (its router
        on its input through its pre-MoE norm), then the prefetch for ``layer``."""

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self.future is not None:
                return
            assert self._late is not None
            hidden = args[0] if args else kwargs["hidden_states"]
            self._lookahead(layer, hidden, self._late[layer][1])
            self._prefetch(self.fwd, layer, self._predicted(self.fwd, layer))

        return hook

    def _targets(self, layer: int) -> list[tuple[int, int]]:
        """(forward call, layer) to predict once ``layer`` is known: ``horizon`` ahead,
        wrapping to the next token's first layers after the last."""
        h, n = self.horizon, self.num_layers
        out = [(self.fwd, layer + h)] if layer + h < n else []
        if layer == n - 1:
            out += [(self.fwd + 1, t) for t in range(min(h, n))]
        return out

    def _lookahead(self, layer: int, hidden: torch.Tensor,
                   norm: torch.nn.Module | None = None) -> None:  # fmt: skip
        """Gate lookahead: layer ``layer``'s router on ``hidden`` (the previous layer's
        MoE input; with the late lookahead, layer ``layer``'s input through ``norm``)."""
        assert self._routers is not None
        batch, length = self.batch
        last_rows = hidden.reshape(batch, length, -1)[:, -1]
        if norm is not None:
            last_rows = late_hidden(norm, last_rows)
        router = self._routers[layer]
        width = min(2 * self.top_k, router.shape[0])
        ids = lookahead_ids(last_rows, router, width).to("cpu").numpy()
        for slot in range(batch):
            self.predictor.lookahead(layer, ids[slot], slot)

    def _predicted(self, fwd: int, layer: int) -> list[int]:
        if self.future is not None:
            return list(self.future.get((fwd, layer), ()))[: self.capacity]
        ids = self.predictor.predict_batch(layer, range(self.batch[0]), budget=self.capacity)
        return [int(e) for e in ids[: self.capacity]]

    def _prefetch(self, fwd: int, layer: int, experts: list[int]) -> None:
        with self.cv:
            self.pending[layer] = (fwd, frozenset(experts))
            cache = self.caches[layer]
            cache.protected = frozenset(experts)
            loads = [e for e in experts if e not in cache.where][: self.budget]
            if not self._threads:  # no workers: nothing would take the requests
                loads = []
            for rank, e in enumerate(loads):
                heapq.heappush(self.queue, (fwd, layer, rank, e))
            if self.queue:
                self.work.notify(len(self._threads))

    # ---- loading --------------------------------------------------------------------
    def _ensure(self, cache: LayerCache, needed: list[int]) -> tuple[Slots, Overflow, int, int]:
        """Every needed expert READY in a slot (or, beyond capacity, in a transient buffer)."""
        slots: dict[int, int] = {}
        overflow: dict[int, dict[str, torch.Tensor]] = {}
        todo = list(needed)
        with self.cv:
            hits = sum(e in cache.where for e in needed)
            late = sum(e in cache.where and cache.state[cache.where[e]] == LOADING for e in needed)
            while todo:
                self._raise_worker_error()
                progressed = False
                for e in list(todo):
                    s = cache.where.get(e)
                    if s is not None:
                        if cache.state[s] == READY:
                            slots[e] = s
                            todo.remove(e)
                            progressed = True
                        continue
                    slot, wasted = cache.claim(e, prefetch=False)
                    if slot is None:
                        if any(st == LOADING and cache.holder[i] not in cache.pinned
                               for i, st in enumerate(cache.state)):  # fmt: skip
                            continue  # a worker is filling a slot we could take next
                        overflow[e] = self._load_transient(cache, e)
                    else:
                        self.stats.bytes_wasted += wasted * self.expert_bytes
                        self._load_into(cache, slot, e)
                        slots[e] = slot
                    todo.remove(e)
                    progressed = True
                if todo and not progressed:
                    self.cv.wait(timeout=1.0)
        return slots, overflow, hits, late

    def _load_into(self, cache: LayerCache, slot: int, expert: int) -> None:
        """Load a miss on the compute thread (lock held on entry and exit, not during I/O)."""
        block = self.store.blocks[(cache.layer, expert)]
        self.cv.release()
        try:
            cache.write(slot, self._fetch(block, self._buf), self._stream)
        except BaseException:
            self.cv.acquire()
            cache.abandon(slot)
            raise
        self.cv.acquire()
        cache.filled(slot)
        self.stats.bytes_moved += block.nbytes
        self.stats.demand_loads += 1

    def _load_transient(self, cache: LayerCache, expert: int) -> dict[str, torch.Tensor]:
        """An expert beyond the capacity (a long prefill): read outside the cache, used once."""
        block = self.store.blocks[(cache.layer, expert)]
        self.cv.release()
        try:
            src = self._fetch(block, self._buf)
            out = {}
            for p in cache.params:
                t = torch.empty(p.shape, dtype=p.dtype, device=cache.device)
                t.view(-1).view(torch.uint8).copy_(src[p.offset : p.offset + p.nbytes])
                out[p.name] = t
        finally:
            self.cv.acquire()
        self.stats.bytes_moved += block.nbytes
        self.stats.demand_loads += 1
        self.stats.overflow_loads += 1
        return out

    def _gather(
        self, cache: LayerCache, needed: list[int], slots: Slots, overflow: Overflow
    ) -> dict[str, torch.Tensor]:
        """The needed experts' weights as compact [U, ...] tensors, in expert-id order."""
        if not overflow:
            order = torch.tensor([slots[e] for e in needed], device=cache.device)
            return {p.name: cache.slabs[p.name].index_select(0, order) for p in cache.params}
        return {p.name: torch.stack([cache.slabs[p.name][slots[e]] if e in slots
                                     else overflow[e][p.name] for e in needed])
                for p in cache.params}  # fmt: skip

    def _worker(self) -> None:
        buf = aligned_buffer(self._max_block)
        stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        while True:
            with self.cv:
                while not self.queue and not self._closing:
                    self.work.wait()
                if self._closing:
                    return
                fwd, layer, _rank, expert = heapq.heappop(self.queue)
                if (fwd, layer) <= self.pos:
                    self.stats.stale_dropped += 1
                    continue
                cache = self.caches[layer]
                slot, wasted = cache.claim(expert, prefetch=True)
                if slot is None:
                    continue
                self.stats.bytes_wasted += wasted * self.expert_bytes
            block = self.store.blocks[(layer, expert)]
            try:
                cache.write(slot, self._fetch(block, buf), stream)
            except BaseException as exc:  # raised on the compute thread at its next layer
                with self.cv:
                    cache.abandon(slot)
                    if self.error is None:
                        self.error = exc
                    self.cv.notify_all()
                continue
            with self.cv:
                cache.filled(slot)
                self.stats.bytes_moved += block.nbytes
                self.stats.prefetch_loads += 1
                self.cv.notify_all()

    def _fetch(self, block: Block, buf: Any) -> torch.Tensor:
        """The tier's bytes for ``block``, refused unless complete."""
        src = self.tier.fetch(block, buf)
        if src.numel() != block.nbytes:
            raise StoreError(f"{self.store.data_path}: short read of layer {block.layer}, expert "
                             f"{block.expert} ({src.numel()} of {block.nbytes} bytes)")  # fmt: skip
        return src

    def _raise_worker_error(self) -> None:
        """(lock held) Re-raise a worker's failure here, on the compute thread."""
        exc, self.error = self.error, None
        if exc is not None:
            self.queue.clear()
            raise StoreError(f"a prefetch worker failed: {exc}") from exc

    def check(self) -> None:
        """Invariants, for tests: every cache consistent and within its capacity."""
        with self.cv:
            for cache in self.caches:
                cache.check()


def _base_forward(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The experts implementation the module used before offloading (its arithmetic)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = inspect.unwrap(type(module).forward)
    impl = getattr(module.config, "_experts_implementation", None) or "eager"
    if impl == IMPL_NAME:
        raise StoreError("this model is already offloaded")
    return ALL_EXPERTS_FUNCTIONS.get_interface(impl, original)


def _release_experts(module: torch.nn.Module, num_experts: int) -> None:
    """Replace the module's per-expert parameters by storage-free meta tensors."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dim() >= 1 and p.shape[0] == num_experts:
            module._parameters[name] = torch.nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False
            )


def _resident_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")
