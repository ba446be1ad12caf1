#!/usr/bin/env python3
"""The prepared GPU check of issue 43: one command on an offline GPU machine, one JSON.

    benchmarks/gpu_check.sh [--out docs/results/gpu_check.json] [--commit SHA]
    PYTHONPATH=src python3 benchmarks/gpu_check.py [...]    # the same, crc32c already there
    PYTHONPATH=src python3 benchmarks/gpu_check.py --dry-run  # the plumbing, on the CPU

Each stage runs inside its own try/except (a failing stage records its error and the next
one runs) and the JSON is rewritten after each, so a run cut short still leaves what it
measured. Stages:

1. ``environment``: torch, CUDA, the device, its free memory, the CPU's int4 layout;
2. ``h2d``: host-to-device bandwidth from pinned, registered (``cudaHostRegister``: how
   the pinned store is locked) and pageable memory, 64 KiB to 1 GiB, timed with CUDA
   events; the cost of one expert-sized copy (Qwen3.6-35B-A3B's 6 MiB bf16 expert) and of
   its top-8 back to back, and the host's cost of issuing one;
3. ``kernels``: torch's CUDA int8/int4 weight-only kernels on the stored layouts (the
   repack of ``stmoe.quant.cuda_kernels``) against the dequantized matrix, and their speed
   beside bf16 ``linear`` and dequantize-then-matmul, at that expert's shapes;
4. ``cuda_tests``: the ``cuda``-marked tests (the kernels, the GPU tiers);
5. ``tier_gpu``: today's ``--tier gpu`` as it is: greedy tokens against the GPU-resident
   shipped model, and both speeds.

Stages recorded as ``todo``, with no figure, need the engine's asynchronous GPU path
(issue 43, item 1): the decode table (GPU-resident, on-demand, lru-only, stmoe,
stmoe-plus, oracle at 25% and 50% of the experts in HBM, from pinned memory and from disk),
accelerate's offload, and ``stmoe calibrate`` with the simulator beside the measured runs.

``--dry-run`` runs every stage's plumbing on the CPU with tiny sizes (perf_counter for
CUDA events, ordinary memory for pinned): its figures are not measurements of anything.

The stages, the JSON and the targets are ``stmoe.runtime.gpu_check``'s (``run_stages``,
tested there with a dry run); this is its CLI.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from stmoe.runtime.gpu_check import git_head, run_stages, target_lines

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON (default docs/results/gpu_check.json; a dry run: "
                         "out/gpu_check.dry-run.json)")
    ap.add_argument("--dry-run", "--device-cpu", dest="dry", action="store_true",
                    help="every stage's plumbing on the CPU, tiny sizes: no measurement")
    ap.add_argument("--commit", default=os.environ.get("STMOE_COMMIT"),
                    help="the commit checked (default: $STMOE_COMMIT, else git's HEAD)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per generation")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stages still to start after this many seconds are skipped")
    a = ap.parse_args()
    out = a.out or REPO / ("out/gpu_check.dry-run.json" if a.dry else
                           "docs/results/gpu_check.json")
    commit = a.commit or git_head(REPO)
    os.environ.setdefault("STMOE_CACHE", tempfile.mkdtemp(prefix="stmoe-gpu-check-"))
    doc = run_stages(out, dry_run=a.dry, commit=commit, repo=REPO, tokens=a.tokens,
                     budget_s=a.budget_s)
    for line in target_lines(doc):
        print(line)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
