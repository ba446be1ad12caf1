"""The tier as calibrate measures it: reads into slot-like memory (alone, and with the
workers' threads), page faults apart, and the latency of one-page reads."""

from __future__ import annotations

import dataclasses
import mmap
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from stmoe.errors import OffloadError
from stmoe.runtime.cache import param_specs, populate_pages
from stmoe.runtime.store import ALIGN, Block, ExpertStore
from stmoe.runtime.store.in_place import InPlaceTier
from stmoe.runtime.store.loader import Loader
from stmoe.runtime.store.tiers import DiskTier, Tier, buffer_bytes

T = TypeVar("T")


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
                  seed: int, order: list[Block] | None = None) -> Reads:
    """``threads`` threads reading blocks into slot-like memory for about ``seconds``
    (at least one block each), as the runtime fills a cache slot: ``order``'s blocks in
    turn, else distinct random ones. The memory is faulted in first, as the runtime's
    slots are: the times are the tier's, not page faults'."""
    blocks = read_order(store, order, seed)
    size = max(buffer_bytes(b) for b in blocks)
    return timed_reads(blocks, threads, seconds,
                       lambda: (faulted_buffer(size), faulted_buffer(size)),
                       lambda held, block: _fill(tier, store, block,
                                                 _slot_parts(block, held[0]), held[1]))


def read_order(store: ExpertStore, order: list[Block] | None, seed: int) -> list[Block]:
    """The blocks a measurement reads in turn: ``order``'s, else the store's shuffled (a
    small store's come round again)."""
    if order:
        return list(order)
    blocks = list(store.blocks.values())
    random.Random(seed).shuffle(blocks)
    return blocks


def timed_reads(blocks: list[Block], threads: int, seconds: float, setup: Callable[[], T],
                read: Callable[[T, Block], None]) -> Reads:
    """``threads`` threads, each with what ``setup`` gives it, calling ``read`` on the next
    of ``blocks`` (round and round) for about ``seconds``, at least once each; each call
    timed."""
    lock, times, moved, taken = threading.Lock(), [], [0], [0]
    deadline = time.perf_counter() + seconds

    def reader() -> None:
        held = setup()
        first = True
        while first or time.perf_counter() < deadline:
            first = False
            with lock:
                block = blocks[taken[0] % len(blocks)]
                taken[0] += 1
            start = time.perf_counter()
            read(held, block)
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
        raise OffloadError(f"--routing {routing}: routes {trace.num_layers} layers of "
                           f"{trace.num_experts} experts; the store has {layers} of {n}")
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
          buf: Any) -> None:
    """What the engine does on a load (``Loader``): one checked read into the slot where
    the tier can, else the tier's checked bytes copied into it."""
    Loader(tier, store).fill_parts(block, parts, buf)


def measure_page_faults(store: ExpertStore, tier: Tier, reads: int, seed: int) -> PageFaults:
    """The page faults of never-touched memory, per expert. The runtime pays them once per
    slot when it makes a cache (``populate_s``: faulting the slot in ahead), and per
    spare row past the capacity a long prompt reads an extra expert into
    (``first_touch_s``: that read's extra time over a read into a faulted-in slot); a
    read into a slot never pays them. ``reads`` pairs of fills of distinct blocks, one
    into fresh memory and one into a faulted-in slot, alternating which goes first."""
    blocks = list(store.blocks.values())
    random.Random(seed + 3).shuffle(blocks)
    size = max(buffer_bytes(b) for b in blocks)
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
        if isinstance(tier, DiskTier | InPlaceTier):  # the disk: one aligned page of the block
            tier.read_page(block, buf)
        else:  # the emulated link: a transfer of one page
            tier.fetch(dataclasses.replace(block, nbytes=ALIGN), buf)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
