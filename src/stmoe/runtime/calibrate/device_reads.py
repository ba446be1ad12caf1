"""A gpu tier as calibrate measures it: a block brought into a device slot the way the
engine does (``tier.load``: the pinned store's copy, or a disk read through a bounce buffer
and its copy), until the copy has landed, by one thread and by several at once.

Why apart from ``reads``: on a gpu tier a read into host memory is not the transfer (the
pinned tier's ``fetch`` reads nothing; its cost is the copy), and a slot is device memory,
which has no page faults to measure. So the reads here land in slots on the device, each
thread on a copy stream of its own, and a read ends when the copy's event has completed.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from stmoe.runtime.calibrate.reads import Reads, read_order, timed_reads
from stmoe.runtime.store import ALIGN, Block, ExpertStore
from stmoe.runtime.store.index import slot_bytes


def measure_device_reads(store: ExpertStore, tier: Any, device: torch.device, threads: int,
                         seconds: float, seed: int, order: list[Block] | None = None) -> Reads:
    """``threads`` threads bringing blocks into device slots for about ``seconds`` (at least
    one each), each on a copy stream of its own: ``order``'s blocks in turn, else distinct
    random ones."""
    blocks = read_order(store, order, seed)
    return timed_reads(blocks, threads, seconds,
                       lambda: (tier.ops.new_stream(), _slot(blocks[0], device)),
                       lambda held, block: tier.load(block, held[1], held[0]).synchronize())


def measure_device_latency(store: ExpertStore, tier: Any, device: torch.device,
                           seconds: float, seed: int) -> float:
    """Median time of one page to the device (the per-transfer cost): a page of the pinned
    store copied, or on the disk -> GPU tier a page read and copied, until it has landed."""
    blocks = list(store.blocks.values())
    rng = random.Random(seed + 1)
    dst = torch.empty(ALIGN, dtype=torch.uint8, device=device)
    stream = tier.ops.new_stream()
    page = torch.empty(ALIGN, dtype=torch.uint8, pin_memory=device.type == "cuda")
    reader = getattr(tier, "reader", None)  # the disk -> GPU tier's disk
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while not times or (time.perf_counter() < deadline and len(times) < 2000):
        block = rng.choice(blocks)
        start = time.perf_counter()
        if reader is not None:
            reader.read_page(block, tier.pool.buffers[0].buf)
            src = page
        else:
            src = tier.host[block.offset : block.offset + ALIGN]
        tier.ops.copy_async(dst, src, stream).synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _slot(block: Block, device: torch.device) -> list[torch.Tensor]:
    """A device slot for ``block``: its tensors' bytes, in block order."""
    return [torch.empty(slot_bytes(t), dtype=torch.uint8, device=device) for t in block.tensors]
