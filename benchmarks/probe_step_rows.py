"""A step's lm_head in int4/int8: 4 requests' rows side by side against one gathered call.

Qwen1.5-MoE's lm_head (151936 x 2048, RANDOM weights) quantized as ``--quantize-resident``
does; 4 one-token rows computed (a) each alone, two at a time on a 2-thread pool (the
step batcher's ``share_rows=False``), (b) in one call split by output columns over the
same pool (``runtime.step_rows.split_rows``, what a step does with ``share_rows``). torch
on one thread per op; interleaved rounds of 10 calls, medians and ranges; the bits are
checked equal first.

    python benchmarks/probe_step_rows.py [--format int4|int8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from stmoe.quant import parse_format
from stmoe.quant.linears import QuantizedLinear
from stmoe.runtime.batcher.step_rows import split_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="int4", choices=["int4", "int8"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    linear = torch.nn.Linear(2048, 151936, bias=False).to(torch.bfloat16)
    head = QuantizedLinear(linear, parse_format(a.format).resolved([2048]), "lm_head")
    xs = [torch.randn(1, 1, 2048, dtype=torch.bfloat16) for _ in range(a.rows)]
    print(f"load at start: {os.getloadavg()[0]:.2f}")
    with ThreadPoolExecutor(2) as pool:
        alone = lambda: list(pool.map(head.rows, xs))  # noqa: E731
        together = lambda: split_rows(head, xs, pool, 2)  # noqa: E731
        assert all(torch.equal(p, q) for p, q in zip(alone(), together(), strict=True))
        times: dict[str, list[float]] = {"alone": [], "together": []}
        order = [("alone", alone), ("together", together)]
        for rnd in range(a.rounds):
            for name, call in order if rnd % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                for _ in range(10):
                    call()
                times[name].append((time.perf_counter() - t) / 10 * 1e3)
    for name, ts in times.items():
        print(f"{a.format} lm_head, {a.rows} rows {name}: {statistics.median(ts):.2f} ms "
              f"[{min(ts):.2f}, {max(ts):.2f}]")
    ratios = [p / q for p, q in zip(times["alone"], times["together"], strict=True)]
    print(f"together {statistics.median(ratios):.2f}x faster [{min(ratios):.2f}, "
          f"{max(ratios):.2f}]; load at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
