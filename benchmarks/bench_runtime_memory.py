"""Steadiness of a long offloaded generation: resident memory flat after warm-up.

Target (issue 8): over a 2,000-token generation the process's resident memory
stays within 5% after warm-up, and no layer's cache ever holds more experts
than its capacity. stmoe's own model, ST-MoE prefetch, 50% capacity, disk tier.
(The shipped model was trained on 1,024 positions; beyond them the text
degrades but the memory behaviour is what is measured.)

    python benchmarks/bench_runtime_memory.py [--tokens 2000] [--warmup 200]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from stmoe.models import SHIPPED_MODEL
from stmoe.runtime.api import offload
from stmoe.runtime.memory import MemoryProbe, rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200, help="forward calls before measuring")
    parser.add_argument("--capacity", default="50%")
    parser.add_argument("--tier", default="disk")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("STMOE_CACHE", str(Path(tempfile.gettempdir()) / "stmoe-bench"))
    with offload(SHIPPED_MODEL, capacity=args.capacity, predictor="stmoe", tier=args.tier,
                 bandwidth="1GB") as om:
        probe = MemoryProbe(om.model, om.engine, every=50)
        start_rss = rss_bytes()
        result = om.generate("def main():\n", max_new_tokens=args.tokens)
        probe.close()
        capacity = om.config["capacity"]
        cache_mib = om.engine.cache_bytes / 2**20
    growth = probe.growth_after(args.warmup)
    print(f"generated {len(result.tokens)} tokens at {result.decode_tokens_per_s:.1f} tokens/s; "
          f"cache {capacity} experts/layer = {cache_mib:.1f} MiB")
    print(f"RSS at start {start_rss / 2**20:.1f} MiB; samples every 50 tokens after warm-up:")
    print("  " + ", ".join(f"{rss / 2**20:.1f}" for call, rss in probe.samples
                          if call >= args.warmup))
    print(
        f"RSS growth after warm-up: {growth:+.2%} (target within 5%): "
        f"{'MET' if abs(growth) <= 0.05 else 'NOT MET'}"
    )
    print(
        f"most experts any layer's cache held: {probe.peak_cached} (capacity {capacity}): "
        f"{'MET' if probe.peak_cached <= capacity else 'NOT MET'}"
    )


if __name__ == "__main__":
    main()
