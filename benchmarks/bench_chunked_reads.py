"""What reading an expert in chunks costs on the disk tier (docs/runtime.md, Demand first).

A prefetch worker reads a block in chunks (``tiers.CHUNK_BYTES``) so that a demand read
can go between two of them; each chunk is its own ``preadv``. This times the disk tier's
own read of whole blocks (``DiskTier.read_into`` straight into page-aligned slot memory,
CRC-32C checked, O_DIRECT where the file system allows) in one read and in chunks of each
size, interleaved in rotated rounds over the same random blocks, and prints the medians,
ranges and the ratio to the whole read with MET / NOT MET (target: the runtime's chunk size,
``tiers.CHUNK_BYTES``, costs at most 5% over one read).

    python benchmarks/bench_chunked_reads.py --store STORE [--rounds 5] [--reads 40]
        [--chunks 262144,1048576,2097152]

STORE: any store from ``stmoe pack`` (the real-size benchmark's, e.g.
~/.cache/stmoe/bench/qwen1.5-moe-a2.7b-L4.store: 17 MB experts).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np

from stmoe.evaluate.compare import rotated, spread, verdict
from stmoe.runtime.calibrate import faulted_buffer
from stmoe.runtime.store import ExpertStore
from stmoe.runtime.store.tiers import CHUNK_BYTES, DiskTier, padded

TARGET = 1.05  # the runtime's chunk size: at most 5% over one read


def timed_reads(tier: DiskTier, blocks: list, chunk: int) -> list[float]:
    """Seconds of each block's read into slot-like memory, in ``chunk``-byte reads (0: one)."""
    size = max(padded(b) for b in blocks)
    slot = faulted_buffer(size)
    raw = np.frombuffer(slot, dtype=np.uint8)
    tier.chunk_bytes = chunk
    between = (lambda: None) if chunk else None
    out = []
    for b in blocks:
        ends = [t.offset for t in b.tensors[1:]] + [b.nbytes]  # tensors laid end to end
        parts = [raw[t.offset : end] for t, end in zip(b.tensors, ends, strict=True)]
        start = time.perf_counter()
        if not tier.read_into(b, parts, between):
            tier.fetch(b, slot, between)  # parts not page-aligned: the buffer path
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reads", type=int, default=40, help="blocks read per round and size")
    ap.add_argument("--chunks", default="1048576,2097152,4194304", help="chunk sizes (bytes)")
    args = ap.parse_args()
    store = ExpertStore(args.store)
    tier = DiskTier(store)
    sizes = sorted({0, CHUNK_BYTES, *(int(c) for c in args.chunks.split(","))})
    every = list(store.blocks.values())
    label = {c: "one read" if c == 0 else f"{c / 2**20:g} MiB chunks" for c in sizes}
    print(f"{args.store}: {len(every)} blocks of {every[0].nbytes / 2**20:.1f} MiB; "
          f"{'O_DIRECT' if tier.direct else 'buffered, page cache dropped'}; load "
          f"{os.getloadavg()[0]:.2f}")
    per_read: dict[int, list[float]] = {c: [] for c in sizes}  # round medians, s per read
    try:
        for rnd in range(args.rounds):
            blocks = random.Random(rnd).sample(every, min(args.reads, len(every)))
            for chunk in rotated(sizes, rnd):
                tier.drop_cache()
                per_read[chunk].append(statistics.median(timed_reads(tier, blocks, chunk)))
    finally:
        tier.close()
    whole = statistics.median(per_read[0])
    for chunk in sizes:
        ratio = statistics.median(per_read[chunk]) / whole
        print(f"{label[chunk]:>16}: {spread([t * 1e3 for t in per_read[chunk]])} ms a read "
              f"(median of round medians [min, max]); {ratio:.3f}x one read")
    ratio = statistics.median(per_read[CHUNK_BYTES]) / whole
    mib = CHUNK_BYTES / 2**20
    print(f"  {verdict(ratio <= TARGET):8} the runtime's {mib:g} MiB chunks cost at "
          f"most {TARGET - 1:.0%} over one read ({ratio:.3f}x); load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
