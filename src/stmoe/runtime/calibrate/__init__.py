"""``stmoe calibrate``: measure this machine as the offloading runtime uses it (its options,
``CalibrateOptions``, live with the runtime's in ``runtime.options``).

    reads.py    the tier: reads into slot memory, page faults, latency
    compute.py  the compute per decode token, and the runtime's own reads of a trace

The simulator's host pipeline (``stmoe.sim.host``, ``stmoe simulate --pipeline
runtime``) needs a hardware preset of *this* machine: how fast the tier brings
an expert block into a cache slot, alone and with the prefetch workers reading
too, and how long one decode token computes at the model's sizes. Every figure
here is measured with the runtime's own code paths:

* reads: expert blocks of the packed store through the tier, in a random order,
  or with ``routing`` the blocks the runtime reads for a recorded trace (the
  misses of an LRU cache of the capacity over its decode tokens, token by token
  and layer by layer: a disk's, and a virtual disk's host's, caching and locality
  are then the workload's, which can differ severalfold from a random order's;
  figures in docs/journal/), ``DiskTier.read_into`` straight into page-aligned slot
  memory plus its CRC-32C check, or the emulated link's fetch and the copy into
  the slot, by 1 thread
  (the compute thread's misses) and by ``workers + 1`` threads at once (the
  workers and the compute thread together); latency from one-page reads. Every
  read lands in memory faulted in beforehand, as the runtime's cache slots are
  (``LayerCache`` populates them when it makes the cache), so these figures are
  the tier's, not the page faults';
* page faults, apart: the extra time of a read into never-touched memory over
  one into faulted-in memory (``first_touch_s``: what a read into a spare row
  past the capacity pays, a long prompt's extra experts), and the time to fault
  one slot in (``populate_s``: what making the cache pays per slot);
* compute: ``stmoe.offload`` itself replaying a routing that always picks the
  same top-K experts, so after the prompt every expert is a hit and a decode
  token is pure compute plus the runtime's per-layer work; the experts calls and
  the decoder layers are timed inside that run;
* the predictors' own time on the compute thread per decode layer call (learning the
  routing, then predicting and queueing a set: ``predictor_time``), where tables are at
  hand (``tables``, else the model folder's shipped ones).

``stmoe.sim.host.calibrated.hardware_toml`` writes the figures with the keys of
``sim/data/hardware.toml`` and a ``[host]`` table, each number with a comment
saying how, when and on what it was measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.runtime.accelerator import GPU_TIERS, accelerator
from stmoe.runtime.cache import param_specs
from stmoe.runtime.calibrate.compute import measure_compute, measure_runtime_reads, routed_plan
from stmoe.runtime.calibrate.device_reads import measure_device_latency, measure_device_reads
from stmoe.runtime.calibrate.predictor_time import measure_predictors
from stmoe.runtime.calibrate.reads import (
    PageFaults,
    Reads,
    faulted_buffer,
    measure_latency,
    measure_page_faults,
    measure_reads,
    routed_blocks,
    slab_memory,
)
from stmoe.runtime.options import CALIBRATED_TIERS, CalibrateOptions, check_options
from stmoe.runtime.store import open_store
from stmoe.runtime.store.reading import open_tier
from stmoe.runtime.store.tiers import CHUNK_BYTES
from stmoe.sim.host.calibrated import MIN_TRANSFER_SHARE, split_read

__all__ = ["CALIBRATED_TIERS", "MIN_TRANSFER_SHARE", "CalibrateOptions", "PageFaults",
           "Reads", "calibrate", "check_options", "faulted_buffer", "machine",
           "measure_compute", "measure_latency", "measure_page_faults", "measure_reads",
           "measure_runtime_reads", "routed_blocks", "routed_plan", "slab_memory",
           "split_read"]


def calibrate(model_dir: str | Path, store: str | Path | None,
              options: CalibrateOptions | None = None) -> dict[str, Any]:
    """Measure the tier and the compute for ``model_dir`` and its ``store`` (see the
    module docstring); the figures ``hardware_toml`` writes."""
    from transformers import AutoConfig

    from stmoe.runtime.options import (
        OffloadOptions,
        resolve_capacities,
        shipped_tables,
        top_k_of,
    )

    o = options or CalibrateOptions()
    check_options(o)
    model_dir = Path(model_dir)
    opened = open_store(model_dir, store)
    n_experts, n_layers = int(opened.model["num_experts"]), int(opened.model["moe_layers"])
    top_k = top_k_of(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    expert_bytes = opened.blocks[(0, 0)].nbytes
    capacities = resolve_capacities(o.capacity, n_layers, n_experts, top_k, expert_bytes)
    if len(set(capacities)) > 1:
        raise OffloadError(f"--capacity {o.capacity!r}: a preset describes one cache size "
                           "for every layer (its cache_experts_per_layer); give one")
    capacity = capacities[0]
    workers = OffloadOptions(tier=o.tier, workers=o.workers).worker_count()
    acc = accelerator(o.tier) if o.tier in GPU_TIERS else None
    tier = open_tier(o.tier, opened, o.bandwidth, o.latency, acc.ops if acc else None,
                     acc.pinning if acc else None, workers)
    try:
        order = routed_blocks(opened, o.routing, capacity) if o.routing is not None else None
        if order is not None and len(order) < 8:
            raise OffloadError(f"--routing {o.routing}: its decode tokens miss only {len(order)} "
                               f"experts at a cache of {capacity} per layer, too few reads to "
                               "time the tier (a longer trace, or a smaller --capacity)")
        half = order[len(order) // 2 :] if order else None
        if acc is None:
            latency = measure_latency(opened, tier, min(1.0, o.seconds / 4), o.seed)
            faults = measure_page_faults(opened, tier, 8, o.seed)
            one = measure_reads(opened, tier, 1, o.seconds, o.seed, order)
            many = measure_reads(opened, tier, workers + 1, o.seconds, o.seed + 2, half)
        else:  # device slots: the copy is the transfer, and HBM has no page faults
            latency = measure_device_latency(opened, tier, acc.device, min(1.0, o.seconds / 4),
                                             o.seed)
            faults = PageFaults(0.0, 0.0, 0)
            one = measure_device_reads(opened, tier, acc.device, 1, o.seconds, o.seed, order)
            many = measure_device_reads(opened, tier, acc.device, workers + 1, o.seconds,
                                        o.seed + 2, half)
        direct = bool(getattr(tier, "direct", False))
    finally:
        tier.close()
    compute = measure_compute(model_dir, opened.path, o, top_k)
    tables = o.tables if o.tables is not None else shipped_tables(model_dir)
    predictors = (measure_predictors(model_dir, opened.path, o, o.predictors, tables, top_k)
                  if o.predictors and tables is not None else {})
    measured_latency = latency
    loop = split_read(one.wall_s / one.blocks, latency)  # the mean: interference counts
    runtime = None
    if o.routing is not None:  # the tier as the runtime's own reads met it
        runtime = measure_runtime_reads(model_dir, opened.path, o, capacity)
    per_read, latency = split_read(runtime["mean_s"], latency) if runtime else loop
    # several readers at once: the loop's throughput, never below one reader's
    parallel_bytes_per_s = max(many.bytes_per_s, expert_bytes / (per_read + latency))
    return {
        "tier": o.tier, "direct_io": direct, "store": str(opened.path),
        "model_dir": str(model_dir), "num_layers": n_layers, "num_experts": n_experts,
        "top_k": top_k, "expert_bytes": expert_bytes, "capacity": capacity,
        "workers": workers, "threads": o.threads, "latency_s": latency,
        "latency_measured_s": measured_latency,
        "chunk_bytes": CHUNK_BYTES,
        "first_touch_s": faults.first_touch_s, "populate_s": faults.populate_s,
        "touch_reads": faults.reads,
        "expert_macs": expert_bytes // param_specs(opened.blocks[(0, 0)])[0].dtype.itemsize,
        "bytes_per_s": expert_bytes / per_read, "reads_1": dataclasses.asdict(one),
        "loop_bytes_per_s": expert_bytes / loop[0],
        "runtime_reads": runtime,
        "parallel_bytes_per_s": parallel_bytes_per_s,
        "reads_n": dataclasses.asdict(many),
        "emulated_link": {"bandwidth": o.bandwidth, "latency": o.latency}
        if o.tier == "emulated" else None, **compute,
        "predictors": predictors, "predictor_tables": None if tables is None else str(tables),
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
    }


def machine() -> str:
    """This machine in one line: host, CPU model, cores, torch."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}, {cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
