"""``stmoe calibrate``: measure this machine as the offloading runtime uses it.

The simulator's host pipeline (``stmoe.sim.host``, ``stmoe simulate --pipeline
runtime``) needs a hardware preset of *this* machine: how fast the tier brings
an expert block into a cache slot, alone and with the prefetch workers reading
too, and how long one decode token computes at the model's sizes. Every figure
here is measured with the runtime's own code paths:

* reads: expert blocks of the packed store through the tier, in a random order,
  or with ``routing`` the blocks the runtime reads for a recorded trace (the
  misses of an LRU cache of the capacity over its decode tokens, token by token
  and layer by layer: a disk's, and a virtual disk's host's, caching and locality
  are then the workload's: 1.09 GB/s against 0.39 GB/s in random order on this
  machine's virtual disk), ``DiskTier.read_into`` straight into page-aligned slot
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
  the decoder layers are timed inside that run.

``stmoe.sim.calibrated.hardware_toml`` writes the figures with the keys of
``sim/data/hardware.toml`` and a ``[host]`` table, each number with a comment
saying how, when and on what it was measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import mmap
import os
import platform
import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stmoe.runtime.cache import param_specs, populate_pages
from stmoe.runtime.store import ALIGN, Block, ExpertStore, StoreError, open_store
from stmoe.runtime.tiers import Tier, open_tier, padded, read_block

CALIBRATED_TIERS = ("disk", "emulated")


@dataclass(frozen=True)
class CalibrateOptions:
    """What to measure and for how long (``calibrate``)."""

    tier: str = "disk"
    bandwidth: float | str | None = None  # the emulated link's (bytes/s)
    latency: float | str = 0.0  # the emulated link's (s)
    seconds: float = 4.0  # reading time of each read measurement
    tokens: int = 12  # decode tokens of the compute measurement
    threads: int = 1  # torch compute threads
    workers: int | None = None  # prefetch threads (default: the runtime's for the tier)
    capacity: str | int = "50%"  # the cache the preset describes (its cache_experts_per_layer)
    seed: int = 0
    routing: Path | None = None  # a trace whose decode misses the reads follow (else random)


@dataclass(frozen=True)
class Reads:
    """Blocks read by ``threads`` threads at once for ``wall_s``."""

    threads: int
    blocks: int
    nbytes: int
    wall_s: float
    median_read_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.wall_s if self.wall_s > 0 else 0.0


def check_options(o: CalibrateOptions) -> None:
    """Refuse what cannot be measured, in one line, before anything loads."""
    if o.tier not in CALIBRATED_TIERS:
        raise StoreError(f"calibrate measures --tier disk or emulated, not {o.tier!r}")
    if not (o.seconds > 0 and o.seconds <= 600):
        raise StoreError(f"--seconds {o.seconds}: expected more than 0 and at most 600")
    if not 1 <= o.tokens <= 1000:
        raise StoreError(f"--tokens {o.tokens}: expected 1 to 1000 decode tokens")
    if o.threads < 1 or (o.workers is not None and o.workers < 0):
        raise StoreError("--threads must be >= 1 and --workers >= 0")


@dataclass(frozen=True)
class PageFaults:
    """What never-touched memory costs per expert, apart from the tier's reads."""

    first_touch_s: float  # a read into it over one into faulted-in memory (medians)
    populate_s: float  # faulting one expert's memory in ahead (the runtime's populate_pages)
    reads: int  # reads of each kind


