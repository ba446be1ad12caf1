"""The GPU check's comparisons beside the decode table: accelerate's offload at the same HBM
budget (what a transformers user would pick), and ``stmoe calibrate`` on the GPU with the
simulator's prediction of every measured system.

Why these two: the first is the speed a user gets without stmoe on the same GPU budget;
the second says whether the simulator, calibrated on this machine, predicts the runtime
it models (issue 43's target: within 20% of every measured system).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from stmoe.runtime.gpu_check.decode import (
    SPLIT,
    SYSTEMS,
    decode_speed,
    device_context,
    pinned_store,
)
from stmoe.runtime.gpu_check.setup import setup

if TYPE_CHECKING:
    import torch

    from stmoe.runtime.gpu_check.record import Check

SHARE = 0.5  # the HBM budget both comparisons take: half the experts


def accelerate_offload(c: Check) -> dict[str, Any]:
    """accelerate's ``device_map``: everything on the GPU but the experts of the last MoE
    layers, which stay in host memory and are copied in at every forward call (accelerate's
    CPU offload), as many layers' as keeps the experts in HBM to SHARE of them."""
    torch = c.torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stmoe.hf.layout import experts_modules
    from stmoe.runtime.forced_routing import ForcedRouting

    s = setup(c)
    config = AutoConfig.from_pretrained(s.model_dir, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = [name for name, _ in experts_modules(skeleton)]
    on_device = math.floor(SHARE * len(names))
    # A dry run has no second device: its offloaded experts go to "disk", so that
    # accelerate's hooks (weights on "meta", loaded at each call) run as on the GPU
    main, offload = (0, "cpu") if c.cuda else ("cpu", "disk")
    device_map = split_map(skeleton, set(names[on_device:]), main, offload)
    model = AutoModelForCausalLM.from_pretrained(
        s.model_dir, device_map=device_map, offload_folder=c.work / "accelerate-offload").eval()
    # accelerate's offloaded modules hold their weights on "meta" between calls
    held_off = sum(all(p.device.type == "meta" for p in m.parameters())
                   for _, m in experts_modules(model))
    try:
        forced = ForcedRouting(model, s.plan)
        steps = min(s.steps, 16 if not c.dry else s.steps)  # each token copies GBs: fewer
        decode_speed(c, model, dataclasses.replace(s, steps=2), forced.reset)  # (warm-up)
        tokens, rate = decode_speed(c, model, dataclasses.replace(s, steps=steps),
                                    forced.reset)
    finally:
        del model
        if c.cuda:
            torch.cuda.empty_cache()
    # the decode table's resident tokens (this run's, or a rerun's kept record of them)
    want = c.shared.get("want") or c.doc["stages"].get("decode_table", {}).get(
        "resident", {}).get("tokens")
    return {"device_map": {k: str(v) for k, v in device_map.items()},
            "experts_layers_in_hbm": on_device, "of_layers": len(names),
            "offloaded_to": offload, "experts_modules_offloaded": held_off,
            "decode_tok_s": round(rate, 3), "tokens": steps,
            "identical_prefix": want is not None and tokens == want[:steps]}


def split_map(model: torch.nn.Module, offloaded: set[str], main: int | str,
              offload: str = "cpu") -> dict[str, int | str]:
    """A complete ``device_map``: the modules named in ``offloaded`` on ``offload`` ("cpu"
    or "disk"), everything else on ``main``, each module whole unless an offloaded one lies
    inside it."""
    out: dict[str, int | str] = {}

    def assign(module: torch.nn.Module, name: str) -> None:
        if name in offloaded:
            out[name] = offload
        elif not any(o.startswith(f"{name}.") or not name for o in offloaded):
            out[name] = main
        else:
            for leaf, _ in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)]:
                out[f"{name}.{leaf}" if name else leaf] = main
            for child, sub in module.named_children():
                assign(sub, f"{name}.{child}" if name else child)

    assign(model, "")
    return out


def calibrate_simulator(c: Check) -> dict[str, Any]:
    """``stmoe calibrate`` of the gpu tier on the decode table's checkpoint (the replayed
    routing's misses timed), then the host pipeline's simulation of each system at SHARE of
    the experts in HBM, beside the measured runs."""
    from stmoe.predictors import load_tables
    from stmoe.runtime.calibrate import calibrate
    from stmoe.runtime.options import CalibrateOptions
    from stmoe.sim.host.calibrated import hardware_toml
    from stmoe.sim.host.systems import HostOptions, simulate_runtime
    from stmoe.sim.specs import hardware_preset, model_preset
    from stmoe.trace import load_trace

    s = setup(c)
    capacity = f"{SHARE:.0%}"
    options = CalibrateOptions(tier="gpu", capacity=capacity, routing=s.routing,
                               seconds=0.3 if c.dry else 2.0, tokens=2 if c.dry else 8,
                               tables=s.tables)  # the predictors' own time timed with them
    threads = c.torch.get_num_threads()
    held: dict[str, Any] = {}
    try:
        with device_context(c), pinned_store(s, held):  # pinned once for calibrate's runs
            figures = calibrate(s.model_dir, s.store, options)
    finally:  # calibrate sets its own (one); the stages after run with the check's
        c.torch.set_num_threads(threads)
    # beside the JSON, so it comes back with it: benchmarks/gpu_forecast.py --hardware
    preset = c.out.with_name(f"{c.out.stem}.calibrated-gpu.toml")
    preset.parent.mkdir(parents=True, exist_ok=True)
    preset.write_text(hardware_toml(figures))
    model = dataclasses.replace(model_preset(s.like), layers=s.layers)
    sim = simulate_runtime(load_trace(s.routing), model, hardware_preset(str(preset)),
                           list(SYSTEMS),
                           HostOptions(capacity=round(SHARE * model.num_experts),
                                       decode_tokens=s.steps - 1,
                                       tables=load_tables(s.tables)))
    simulated_speed = {name: float(r["decode_tokens_per_s"])
                       for name, r in sim["systems"].items()}
    if s.split is not None:
        split = simulate_runtime(load_trace(s.routing), model, hardware_preset(str(preset)),
                                 ["stmoe-plus"], HostOptions(capacity=s.split,
                                                             decode_tokens=s.steps - 1,
                                                             tables=load_tables(s.tables)))
        simulated_speed[SPLIT] = float(split["systems"]["stmoe-plus"]["decode_tokens_per_s"])
    measured = {r["system"]: r for r in c.doc["stages"].get("decode_table", {}).get("runs", [])
                if r.get("tier") == "gpu" and r.get("capacity") == capacity
                and "decode_tok_s" in r}
    rows = []
    for system, simulated in simulated_speed.items():  # SYSTEMS' order, then SPLIT's
        got = measured.get(system, {}).get("decode_tok_s")
        rows.append({"system": system, "simulated_tok_s": round(simulated, 3),
                     "measured_tok_s": got,
                     "measured_over_simulated": round(got / simulated, 3)
                     if got and simulated > 0 else None})
    keep = ("bytes_per_s", "parallel_bytes_per_s", "latency_s", "token_s", "layers_s",
            "experts_s", "token_s_clocked", "workers", "predictors")
    return {**held, "preset": {k: figures[k] for k in keep}, "preset_file": preset.name,
            "capacity": capacity, "systems": rows}
