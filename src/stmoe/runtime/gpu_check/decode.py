"""The GPU check's decode table: the GPU-resident model and every compared system at 25%
and 50% of the experts in HBM, from pinned host memory (``--tier gpu``) and from disk
(``--tier gpu-disk``), replaying held-out recorded routing (``setup``).

Per run: decode tokens/s, hit rate, the bytes copied over PCIe, the stall share (the compute
thread's waits plus the compute stream's, timed by the device: ``runtime.device_timing``),
the copy bandwidth achieved, and whether its tokens are the GPU-resident model's. A dry run
does the same on the CPU's stand-in for a GPU (``runtime.accelerator.stand_in``), tiny.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from stmoe.runtime.gpu_check.setup import Setup, setup

if TYPE_CHECKING:
    import torch

    from stmoe.runtime.gpu_check.record import Check

# stmoe-plus-score (score eviction) last: short of time, the systems run first
SYSTEMS = ("on-demand", "lru-only", "stmoe", "stmoe-plus", "oracle", "stmoe-plus-score")
CAPACITIES = ("25%", "50%")
# stmoe-plus with each layer's cache its own size, the same total (``Setup.split``): a third
# try at the gap target, run where the targets are read (from pinned memory, 50%)
SPLIT, SPLIT_AT = "stmoe-plus-split", ("gpu", "50%")
TIERS = ("gpu", "gpu-disk")
# the budget's seconds the gpu-disk runs leave to the stages after the table (accelerate,
# calibrate, the cuda-marked tests, the shipped model: about 2 minutes on a fast machine): on
# a slow disk those runs, last in the table, are what gives way
DISK_KEEPS_S = 150.0


def device_context(c: Check) -> AbstractContextManager[Any]:
    """Where the gpu tiers run: CUDA, or in a dry run the CPU's stand-in."""
    from stmoe.runtime.accelerator import stand_in

    return nullcontext() if c.cuda else stand_in()


def decode_table(c: Check) -> dict[str, Any]:
    s = setup(c)
    rec: dict[str, Any] = {"model": f"{s.like}, {s.layers} MoE layers, RANDOM weights",
                           "routing": s.source, "new_tokens": s.steps,
                           "split": {"system": SPLIT, "at": list(SPLIT_AT),
                                     "sized_from": "the profiled tokens alone (their tail "
                                     "replayed with tables of their start)",
                                     "sized": s.split_sized,
                                     **({"capacities": list(s.split)} if s.split is not None
                                        else {"error": s.split_error})}}
    resident = resident_run(c, s)
    rec["resident"] = resident
    c.shared["want"] = resident["tokens"]
    runs: list[dict[str, Any]] = []
    rec["runs"] = runs
    c.doc["stages"]["decode_table"] = {"status": "running", **rec}  # written as runs end
    with device_context(c), pinned_store(s, rec):
        for tier in TIERS:
            for capacity in CAPACITIES:
                split = (tier, capacity) == SPLIT_AT and s.split is not None
                for system in (*SYSTEMS, SPLIT) if split else SYSTEMS:
                    keep = DISK_KEEPS_S if tier == "gpu-disk" else 0.0
                    if c.out_of_time(keep):
                        why = f" less the {keep:.0f} s kept for the stages after" if keep else ""
                        runs.append({"system": system, "capacity": capacity, "tier": tier,
                                     "skipped": f"over the time budget{why}"})
                        continue
                    try:
                        runs.append(offloaded_run(c, s, system, capacity, tier))
                    except Exception as exc:  # that run's, recorded; the next runs
                        runs.append({"system": system, "capacity": capacity, "tier": tier,
                                     "identical": None,
                                     "error": f"{type(exc).__name__}: {exc}"})
                    c.write()  # after each run: a run cut short keeps what it measured
    return rec