def slab_memory(nbytes: int) -> mmap.mmap:
    """Page-aligned private anonymous memory, never touched: what ``LayerCache``'s slabs
    (slots and spare rows) are made of, so its page faults cost what theirs do."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN), flags=mmap.MAP_PRIVATE)


def faulted_buffer(nbytes: int) -> mmap.mmap:
    """Slab memory whose pages are faulted in now, as a cache slot's are when
    ``LayerCache`` makes the cache (same call): a read into it pays no page faults."""
    buf = slab_memory(nbytes)
    populate_pages(buf, len(buf))
    return buf


def measure_reads(store: ExpertStore, tier: Tier, threads: int, seconds: float,
                  seed: int, order: list[Block] | None = None) -> Reads:  # fmt: skip
    """``threads`` threads reading blocks into slot-like memory for about ``seconds``
    (at least one block each), as the runtime fills a cache slot: ``order``'s blocks in
    turn, else distinct random ones. The memory is faulted in first, as the runtime's
    slots are: the times are the tier's, not page faults'."""
    blocks = list(order) if order else list(store.blocks.values())
    if not order:
        random.Random(seed).shuffle(blocks)  # a small store's blocks come round again
    size = max(padded(b) for b in blocks)
    lock, times, moved, taken = threading.Lock(), [], [0], [0]
    deadline = time.perf_counter() + seconds

    def reader() -> None:
        slot, buf = faulted_buffer(size), faulted_buffer(size)
        first = True
        while first or time.perf_counter() < deadline:
            first = False
            with lock:
                block = blocks[taken[0] % len(blocks)]
                taken[0] += 1
            start = time.perf_counter()
            _fill(tier, store, block, _slot_parts(block, slot), buf)
            with lock:
                times.append(time.perf_counter() - start)
                moved[0] += block.nbytes

    pool = [threading.Thread(target=reader, daemon=True) for _ in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    wall = time.perf_counter() - start
    return Reads(threads, len(times), moved[0], wall, statistics.median(times))


def routed_blocks(store: ExpertStore, routing: Path, capacity: int) -> list[Block]:
    """The blocks the runtime reads for ``routing``'s first sequence: the misses of an LRU
    cache of ``capacity`` experts per layer over its decode tokens (the prompt warms the
    cache), in the order a decode meets them (token by token, layer by layer, each
    layer's experts sorted); its first layers where the store has fewer; a clear error
    when the shapes differ. A re-read of a recently read block can be faster than a
    first read (a VM's host cache), so the runtime's own stream is what is timed."""
    from collections import OrderedDict

    from stmoe.trace import load_trace

    trace = load_trace(routing)
    layers, n = int(store.model["moe_layers"]), int(store.model["num_experts"])
    if trace.num_experts != n or trace.num_layers < layers:
        raise StoreError(f"--routing {routing}: routes {trace.num_layers} layers of "
                         f"{trace.num_experts} experts; the store has {layers} of {n}")  # fmt: skip
    _, first = next(trace.sequences())
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(layers)]
    out = []
    for token, decode in zip(trace.experts[first], trace.is_decode[first], strict=True):
        for layer in range(layers):
            cache = caches[layer]
            for e in sorted(set(token[layer].tolist()) - {-1}):
                if e in cache:
                    cache.move_to_end(e)
                    continue
                if decode:
                    out.append(store.blocks[(layer, int(e))])
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return out


def _slot_parts(block: Block, slot: Any) -> list[np.ndarray]:
    """A cache slot's memory as the block's tensors, in block order (as ``LayerCache``)."""
    raw = np.frombuffer(slot, dtype=np.uint8)
    return [raw[p.offset : p.offset + p.nbytes] for p in param_specs(block)]


def _fill(tier: Tier, store: ExpertStore, block: Block, parts: list[np.ndarray],
          buf: Any) -> None:  # fmt: skip
    """What ``OffloadEngine._fill`` does (``tiers.read_block``): one checked read into
    the slot where the tier can, else the tier's checked bytes copied into it."""
    src = read_block(tier, store, block, parts, buf)
    if src is None:
        return
    raw = src.numpy()
    for p in parts:
        start = p.ctypes.data - parts[0].ctypes.data
        p[:] = raw[start : start + p.nbytes]


def measure_page_faults(store: ExpertStore, tier: Tier, reads: int, seed: int) -> PageFaults:
    """The page faults of never-touched memory, per expert. The runtime pays them once per
    slot when it makes a cache (``populate_s``: faulting the slot in ahead), and per
    spare row past the capacity a long prompt reads an extra expert into
    (``first_touch_s``: that read's extra time over a read into a faulted-in slot); a
    read into a slot never pays them. ``reads`` pairs of fills of distinct blocks, one
    into fresh memory and one into a faulted-in slot, alternating which goes first."""
    blocks = list(store.blocks.values())
    random.Random(seed + 3).shuffle(blocks)
    size = max(padded(b) for b in blocks)
    spare, slot, buf = slab_memory(size * reads), faulted_buffer(size), faulted_buffer(size)
    fresh, faulted = [], []
    for i in range(reads):
        for k, into_fresh in enumerate((i % 2 == 0, i % 2 == 1)):
            block = blocks[(2 * i + k) % len(blocks)]
            into = memoryview(spare)[i * size : (i + 1) * size] if into_fresh else slot
            start = time.perf_counter()
            _fill(tier, store, block, _slot_parts(block, into), buf)
            (fresh if into_fresh else faulted).append(time.perf_counter() - start)
    memory = slab_memory(size * reads)  # a new cache's slabs, faulted in as it is made
    start = time.perf_counter()
    populate_pages(memory, len(memory))
    populate = (time.perf_counter() - start) / reads
    touch = max(0.0, statistics.median(fresh) - statistics.median(faulted))
    return PageFaults(touch, populate, reads)


def measure_latency(store: ExpertStore, tier: Tier, seconds: float, seed: int) -> float:
    """Median time of one-page reads at random block offsets (the per-read cost), into a
    faulted-in page."""
    blocks = list(store.blocks.values())
    rng = random.Random(seed + 1)
    buf = faulted_buffer(ALIGN)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while not times or (time.perf_counter() < deadline and len(times) < 2000):
        block = rng.choice(blocks)
        start = time.perf_counter()
        if hasattr(tier, "fd"):  # the disk: one aligned page of the block
            os.preadv(tier.fd, [memoryview(buf)[:ALIGN]], block.offset)  # type: ignore[attr-defined]
        else:  # the emulated link: a transfer of one page
            tier.fetch(dataclasses.replace(block, nbytes=ALIGN), buf)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_compute(model_dir: Path, store_path: Path | None, o: CalibrateOptions,
                    top_k: int) -> dict[str, float]:  # fmt: skip
    """Per decode token: total, inside the MoE decoder layers, and in the experts calls
    (every expert a hit: the runtime's compute and per-layer work, no I/O). With
    ``o.routing``, the trace's own routing with every expert cached and warm (its
    experts change from token to token as the workload's do; 90 ms a token against
    73 ms for fixed experts on the benchmark's model), else the same top-K experts at
    every token in a cache of K."""
    from stmoe.model_introspect import experts_modules
    from stmoe.runtime.api import offload
    from stmoe.runtime.routing_replay import ReplayPlan

    torch.set_num_threads(o.threads)
    link = {"bandwidth": o.bandwidth, "latency": o.latency} if o.tier == "emulated" else {}
    capacity = "100%" if o.routing is not None else top_k
    with offload(model_dir, store_path, capacity=capacity, predictor="ondemand", policy="lru",
                 tier=o.tier, workers=0, **link) as om:  # fmt: skip
        n_layers = om.config["num_layers"]
        steps = o.tokens + 1  # the prompt's forward, then the timed decode tokens
        if o.routing is not None:
            plan = routed_plan(o.routing, om, n_layers, top_k)
            steps = min(o.tokens, plan.new_tokens)
            om.replay(plan, max_new_tokens=steps)  # every routed expert into the cache
        else:
            experts = np.broadcast_to(np.arange(top_k), (steps + 1, n_layers, top_k)).copy()
            plan = ReplayPlan(experts, np.full(experts.shape, 1.0 / top_k, dtype=np.float32),
                              2, [1, 2])  # fmt: skip
        expert_s: list[float] = []
        layer_s: list[float] = []
        server = om.engine.server
        server.base = [_timed(f, expert_s) for f in server.base]
        hooks = []
        for name, _ in experts_modules(om.model):
            layer = om.model.get_submodule(_decoder_layer(name))
            hooks.append(layer.register_forward_pre_hook(lambda *a: layer_s.append(-_now())))
            hooks.append(layer.register_forward_hook(lambda *a: layer_s.append(_now())))
        try:
            result = om.replay(plan, max_new_tokens=steps, cold=o.routing is None)
        finally:
            for h in hooks:
                h.remove()
    tokens = result.decode_tokens
    if tokens < 1 or result.hit_rate < 1.0:
        raise StoreError(f"calibrate's compute run decoded {tokens} tokens at hit rate "
                         f"{result.hit_rate:.2f}; expected every expert a hit")  # fmt: skip
    per_call = np.add(layer_s[0::2], layer_s[1::2])  # end - start of each decoder layer
    decode_layers = per_call[n_layers:]  # after the prompt's forward
    return {
        "token_s": result.decode_s / tokens,
        "layers_s": float(decode_layers.sum()) / tokens,
        "experts_s": float(sum(expert_s[n_layers:])) / tokens,
        "tokens": tokens,
        "num_layers": n_layers,
    }


def measure_runtime_reads(model_dir: Path, store_path: Path, o: CalibrateOptions,
                          capacity: int) -> dict[str, float]:  # fmt: skip
    """The tier as the runtime meets it: ``stmoe.offload`` replays ``o.routing`` with an
    LRU cache of ``capacity`` and no prefetch, and the compute thread's reads of its
    decode misses (timed by the runtime, nothing else reading) give the mean time of one
    read. On this machine's virtual disk calibrate's own back-to-back loop measured about
    half the speed the runtime's reads met in the same minutes (docs/simulator.md), so
    the preset's single-reader speed is taken from here where a trace is given."""
    from stmoe.runtime.api import offload

    assert o.routing is not None
    torch.set_num_threads(o.threads)
    link = {"bandwidth": o.bandwidth, "latency": o.latency} if o.tier == "emulated" else {}
    with offload(model_dir, store_path, capacity=capacity, predictor="ondemand", policy="lru",
                 tier=o.tier, workers=0, **link) as om:  # fmt: skip
        plan = routed_plan(o.routing, om, om.config["num_layers"], om.config["top_k"])
        result = om.replay(plan)
    decode = result.stats["phases"]["decode"]
    reads = int(decode["demand_reads"])
    if reads < 8:
        raise StoreError(f"--routing {o.routing}: its decode tokens miss only {reads} experts "
                         f"at a cache of {capacity} per layer, too few reads to time the tier "
                         "(a longer trace, or a smaller --capacity)")  # fmt: skip
    return {"reads": reads, "mean_s": decode["demand_read_s"] / reads,
            "tokens": result.decode_tokens}  # fmt: skip


def routed_plan(routing: Path, om: Any, n_layers: int, top_k: int) -> Any:
    """The trace's first sequence as a replay plan for ``om``'s model."""
    from stmoe.runtime.routing_replay import plan_replay
    from stmoe.trace import load_trace

    n = int(om.engine.num_experts)
    return plan_replay(load_trace(routing), 0, n_layers, n, top_k, om.model.config.vocab_size)


def _now() -> float:
    return time.perf_counter()


def _timed(fn: Any, into: list[float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return timed


def _decoder_layer(experts_name: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.3``: the decoder layer around it."""
    parts = experts_name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    raise StoreError(f"cannot tell the decoder layer of experts module {experts_name!r}")


def calibrate(model_dir: str | Path, store: str | Path | None,
              options: CalibrateOptions | None = None) -> dict[str, Any]:  # fmt: skip
    """Measure the tier and the compute for ``model_dir`` and its ``store`` (see the
    module docstring); the figures ``hardware_toml`` writes."""
    from transformers import AutoConfig

    from stmoe.runtime.options import OffloadOptions, resolve_capacity, top_k_of

    o = options or CalibrateOptions()
    check_options(o)
    model_dir = Path(model_dir)
    opened = open_store(model_dir, store)
    n_experts, n_layers = int(opened.model["num_experts"]), int(opened.model["moe_layers"])
    top_k = top_k_of(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    expert_bytes = opened.blocks[(0, 0)].nbytes
    capacity = resolve_capacity(o.capacity, n_layers, n_experts, top_k, expert_bytes)
    workers = OffloadOptions(tier=o.tier, workers=o.workers).worker_count()
    tier = open_tier(o.tier, opened, o.bandwidth, o.latency)
    try:
        latency = measure_latency(opened, tier, min(1.0, o.seconds / 4), o.seed)
        faults = measure_page_faults(opened, tier, 8, o.seed)
        order = routed_blocks(opened, o.routing, capacity) if o.routing is not None else None
        if order is not None and len(order) < 8:
            raise StoreError(f"--routing {o.routing}: its decode tokens miss only {len(order)} "
                             f"experts at a cache of {capacity} per layer, too few reads to "
                             "time the tier (a longer trace, or a smaller --capacity)")  # fmt: skip
        one = measure_reads(opened, tier, 1, o.seconds, o.seed, order)
        many = measure_reads(opened, tier, workers + 1, o.seconds, o.seed + 2,
                             order[len(order) // 2 :] if order else None)  # fmt: skip
        direct = bool(getattr(tier, "direct", False))
    finally:
        tier.close()
    compute = measure_compute(model_dir, opened.path, o, top_k)
    per_read = max(one.wall_s / one.blocks - latency, 1e-9)  # the mean: interference counts
    runtime = None
    if o.routing is not None:  # the tier as the runtime's own reads met it
        runtime = measure_runtime_reads(model_dir, opened.path, o, capacity)
        per_read = max(runtime["mean_s"] - latency, 1e-9)
    # several readers at once: the loop's throughput, never below one reader's
    parallel_bytes_per_s = max(many.bytes_per_s, expert_bytes / (per_read + latency))
    return {
        "tier": o.tier, "direct_io": direct, "store": str(opened.path),
        "model_dir": str(model_dir), "num_layers": n_layers, "num_experts": n_experts,
        "top_k": top_k, "expert_bytes": expert_bytes, "capacity": capacity,
        "workers": workers, "threads": o.threads, "latency_s": latency,
        "first_touch_s": faults.first_touch_s, "populate_s": faults.populate_s,
        "touch_reads": faults.reads,
        "expert_macs": expert_bytes // param_specs(opened.blocks[(0, 0)])[0].dtype.itemsize,
        "bytes_per_s": expert_bytes / per_read, "reads_1": dataclasses.asdict(one),
        "loop_bytes_per_s": expert_bytes / max(one.wall_s / one.blocks - latency, 1e-9),
        "runtime_reads": runtime,
        "parallel_bytes_per_s": parallel_bytes_per_s,
        "reads_n": dataclasses.asdict(many),
        "emulated_link": {"bandwidth": o.bandwidth, "latency": o.latency}
        if o.tier == "emulated" else None, **compute,
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
    }  # fmt: skip


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
