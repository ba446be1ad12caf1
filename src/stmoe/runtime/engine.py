"""The offload engine: transformers' experts call us; we bring the weights.

With the ``stmoe_offload`` experts implementation selected (``hf_glue``), every
experts module's forward comes here with the router's decision (hidden states,
top-k ids, top-k weights). The model keeps its own routing code; only where the
expert weights come from changes. The engine builds and wires its parts, one
concern each, and runs their life cycle (measured runs, shutdown):

- ``serve``: the per-layer path: the router's experts made sure of in the layer's
  cache (the wait is the *stall*), laid out (in place, or a copy), and computed by the model's own
  experts implementation, so every output bit is the resident model's;
- ``planning``: what the predictor is taught and asked, for which layer and when
  (the horizon, the prompt's routing, the early or late gate lookahead);
- ``prefetch``: the worker threads loading the predictions, most urgent first,
  dropping stale requests and handing their errors to the compute thread;
- ``hf_glue``: transformers' side: registration, the forward hooks and phase
  tracking, the experts released to ``meta``;
- ``state``: the lock, caches and run state they share.
"""

from __future__ import annotations

from typing import Any

import torch

from stmoe.cache_policy import RUNTIME, policy_code
from stmoe.errors import OffloadError
from stmoe.hf.layout import ModelLayout
from stmoe.predictors.base import Predictor
from stmoe.admission import Admission
from stmoe.runtime.cache import READY, LayerCache, param_specs
from stmoe.runtime.hf_glue import ForwardHooks, base_forward, resident_device, take_over
from stmoe.runtime.planning import PrefetchPlanner, gate_lookahead
from stmoe.runtime.prefetch import Prefetcher
from stmoe.runtime.serve import LayerServer
from stmoe.runtime.state import EngineSettings, EngineState, Future, RunState
from stmoe.runtime.stats import RuntimeStats
from stmoe.runtime.store import ExpertStore
from stmoe.runtime.store.loader import Loader
from stmoe.runtime.store.tiers import Tier


class OffloadEngine:
    """Serves one model's experts from ``store`` through ``tier`` into bounded caches."""

    def __init__(self, model: torch.nn.Module, store: ExpertStore, tier: Tier,
                 predictor: Predictor, settings: EngineSettings,
                 layout: ModelLayout | None = None) -> None:
        _check_settings(settings)
        self.layout = layout = layout or ModelLayout.of(model)
        store.check_model(model, layout)
        modules = layout.modules
        self.model, self.store, self.predictor = model, store, predictor
        self.settings, self.policy = settings, settings.policy
        self.num_layers = len(modules)
        self.num_experts = int(store.model["num_experts"])
        self.capacity = _checked_capacity(settings.capacity, self.num_experts)
        lookahead = gate_lookahead(layout, predictor)
        self.max_loads = _checked_max_loads(settings, predictor.shape.top_k)
        self.device = settings.device or resident_device(model)
        # each layer's experts module and its own implementation (refuses an offloaded model)
        layers = [(module, base_forward(module)) for _, module in modules]
        caches = [LayerCache(layer, self.capacity, param_specs(store.blocks[(layer, 0)]),
                             self.num_experts, self.policy, self.device)
                  for layer in range(self.num_layers)]
        for module, _ in layers:
            take_over(module, self, self.num_experts)
        self.state = EngineState(caches, store, Loader(tier, store), self.device)
        self.caches, self.cv, self.expert_bytes = caches, self.state.cv, self.state.expert_bytes
        self.prefetcher = Prefetcher(self.state, settings.workers)
        self.planner = PrefetchPlanner(self.state, predictor, self.prefetcher, lookahead,
                                       self.max_loads, self.capacity,
                                       layout.routers if predictor.prefetches else None)
        self.server = LayerServer(self.state, layers, settings, self.prefetcher, self.planner)
        self.reset(future=None)
        self.prefetcher.start()
        self.hooks = ForwardHooks(model, self.state, self.planner)

    # ---- runs ----------------------------------------------------------------
    def reset(self, future: Future | None = None, cold: bool = True) -> None:
        """Start a measured run: fresh counters, empty caches (``cold``), predictor slots
        reset. ``future`` (the oracle) maps (forward call, layer) to the experts it needs."""
        with self.cv:
            self.prefetcher.cancel()
            # loads of the previous run still in flight finish first: they must not
            # land in (or be counted by) the new run
            self.prefetcher.drain()
            if cold:
                for cache in self.caches:
                    for s in range(cache.capacity):
                        if cache.state[s] == READY:
                            cache.abandon(s)
                    cache.uses[:] = 0  # lfu's counts are the run's: none carried into it
            self.state.run = RunState(RuntimeStats(self.num_layers, self.expert_bytes), future,
                                      self.num_layers)
            if self.settings.admission:  # measured afresh in every run
                self.state.run.admission = Admission(self.num_layers, self.capacity,
                                                     self.predictor.horizon,
                                                     serial=self.tier.emulated)
            self.prefetcher.discard_error()

    @property
    def run(self) -> RunState:
        """The current measured run (its counters, forward-call times, oracle log)."""
        return self.state.run

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
        """Stop the workers and the tier; the model cannot run its experts afterwards."""
        with self.cv:
            self.state.closed = True
        self.prefetcher.close()
        self.hooks.remove()
        self.tier.close()

    @property
    def tier(self) -> Tier:
        """The tier the loader reads through (swapping it swaps the loader's: tests inject
        failing tiers so)."""
        return self.state.loader.tier

    @tier.setter
    def tier(self, tier: Tier) -> None:
        self.state.loader.tier = tier

    @property
    def closed(self) -> bool:
        return self.state.closed

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def _late(self) -> list[tuple[torch.nn.Module, torch.nn.Module]] | None:
        """Each MoE layer's (decoder layer, pre-MoE norm) when the late lookahead is in use."""
        return self.planner.late

    # ---- the experts forward (hf_glue routes every offloaded experts call here) -------
    def experts_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.server.serve(module, hidden_states, top_k_index, top_k_weights,
                                 *args, **kwargs)

    def check(self) -> None:
        """Invariants, for tests: every cache consistent and within its capacity."""
        with self.cv:
            for cache in self.caches:
                cache.check()


def _check_settings(settings: EngineSettings) -> None:
    policy_code(settings.policy, RUNTIME, OffloadError)
    if settings.workers < 0:
        raise OffloadError(f"workers must be >= 0, got {settings.workers}")


def _checked_capacity(capacity: int, num_experts: int) -> int:
    if not 1 <= capacity <= num_experts:
        raise OffloadError(f"capacity {capacity} experts per layer is outside 1..{num_experts}")
    return capacity


def _checked_max_loads(settings: EngineSettings, top_k: int) -> int:
    """Loads a prediction may start per layer (the most confident experts not yet cached)."""
    capacity, max_loads = settings.capacity, settings.max_loads
    out = min(capacity, max_loads if max_loads is not None else capacity)
    if out < 0:
        raise OffloadError(f"max_loads must be >= 0, got {max_loads}")
    if capacity < top_k:
        raise OffloadError(f"capacity {capacity} experts per layer is below top-{top_k}: "
                           "one token's experts would not fit; use at least "
                           f"{top_k}")
    return out
