"""The compute per decode token, and the tier as the runtime's own reads of a trace met it:
both measured by running ``stmoe.offload`` itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stmoe.errors import OffloadError
from stmoe.runtime.api import GenerationResult, OffloadedModel
from stmoe.runtime.forced_routing import RoutingPlan
from stmoe.runtime.options import CalibrateOptions


def measure_compute(model_dir: Path, store_path: Path | None, o: CalibrateOptions,
                    top_k: int) -> dict[str, float]:
    """Per decode token: total, inside the MoE decoder layers, and in the experts calls
    (every expert a hit: the runtime's compute and per-layer work, no I/O). With
    ``o.routing``, the trace's own routing with every expert cached and warm (its
    experts change from token to token as the workload's do, which costs more than
    fixed experts), else the same top-K experts at every token in a cache of K.

    The total is a run's with no clocks in it; the split comes from a second run with a
    clock at each decoder layer's start and end and around each experts call, scaled to
    that total. Why: on a GPU each clock synchronises the device (its kernels' time, not
    their launch's), and four device waits a layer stop the host queueing ahead as the
    runtime does, so the clocked run is slower than the runtime's own (``token_s_clocked``
    says by how much) and would make the simulator predict it slower too."""
    from stmoe.runtime.api import offload

    torch.set_num_threads(o.threads)
    link = {"bandwidth": o.bandwidth, "latency": o.latency} if o.tier == "emulated" else {}
    capacity = "100%" if o.routing is not None else top_k
    with offload(model_dir, store_path, capacity=capacity, predictor="ondemand", policy="lru",
                 tier=o.tier, workers=0, **link) as om:
        n_layers = om.config["num_layers"]
        plan, steps = decode_plan(o, om, top_k)
        if o.routing is not None:
            om.force_routing(plan, max_new_tokens=steps)  # every routed expert into the cache
        plain = _hits(om.force_routing(plan, max_new_tokens=steps, cold=o.routing is None))
        expert_s: list[float] = []
        layer_s: list[float] = []
        path = om.engine.path
        now = _clock(om.engine.device)
        base = path.base
        path.base = [_timed(f, expert_s, now) for f in base]
        hooks = []
        for name, _ in om.engine.layout.modules:
            layer = om.model.get_submodule(_decoder_layer(name))
            hooks.append(layer.register_forward_pre_hook(lambda *a: layer_s.append(-now())))
            hooks.append(layer.register_forward_hook(lambda *a: layer_s.append(now())))
        try:
            clocked = _hits(om.force_routing(plan, max_new_tokens=steps,
                                             cold=o.routing is None))
        finally:
            for h in hooks:
                h.remove()
            path.base = base
    tokens = clocked.decode_tokens
    per_call = np.add(layer_s[0::2], layer_s[1::2])  # end - start of each decoder layer
    decode_layers = per_call[n_layers:]  # after the prompt's forward
    token_s, clocked_s = plain.decode_s / plain.decode_tokens, clocked.decode_s / tokens
    scale = token_s / clocked_s if clocked_s > 0 else 1.0  # the clocks' own cost taken out
    return {
        "token_s": token_s,
        "layers_s": scale * float(decode_layers.sum()) / tokens,
        "experts_s": scale * float(sum(expert_s[n_layers:])) / tokens,
        "token_s_clocked": clocked_s,
        "tokens": tokens,
        "num_layers": n_layers,
    }


def decode_plan(o: CalibrateOptions, om: OffloadedModel, top_k: int) -> tuple[RoutingPlan, int]:
    """The routing calibrate's compute runs replay and their decode tokens: ``o.routing``'s
    first sequence, else the same top-K experts at every token (after the prompt's forward,
    ``o.tokens`` decode tokens)."""
    n_layers = int(om.config["num_layers"])
    if o.routing is not None:
        plan = routed_plan(o.routing, om, n_layers, top_k)
        return plan, min(o.tokens, plan.new_tokens)
    steps = o.tokens + 1  # the prompt's forward, then the timed decode tokens
    experts = np.broadcast_to(np.arange(top_k), (steps + 1, n_layers, top_k)).copy()
    return RoutingPlan(experts, np.full(experts.shape, 1.0 / top_k, dtype=np.float32),
                       2, [1, 2]), steps


def _hits(result: GenerationResult) -> GenerationResult:
    """``result``, checked: decode tokens, every expert a hit."""
    if result.decode_tokens < 1 or result.hit_rate < 1.0:
        raise OffloadError(f"calibrate's compute run decoded {result.decode_tokens} tokens at "
                           f"hit rate {result.hit_rate:.2f}; expected every expert a hit")
    return result


def measure_runtime_reads(model_dir: Path, store_path: Path, o: CalibrateOptions,
                          capacity: int) -> dict[str, float]:
    """The tier as the runtime meets it: ``stmoe.offload`` replays ``o.routing`` with an
    LRU cache of ``capacity`` and no prefetch, and the compute thread's reads of its
    decode misses (timed by the runtime, nothing else reading) give the mean time of one
    read. Calibrate's own back-to-back loop can read at another speed than the runtime's
    reads meet in the same minutes (it did on the development VM: docs/journal/), so the
    preset's single-reader speed is taken from here where a trace is given.

    On a gpu tier the runtime's host clock sees a read's host part only (the disk's read
    into a bounce buffer, ``gpu-disk``; nothing, ``gpu``: the pinned store), not its copy,
    which lands later and is timed by the device's events (``runtime.device_timing``). A
    read is done when its copy has landed, and one read's host part overlaps the copy of
    the read before it, so the slower of the two means is the read's."""
    from stmoe.runtime.api import offload

    assert o.routing is not None
    torch.set_num_threads(o.threads)
    link = {"bandwidth": o.bandwidth, "latency": o.latency} if o.tier == "emulated" else {}
    with offload(model_dir, store_path, capacity=capacity, predictor="ondemand", policy="lru",
                 tier=o.tier, workers=0, **link) as om:
        plan = routed_plan(o.routing, om, om.config["num_layers"], om.config["top_k"])
        result = om.force_routing(plan)
    decode = result.stats["phases"]["decode"]
    reads = int(decode["demand_reads"])
    if reads < 8:
        raise OffloadError(f"--routing {o.routing}: its decode tokens miss only {reads} experts "
                           f"at a cache of {capacity} per layer, too few reads to time the tier "
                           "(a longer trace, or a smaller --capacity)")
    host_s = decode["demand_read_s"] / reads
    device = decode.get("device") or {}
    copy_s = (device["copy_busy_s"] / device["copies"]) if device.get("copies") else 0.0
    return {"reads": reads, "mean_s": max(host_s, copy_s), "host_mean_s": host_s,
            "copy_mean_s": copy_s, "tokens": result.decode_tokens}


def routed_plan(routing: Path, om: OffloadedModel, n_layers: int, top_k: int) -> RoutingPlan:
    """The trace's first sequence as a replay plan for ``om``'s model."""
    from stmoe.runtime.forced_routing import plan_routing
    from stmoe.trace import load_trace

    n = int(om.engine.num_experts)
    return plan_routing(load_trace(routing), 0, n_layers, n, top_k, om.model.config.vocab_size)


def _clock(device: torch.device) -> Callable[[], float]:
    """The time now, on a CUDA device once its queued work is done (the kernels' time, not
    their launch's: the compute run has nothing else in flight)."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _timed(fn: Any, into: list[float], now: Callable[[], float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = now()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(now() - start)

    return timed


def _decoder_layer(experts_name: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.3``: the decoder layer around it."""
    parts = experts_name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    raise OffloadError(f"cannot tell the decoder layer of experts module {experts_name!r}")
