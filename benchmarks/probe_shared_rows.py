"""Issue 29, the second fix tried: could a batch's rows share the resident weights' reads
and stay bit-identical to solo runs?

A batched matmul changes bits (docs/serve.md). This probe tries the other way: keep
every row's call at one row, as a solo run makes it, but walk the weight in blocks of
output rows so that a block, read from memory once, serves every row of the batch from
the cache. For each resident linear of Qwen1.5-MoE's shape (the lm_head, an attention
projection, the shared expert's up projection) and each dtype it prints whether the
blocked rows are bit-identical to the solo calls, and the time of M solo calls against
the blocked walk, in interleaved rounds (medians and ranges; load at start and end).

    python benchmarks/probe_shared_rows.py [--rounds 5] [--rows 4] [--block 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SHAPES = {  # Qwen1.5-MoE-A2.7B's resident linears: (out, in)
    "lm_head": (151936, 2048),
    "q_proj": (2048, 2048),
    "shared_expert.up_proj": (5632, 2048),
}


def solo(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    return [torch.nn.functional.linear(x[i : i + 1], w) for i in range(x.shape[0])]


def blocked(x: torch.Tensor, w: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Each row's one-row call, block by block of ``w``'s output rows."""
    outs = [torch.empty(1, 1, w.shape[0], dtype=x.dtype) for _ in range(x.shape[0])]
    for n in range(0, w.shape[0], block):
        part = w[n : n + block]
        for i in range(x.shape[0]):
            outs[i][..., n : n + block] = torch.nn.functional.linear(x[i : i + 1], part)
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=4, help="requests in the step")
    p.add_argument("--block", type=int, default=512, help="output rows of a weight block")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"load at start: {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}")
    for dtype in (torch.bfloat16, torch.float32):
        for name, (out, inp) in SHAPES.items():
            w = torch.randn(out, inp, dtype=dtype) * 0.02
            x = torch.randn(args.rows, 1, inp, dtype=dtype)
            same = all(torch.equal(a, b) for a, b in
                       zip(blocked(x, w, args.block), solo(x, w), strict=True))
            times: dict[str, list[float]] = {"solo": [], "blocked": []}
            for r in range(args.rounds):
                for kind in (("solo", "blocked") if r % 2 == 0 else ("blocked", "solo")):
                    start = time.perf_counter()
                    solo(x, w) if kind == "solo" else blocked(x, w, args.block)
                    times[kind].append(time.perf_counter() - start)
            ratios = [s / b for s, b in zip(times["solo"], times["blocked"], strict=True)]
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{str(dtype).removeprefix('torch.'):>8} {name:<22} {args.rows} rows: "
                  f"bit-identical {same}; solo {med['solo']:.1f} ms, blocked "
                  f"{med['blocked']:.1f} ms; solo/blocked {statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}, {max(ratios):.2f}]; one solo row "
                  f"{med['solo'] / args.rows:.1f} ms")
    print(f"load at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