def offloaded_run(c: Check, s: Setup, system: str, capacity: str, tier: str) -> dict[str, Any]:
    """One system replaying the routing through ``tier`` at ``capacity``: its figures."""
    from stmoe.evaluate.systems import OFFLOAD_SYSTEMS, compared_predictor
    from stmoe.predictors import REGISTRY, load_tables
    from stmoe.runtime.api import offload
    from stmoe.runtime.warm_up import warm_up

    predictor, policy = OFFLOAD_SYSTEMS["stmoe-plus" if system == SPLIT else system]
    pred = predictor if predictor == "ondemand" else compared_predictor(
        predictor, load_tables(s.tables))
    tables = s.tables if isinstance(pred, str) and REGISTRY[pred].needs_tables else None
    cache = s.split if system == SPLIT else capacity  # (its counts add up to ``capacity``)
    started = time.perf_counter()
    with offload(s.model_dir, s.store, capacity=cache, predictor=pred, tables=tables,
                 policy=policy, tier=tier) as om:
        offload_s = time.perf_counter() - started
        warm_s = warm_up(om)  # numba's kernels compiled before the timed decode, not in it
        r = om.force_routing(s.plan, max_new_tokens=s.steps)
    decode = r.stats["phases"]["decode"]
    dev = decode.get("device") or {}
    device_stall = float(dev.get("device_stall_s", 0.0))
    return {"system": system, "capacity": capacity, "tier": tier,
            "identical": r.tokens == c.shared.get("want"),
            "decode_tok_s": round(r.decode_tokens_per_s, 3), "hit_rate": round(r.hit_rate, 4),
            "prefetch_recall": round(r.prefetch_recall, 4),
            "pcie_bytes_decode": int(dev.get("copy_bytes", 0)), "bytes_moved": r.bytes_moved,
            "stall_share": round((r.stall_s + device_stall) / r.decode_s, 4)
            if r.decode_s > 0 else None,
            "host_stall_s": round(r.stall_s, 4), "device_stall_s": round(device_stall, 4),
            "copy_GBps": round(float(dev.get("copy_GBps", 0.0)), 3),
            "copy_busy_s": round(float(dev.get("copy_busy_s", 0.0)), 4),
            "decode_s": round(r.decode_s, 4), "offload_s": round(offload_s, 2),
            "warm_up_s": round(warm_s, 2), "direct_io": om.config.get("direct_io"),
            # the caches it ran with: one count, or each layer's (stmoe-plus-split's)
            "cache_bytes": om.config["cache_bytes"], "experts_cached": om.config["capacity"]}


def resident_run(c: Check, s: Setup) -> dict[str, Any]:
    """Plain transformers with every weight on the device, the same routing forced: its
    greedy tokens (what every offloaded run must give) and decode tokens/s."""
    torch = c.torch
    from transformers import AutoModelForCausalLM

    from stmoe.runtime.forced_routing import ForcedRouting

    model = AutoModelForCausalLM.from_pretrained(s.model_dir).to(c.device).eval()
    try:
        forced = ForcedRouting(model, s.plan)
        tokens, _ = decode_speed(c, model, s, forced.reset)  # (warms the kernels up)
        again, rate = decode_speed(c, model, s, forced.reset)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
    finally:
        del model
        if c.cuda:
            torch.cuda.empty_cache()
    return {"tokens": tokens, "decode_tok_s": round(rate, 3), "weights_bytes": weights,
            "repeats_its_tokens": again == tokens}


def decode_speed(c: Check, model: torch.nn.Module, s: Setup,
                 reset: Any) -> tuple[list[int], float]:
    """One greedy replay of ``s``'s routing on ``model``: its new tokens and its decode
    tokens/s (forward calls' ends, the device synchronised at each)."""
    torch = c.torch
    from stmoe.runtime.prompts import greedy_generate

    ends: list[float] = []

    def done(*_: Any) -> None:
        if c.cuda:
            torch.cuda.synchronize()
        ends.append(time.perf_counter())

    hook = model.register_forward_hook(done)
    try:
        reset()
        ids = torch.tensor([s.plan.token_ids], device=c.device)
        out = greedy_generate(model, ids, s.steps, ignore_eos=True)
    finally:
        hook.remove()
    rate = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else 0.0
    return out[0, ids.shape[1]:].tolist(), rate


def pinned_store(s: Setup, rec: dict[str, Any]) -> AbstractContextManager[Any]:
    """The store pinned once for every ``--tier gpu`` run of a stage (``offload`` calls
    share a pinned store while one holds it: without this hold each would pin it again;
    the decode table's runs, calibrate's three). A refusal is recorded in ``rec`` and the
    stage goes on: each run then pins (or fails) on its own; the gpu-disk runs pin nothing."""
    from contextlib import contextmanager

    from stmoe.runtime.accelerator import accelerator
    from stmoe.runtime.store import ExpertStore
    from stmoe.runtime.store.pinned import PinnedStore

    @contextmanager
    def held() -> Any:
        try:
            pinned = PinnedStore.acquire(ExpertStore(s.store), accelerator("gpu").pinning)
        except Exception as exc:  # each gpu run then pins (or fails) on its own, recorded
            rec["pinned_store_error"] = f"{type(exc).__name__}: {exc}"
            yield None
            return
        rec["pinned_store_locked"] = pinned.how  # registered in place, or allocated locked
        try:
            yield pinned
        finally:
            pinned.release()

    return held()
