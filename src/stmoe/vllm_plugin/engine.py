"""stmoe's offload engine serving vLLM's routed-experts layers.

Why a subclass and not a copy: ``OffloadEngine._wire`` builds the caches, the prefetch
workers, the planner and the experts path for any runtime's MoE layers; this module
gives it vLLM's layers as the path expects them (``KernelExperts``: a layer whose
implementation is vLLM's own CPU kernel, ``kernel_forward``) and releases the layers'
expert weights once the store holds them. vLLM's forward calls become the engine's steps
in ``vllm_plugin.steps``; each layer's ``forward_modular`` is sent to ``ExpertsPath.run``
there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.hf.routers import Router
from stmoe.predictors.base import Predictor, PredictorError
from stmoe.quant.formats import WeightFormat
from stmoe.runtime.engine import OffloadEngine
from stmoe.runtime.planning import GateLookahead
from stmoe.runtime.slot_layout import SlotLayout
from stmoe.runtime.state import EngineSettings
from stmoe.runtime.store import ExpertStore
from stmoe.runtime.store.tiers import Tier
from stmoe.vllm_plugin.batches import BatchPlanner
from stmoe.vllm_plugin.layers import WEIGHTS, MoeLayer
from stmoe.vllm_plugin.own_format import OwnExperts, own_forward

# the implementation name the experts path knows vLLM's CPU kernel by (runtime.hf_glue:
# each token's result the same bits under any numbering, whatever the call's other tokens)
IMPL = "vllm_cpu_fused_moe"


class KernelExperts:
    """One vLLM routed-experts layer as the experts path sees a module: its implementation
    named in ``config``, its per-expert scales (a quantized kernel's: ``MoeLayer.scales``),
    the names its (w13, w2) slots go by (the store's: ``gate_up_proj``, ``down_proj`` read
    in place), everything else read from the layer (its activation, its kernel)."""

    def __init__(self, layer: MoeLayer, names: tuple[str, str]) -> None:
        self.__dict__.update(layer=layer.module, stmoe_scales=layer.scales, stmoe_names=names,
                             config=SimpleNamespace(_experts_implementation=IMPL))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["layer"], name)


def kernel_forward(experts: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, shared_experts: Any = None,
                   shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's own MoE kernel on the weights the path bound (the cache's slots, or the
    whole tensors), ids numbered in them: what ``UnquantizedFusedMoEMethod`` calls, with
    the slots in place of the layer's tensors. A quantized kernel reads its scales from its
    quant_config, not its arguments: they are pointed at the bound ones (the weights' rows)."""
    kernel = experts.quant_method.moe_kernel
    for param, desc, field in experts.stmoe_scales:
        setattr(getattr(kernel.fused_experts.quant_config, desc), field, getattr(experts, param))
    return kernel.apply(
        hidden_states=hidden_states, w1=getattr(experts, experts.stmoe_names[0]),
        w2=getattr(experts, experts.stmoe_names[1]),
        topk_weights=top_k_weights, topk_ids=top_k_index, activation=experts.activation,
        apply_router_weight_on_input=experts.apply_router_weight_on_input,
        global_num_experts=experts.num_experts, expert_map=None,
        shared_experts=shared_experts, shared_experts_input=shared_experts_input)


class _NoHooks:
    """vLLM's forward hooks are the plugin's (``steps``), removed with it."""

    def remove(self) -> None:
        pass


class VllmEngine(OffloadEngine):
    """The engine for a vLLM model's MoE layers (``layers``), on the CPU: computed by vLLM's
    kernel, or by stmoe's in ``weights`` (``own_format``: stmoe's int4 or int8 store)."""

    def __init__(self, model: torch.nn.Module, layers: list[MoeLayer], store: ExpertStore,
                 tier: Tier, predictor: Predictor, settings: EngineSettings,
                 layouts: dict[str, SlotLayout] | None = None,
                 names: tuple[str, str] = WEIGHTS, weights: WeightFormat | None = None) -> None:
        routers = [m.router for m in layers]
        found = None if any(r is None for r in routers) else routers
        lookahead = _lookahead(predictor, found)  # type: ignore[arg-type]
        calls: list[tuple[Any, Callable[..., torch.Tensor]]] = (
            [(OwnExperts(m, weights), own_forward) for m in layers] if weights is not None
            else [(KernelExperts(m, names), kernel_forward) for m in layers])
        self._wire(model, calls, store, tier, predictor,  # type: ignore[arg-type]
                   settings, torch.device("cpu"), lookahead,
                   found if predictor.prefetches else None,  # type: ignore[arg-type]
                   planner=BatchPlanner, layouts=layouts, worker_cpus=worker_cpus())
        self.hooks = _NoHooks()
        self.layers = layers
        for m in layers:
            release(m)

    @property
    def batches(self) -> BatchPlanner:
        """The planner, which knows vLLM's batches (each request's rows)."""
        assert isinstance(self.planner, BatchPlanner)
        return self.planner

    def use_predictor(self, predictor: Predictor) -> None:
        """(between steps) Predict with ``predictor`` from now on: new tables, the same
        layers; every request's history starts afresh."""
        routers = [m.router for m in self.layers]
        _lookahead(predictor, None if any(r is None for r in routers) else routers)  # type: ignore[arg-type]
        if predictor.prefetches != self.predictor.prefetches:
            raise OffloadError("a reloaded predictor must prefetch as the one it replaces")
        self.predictor = self.planner.predictor = predictor


def worker_cpus() -> set[int] | None:
    """Where the prefetch workers run: the CPUs other than the ones vLLM binds its worker's
    compute to. vLLM's CPU worker pins itself (its OpenMP threads, and the thread that loads
    the model: the one starting the workers) to its cores and leaves the others to its
    engine (``VLLM_CPU_OMP_THREADS_BIND``; here core 0, and core 1 reserved); threads
    inherit that pinning, so without this the workers' reads and checks would take turns
    with vLLM's compute on its core. None where vLLM leaves no other CPU."""
    compute = os.sched_getaffinity(0)
    every = set(range(os.cpu_count() or 1))
    others = every - compute
    return others or None


def _lookahead(predictor: Predictor, routers: list[Router] | None) -> GateLookahead | None:
    """The early gate lookahead, for predictors that take one (vLLM's decoder layers give
    no pre-MoE norm to hook, so never the late one)."""
    if not (predictor.uses_lookahead and predictor.horizon == 1):
        return None
    if routers is None:
        raise OffloadError(f"predictor {predictor.name!r} needs each MoE layer's router, and "
                           "this vLLM model's could not be found (a 'gate' beside its experts)")
    try:
        point = predictor.resolve_lookahead_point(False)
    except PredictorError as exc:
        raise OffloadError(str(exc)) from None
    predictor.use_lookahead_point(point)
    return GateLookahead(routers, None)


def release(layer: MoeLayer) -> None:
    """The layer's expert weights (and scales) released to storage-free meta tensors: the
    cache's slots and the store hold them from now on (the kernel's quant_config too)."""
    module = layer.module
    for name in layer.params:
        p = getattr(module, name)
        module._parameters[name] = torch.nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
    config = module.quant_method.moe_kernel.fused_experts.quant_config
    for param, desc, field in layer.scales:
        setattr(getattr(config, desc), field, getattr(module, param))
