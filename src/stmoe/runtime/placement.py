"""Where an offloaded model runs and how many experts its caches hold: ``capacity`` or
``memory`` turned into experts per layer, and on a gpu tier the model moved to the device.

Why one place: on the CPU tiers ``--memory`` sizes the cache from the process as loaded
(``memory.plan_memory``); on the gpu tiers the slots are in the GPU's memory, so they are
sized from its free memory less the resident weights and the KV cache
(``memory.plan_device_memory``, before anything moves there), while the host must still
hold what the tier keeps in it (the pinned store, or the bounce buffers). Either plan is
printed the same way (``MemoryPlan.describe``: the ``memory`` line of ``stmoe generate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stmoe.hf.layout import experts_modules
from stmoe.predictors.base import ModelShape
from stmoe.quant.linears import device_linears
from stmoe.runtime.accelerator import GPU_TIERS, Accelerator, accelerator
from stmoe.runtime.memory import (
    MemoryPlan,
    model_kv_bytes,
    plan_device_memory,
    plan_gpu_memory,
    plan_memory,
    process_bytes,
)
from stmoe.runtime.options import OffloadOptions, resolve_capacities
from stmoe.runtime.store import ExpertStore
from stmoe.runtime.store.bounce import bounce_buffers, bounce_bytes
from stmoe.runtime.store.pinned import host_bytes
from stmoe.runtime.store.tiers import buffer_bytes


@dataclass(frozen=True)
class Placement:
    """Experts per layer, the ``--memory`` plan that chose them (None: ``capacity`` did),
    and a gpu tier's device (None: the CPU tiers, the caches beside the model)."""

    capacities: tuple[int, ...]  # each MoE layer's experts
    plan: MemoryPlan | None
    accel: Accelerator | None

    @property
    def device(self) -> torch.device | None:
        return self.accel.device if self.accel is not None else None


def place(model: torch.nn.Module, store: ExpertStore, options: OffloadOptions,
          shape: ModelShape) -> Placement:
    """The cache's size for ``model`` (its non-expert weights loaded, quantized, and its
    predictor made: all measured) and, on a gpu tier, the model moved to the device."""
    nbytes = store.blocks[(0, 0)].nbytes
    memory = options.memory_bytes()
    accel = accelerator(options.tier) if options.tier in GPU_TIERS else None
    plan = None
    if memory is not None:  # the process as loaded, then the largest cache that fits
        process = process_bytes(model)
        plan = (plan_memory(memory, process, shape.num_layers, shape.num_experts, shape.top_k,
                            nbytes, options.worker_count(), buffer_bytes(store.blocks[(0, 0)]))
                if accel is None else gpu_plan(model, store, options, shape, memory, process,
                                               accel.free_bytes()))
    capacities = (plan.per_layer,) * shape.num_layers if plan else resolve_capacities(
        options.capacity, shape.num_layers, shape.num_experts, shape.top_k, nbytes)
    if accel is not None:
        move_resident(model, accel.device)
        device_linears(model)  # quantized resident linears in the device's layout, once
    return Placement(capacities, plan, accel)


def gpu_plan(model: torch.nn.Module, store: ExpertStore, options: OffloadOptions,
             shape: ModelShape, memory: int, process: int, free: int) -> MemoryPlan:
    """``--memory`` on a gpu tier: the slots from the GPU's ``free`` bytes (taken before the
    model moves there) less the resident weights and a KV cache of ``memory.KV_TOKENS``
    tokens; the host checked for the process, the read buffers and the tier's share."""
    experts = per_expert_params(model)  # not moved
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                   if not t.is_meta and id(t) not in experts)
    dtype = getattr(model, "dtype", torch.float32)
    kv = model_kv_bytes(model.config, dtype.itemsize)
    device = plan_device_memory(free, resident, kv, shape.num_layers, shape.num_experts,
                                shape.top_k, store.blocks[(0, 0)].nbytes)
    reads = (options.worker_count() + 1) * buffer_bytes(store.blocks[(0, 0)])
    if options.tier == "gpu":
        host, what = host_bytes(store), "of the store pinned in host memory"
    else:
        host = bounce_buffers(options.worker_count()) * bounce_bytes(store)
        what = "of pinned bounce buffers"
    return plan_gpu_memory(memory, process, reads, host, what, device)


def move_resident(model: torch.nn.Module, device: torch.device) -> None:
    """Every non-meta parameter and buffer of ``model`` onto ``device``, except the routed
    experts' (they stay in the store: a model loaded whole keeps them on the host until
    the engine releases them, never a copy in HBM), each parameter keeping its
    ``requires_grad`` (on the CPU a model whose weights do not require grad computes a
    prompt's logits with other last bits, seen on the tiny Qwen3-MoE; the reference is the
    model as it was loaded) and tied weights staying one tensor (embeddings, lm_head)."""
    experts = per_expert_params(model)
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and not p.is_meta and id(p) not in experts:
                if id(p) not in moved:
                    moved[id(p)] = torch.nn.Parameter(p.data.to(device),
                                                      requires_grad=p.requires_grad)
                module._parameters[name] = moved[id(p)]
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta:
                module._buffers[name] = b.to(device)


def per_expert_params(model: torch.nn.Module) -> set[int]:
    """The ids of the routed experts' per-expert parameters (``[num_experts, ...]``: what
    the store holds); an experts module's other parameters are resident."""
    out = set()
    for _, m in experts_modules(model):
        n = int(getattr(m, "num_experts", 0))
        out |= {id(p) for p in m.parameters() if p.dim() and p.shape[0] == n}
    return out
