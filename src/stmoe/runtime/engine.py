"""The offload engine: transformers' experts call us; we bring the weights.

With the ``stmoe_offload`` experts implementation selected (``hf_glue``), every
experts module's forward comes here with the router's decision (hidden states,
top-k ids, top-k weights). The model keeps its own routing code; only where the
expert weights come from changes. The engine builds and wires its parts, one
concern each, and runs their life cycle (measured runs, shutdown):

- the step API (``runtime.step``): ``begin_step`` / ``serve_layer`` / ``end_step`` /
  ``leave_step``, the one home of the run's books, called by transformers' forward hooks
  (a solo forward is a step of one part), by the server's step batcher, and by whatever
  drives the engine next (a GPU stream, a vLLM layer);
- ``experts_path``: the per-layer path: the router's experts made sure of in the layer's cache
  (the wait is the *stall*), laid out (in place, or a copy), and computed by the model's own
  experts implementation, so every output bit is the resident model's;
- ``planning``: what the predictor is taught and asked, for which layer and when (the
  horizon, the prompt's routing, the early or late gate lookahead);
- ``prefetch``: the worker threads loading the predictions, most urgent first, dropping stale
  requests and handing their errors to the compute thread (a failed step's: dropped);
- ``hf_glue``: transformers' side: registration, forward hooks, experts released to ``meta``;
- ``state``: the lock, caches and run state they share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch

from stmoe.admission import Admission
from stmoe.cache_policy import RUNTIME, policy_code
from stmoe.errors import OffloadError, StoreError
from stmoe.hf.layout import ModelLayout
from stmoe.hf.routers import Router
from stmoe.predictors.base import Predictor
from stmoe.runtime.cache import LayerCache, param_specs
from stmoe.runtime.experts_path import ExpertsPath, Layers
from stmoe.runtime.forced_routing import RoutingSource
from stmoe.runtime.hf_glue import ForwardHooks, base_forward, let_go, resident_device, take_over
from stmoe.runtime.planning import GateLookahead, PrefetchPlanner, gate_lookahead
from stmoe.runtime.prefetch import CLOSE_WAIT_S, Prefetcher
from stmoe.runtime.slot_layout import SlotLayout
from stmoe.runtime.state import EngineSettings, EngineState, Future, RunState, check_cache_device
from stmoe.runtime.stats import RuntimeStats
from stmoe.runtime.step import LayerTally, Part, Step, current_driver, foresee
from stmoe.runtime.step_layer import serve_parts
from stmoe.runtime.store import ExpertStore
from stmoe.runtime.store.loader import Loader
from stmoe.runtime.store.tiers import Tier
from stmoe.util.units import layer_capacities


class Removable(Protocol):
    """What the engine undoes at ``close`` (the forward hooks it installed)."""
    def remove(self) -> None: ...


class OffloadEngine:
    """Serves one model's experts from ``store`` through ``tier`` into bounded caches."""

    def __init__(self, model: torch.nn.Module, store: ExpertStore, tier: Tier,
                 predictor: Predictor, settings: EngineSettings,
                 layout: ModelLayout | None = None) -> None:
        self.layout = layout = layout or ModelLayout.of(model)
        store.check_model(model, layout)
        # each layer's experts module and its own implementation (refuses an offloaded model)
        layers = [(module, base_forward(module)) for _, module in layout.modules]
        lookahead = gate_lookahead(layout, predictor)
        device = settings.device or resident_device(model)
        self._wire(model, layers, store, tier, predictor, settings, device, lookahead,
                   layout.routers if predictor.prefetches else None)
        for module, _ in layers:
            take_over(module, self, self.num_experts, device)
        self.hooks: Removable = ForwardHooks(model, self, self.planner)

    def _wire(self, model: torch.nn.Module, layers: Layers, store: ExpertStore, tier: Tier,
              predictor: Predictor, settings: EngineSettings, device: torch.device,
              lookahead: GateLookahead | None,
              prompt_routers: list[Router] | None,
              planner: type[PrefetchPlanner] = PrefetchPlanner,
              layouts: dict[str, SlotLayout] | None = None,
              worker_cpus: set[int] | None = None) -> None:
        """The engine's parts for ``layers`` (each MoE layer's experts module and the
        implementation its calls compute with), whoever runs the model: transformers
        (``__init__``), or a runtime that calls ``ExpertsPath.run`` from its own MoE layers
        (the vLLM plugin) and sets ``hooks``; ``planner``: a ``PrefetchPlanner`` that knows
        its batches; ``layouts``: parameters the slots hold in its kernel layout, converted
        as each expert lands (default: the device's); ``worker_cpus``: where the prefetch
        workers run (default: where the calling thread may)."""
        _check_settings(settings)
        check_cache_device(device, tier)
        self.model, self.store, self.predictor = model, store, predictor
        self.settings, self.policy = settings, settings.policy
        self.num_layers = len(layers)
        self.num_experts = int(store.model["num_experts"])
        capacities = layer_capacities(settings.capacity, self.num_experts,  # (counts: not None)
                                      predictor.shape.top_k, num_layers=self.num_layers,
                                      error=OffloadError) or ()
        self.capacities, self.max_loads = capacities, _max_loads(settings.max_loads, capacities)
        self.device = device
        caches = [LayerCache(layer, capacities[layer], param_specs(store.blocks[(layer, 0)]),
                             self.num_experts, self.policy, self.device, layouts)
                  for layer in range(self.num_layers)]
        self.state = EngineState(caches, store, Loader(tier, store), self.device)
        self.state.use_tier_events()
        self.caches, self.cv, self.expert_bytes = caches, self.state.cv, self.state.expert_bytes
        self.prefetcher = Prefetcher(self.state, settings.workers, worker_cpus)
        self.planner = planner(self.state, predictor, self.prefetcher, lookahead,
                               self.max_loads, capacities, prompt_routers)
        self.path = ExpertsPath(self.state, layers, settings, self.prefetcher, self.planner)
        self.reset(future=None)
        self.prefetcher.start(owner=self)

    # ---- runs ----------------------------------------------------------------
    def reset(self, future: Future | None = None, cold: bool = True) -> None:
        """Start a measured run: fresh counters, empty caches (``cold``), predictor slots
        reset. ``future`` (the oracle) maps (forward call, layer) to the experts it needs."""
        with self.cv:
            self.prefetcher.settle()  # the last run's loads: not landing in this one
            if cold:
                self.state.forget_cached()
            self.state.run = RunState(RuntimeStats(self.num_layers, self.expert_bytes), future,
                                      self.num_layers)
            if self.settings.admission:  # measured afresh in every run
                self.state.run.admission = Admission.for_tier(
                    self.num_layers, max(self.capacities), self.predictor.horizon, self.tier.name)

    @property
    def run(self) -> RunState:
        """The current measured run (its counters, forward-call times, oracle log)."""
        return self.state.run

    @contextmanager
    def claimed_run(self, routing: RoutingSource | None = None) -> Iterator[None]:
        """The calling thread's measured run: the engine claimed for it (refused while
        another thread's call runs) with ``routing`` forced on its steps, let go after."""
        with self.cv:
            self.state.enter_run()
            self.state.forced_routing = routing
        try:
            yield
        finally:
            with self.cv:
                self.state.forced_routing = None
                self.state.leave_run()

    def refuse_nested(self) -> None:
        """A measured run inside the calling thread's own run or call is an error."""
        with self.cv:
            self.state.refuse_nested()

    def serves_caller(self) -> bool:
        """Whether the engine is the calling thread's now (its run or its call)."""
        return self.state.owner is threading.current_thread()

    def most_cached(self) -> int:
        """The most experts any layer's cache holds now."""
        with self.cv:
            return max(len(c.where) for c in self.caches)

    def counters(self) -> tuple[dict[str, float], int, int]:
        """The run so far, under the lock: decode's summary, bytes read, bytes wasted."""
        with self.cv:
            stats = self.state.run.stats
            return stats.phases["decode"].summary(), stats.bytes_moved, stats.bytes_wasted

    def finish(self) -> RuntimeStats:
        """End of a run: the last prefetches land (or fail: raised here), prefetched
        experts never used count as wasted; the final counters."""
        with self.cv:
            self.prefetcher.cancel()
            self.prefetcher.drain()
            self.prefetcher.raise_error()
            stats = self.state.run.stats
            unused = sum(c.unused_prefetches() for c in self.caches)
            stats.bytes_wasted += unused * self.expert_bytes
            for c in self.caches:  # count them once only
                for s in range(c.capacity):
                    c.prefetched[s] = False
            for phase in stats.phases.values():
                phase.sync()
            if self.state.run.admission is not None:
                stats.admission = self.state.run.admission.summary()
            return stats

    def close(self) -> None:
        """Stop the workers and the tier once another thread's forward is over (it fails
        at its next layer); the model cannot run its experts afterwards. The caches' memory
        (HBM on a gpu tier) goes now, not at Python's next cycle collection. A second close
        does nothing."""
        with self.state.close_lock:  # (a second close returns once the first is over)
            with self.cv:
                if not self.state.begin_close(CLOSE_WAIT_S):
                    return
            self.prefetcher.close()
            self.hooks.remove()
            if (ops := self.state.device_ops()) is not None:  # work still queued on its streams
                ops.drain()  # (an int4 slot's conversion) writes slots: done before they go
            self.tier.close()
            self.state.store.close()  # (its held data file: a temporary store's disk)
            let_go(self.path.modules, self.path.gathered, self)  # (_wire's layers)
            self.state.release()

    @property
    def tier(self) -> Tier:
        """The tier the loader reads through (tests swap in failing tiers)."""
        return self.state.loader.tier

    @tier.setter
    def tier(self, tier: Tier) -> None:
        self.state.loader.tier = tier
        self.state.use_tier_events()

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    # ---- the step API: the one home of the run's books ------------------------------
    def solo_step(self, batch: int, length: int, mask: np.ndarray | None) -> Step:
        """The step of a forward call transformers runs itself: its whole batch one part
        (a recorded routing forced by ``OffloadedModel.force_routing`` at the run's call)."""
        fwd = self.state.run.fwd + 1
        part = Part(tuple(range(batch)), fwd, self.state.forced_routing)
        return Step((part,), length, prefill=length > 1 or fwd == 0, mask=mask)

    def begin_step(self, step: Step) -> None:
        """``step`` starts on the calling thread: the engine claimed for it (another
        thread's step in progress: a clear busy error), the run's books opened, the
        planner told (a prompt starts its rows' predictor slots afresh)."""
        with self.cv:
            state = self.state
            state.enter_forward()
            run = state.run
            run.fwd += 1
            run.step, run.batch, run.step_open = step, (step.rows, step.length), True
            run.phase = "prefill" if step.prefill else "decode"
            run.prefill_routing, run.mask, run.slots = [], step.mask, step.slots
            if run.future is not None and step.parts[0].limit is not None:
                foresee(run.future, run.fwd, step, self.num_layers)  # a server's oracle
        self.planner.forward_started()

    def serve_layer(self, layer: int, parts: list[Part],
                    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    pool: Executor | None = None, partial: bool = False
                    ) -> tuple[torch.Tensor, list[slice], LayerTally]:
        """A step's MoE layer for ``parts`` (the step's still running, each with its
        (hidden, top-k ids, top-k weights)) in ONE path call: the union of their experts
        loaded once, each part's rows computed alone (on ``pool``'s threads side by side).
        The output, each part's rows in it, and what the layer met. ``partial``: a block
        that does not read fails only the parts routed to it (``LayerTally.failed``, their
        rows zeros: ``runtime.step_layer``); else it is raised."""
        calls = [(h, *p.routing.routing(p.call, layer, i, w)) if p.routing is not None
                 else (h, i, w) for p, (h, i, w) in zip(parts, calls, strict=True)]
        return serve_parts(self.path, self.state, layer, parts, calls, pool, partial)

    def end_step(self, step: Step) -> None:
        """``step``'s forward call completed: the books closed, the planner told (after a
        prompt it learns the prompt's routing and predicts the first decode token's)."""
        run = self.state.run
        if run.step is not step:
            raise OffloadError("end_step of a step the engine is not running")
        run.forward_ends.add(time.perf_counter())
        self.planner.forward_ended()
        run.step_open = False

    def leave_step(self) -> None:
        """The calling thread's step is over: the engine let go (a no-op for another thread,
        or in a measured run: it keeps it). A step short of ``end_step`` failed: its loads
        end with it, not failing the next step (``Prefetcher.settle``)."""
        with self.cv:
            try:
                if self.state.run.step_open and self.serves_caller():
                    self.state.run.step_open = False
                    self.prefetcher.settle()
            except StoreError:  # a load stuck past the limit: the step's own error already,
                pass  # and the next step needing its slot says so again
            finally:
                self.state.leave_forward()

    # ---- transformers' experts call (hf_glue routes every offloaded experts call here) ---
    def experts_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        *args: Any, **kwargs: Any) -> torch.Tensor:
        layer = self.path.layer_of[id(module)]
        driver = current_driver()
        if driver is not None:  # a driven forward: its driver serves the layer in its step
            return driver.experts_call(layer, hidden_states, top_k_index, top_k_weights)
        state = self.state
        if state.owner is threading.current_thread():
            return self._solo_layer(layer, hidden_states, top_k_index, top_k_weights,
                                    *args, **kwargs)
        with self.cv:  # a layer called on its own: claimed for the call
            state.enter_forward()
        try:
            return self._solo_layer(layer, hidden_states, top_k_index, top_k_weights,
                                    *args, **kwargs)
        finally:
            with self.cv:
                state.leave_forward()

    def _solo_layer(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A solo step's layer: the whole batch one part (its recorded routing, if any)."""
        step = self.state.run.step
        part = step.parts[0] if step is not None else None
        if part is not None and part.routing is not None:
            top_k_index, top_k_weights = part.routing.routing(part.call, layer, top_k_index,
                                                              top_k_weights)
        return self.path.run(layer, hidden_states, top_k_index, top_k_weights,
                             *args, **kwargs)[0]

    def check(self) -> None:
        """Invariants, for tests: every cache consistent and within its capacity."""
        with self.cv:
            for cache in self.caches:
                cache.check()


def _check_settings(settings: EngineSettings) -> None:
    policy_code(settings.policy, RUNTIME, OffloadError)
    if settings.workers < 0:
        raise OffloadError(f"workers must be >= 0, got {settings.workers}")


def _max_loads(max_loads: int | None, capacities: tuple[int, ...]) -> int:
    """Loads a prediction may start per layer (its most confident experts not yet cached)."""
    capacity = max(capacities)
    out = min(capacity, max_loads if max_loads is not None else capacity)
    if out < 0:
        raise OffloadError(f"max_loads must be >= 0, got {max_loads}")
    return out
