#!/usr/bin/env python3
"""The prepared GPU check of issue 43: one command on an offline GPU machine, one JSON.

    benchmarks/gpu_check.py --prepare       # here, where ../shared/traces is: the routing
    benchmarks/gpu_check.sh [--out docs/results/gpu_check.json] [--commit SHA]   # the GPU
    PYTHONPATH=src python3 benchmarks/gpu_check.py [...]    # the same, crc32c already there
    PYTHONPATH=src python3 benchmarks/gpu_check.py --dry-run  # the plumbing, on the CPU
    PYTHONPATH=src python3 benchmarks/gpu_check.py --rehearse # the same at the real shape
    benchmarks/gpu_check.sh --rerun docs/results/gpu_check.json --out "$OUT/gpu_check.json"
        # a later GPU session: only the stages that did not finish ok (or --stages a,b)

Each stage runs inside its own try/except (a failing stage records its error and the next
one runs) and the JSON is rewritten after each (the decode table's after each of its runs),
so a run cut short still leaves what it measured. Stages:

1. ``environment``: torch, CUDA, the device, its free memory, the CPU's int4 layout;
2. ``h2d``: host-to-device bandwidth from pinned, registered (``cudaHostRegister``: how
   the pinned store is locked) and pageable memory, 64 KiB to 1 GiB, timed with CUDA
   events; the cost of one expert-sized copy (Qwen3.6-35B-A3B's 6 MiB bf16 expert) and of
   its top-8 back to back, and the host's cost of issuing one;
3. ``kernels``: torch's CUDA int8/int4 weight-only kernels on the stored layouts against the
   dequantized matrix, and their speed beside bf16 ``linear`` and dequantize-then-matmul;
4. ``decode_table``: a Qwen3.6-35B-A3B-shaped checkpoint made there (``stmoe make-model``,
   RANDOM weights, 4 MoE layers: 6 GiB of experts) replaying recorded routing held out from
   the predictors' tables: the GPU-resident model, then on-demand, lru-only, stmoe,
   stmoe-plus, the oracle and stmoe-plus-score at 25% and 50% of the experts in HBM, from
   pinned memory (``--tier gpu``) and from disk (``--tier gpu-disk``), and at 50% from
   pinned memory stmoe-plus-split (each layer's cache its own size, the same total, sized
   from the profiled tokens alone): decode tokens/s, hit rate, PCIe bytes, stall share (host
   and device), achieved copy bandwidth, the caches it ran with, tokens identical;
5. ``accelerate_offload``: accelerate's ``device_map`` with half the layers' experts in host
   memory (the same HBM budget as 50%), the same routing forced;
6. ``calibrate_simulator``: ``stmoe calibrate --tier gpu`` on that checkpoint, and the
   simulator's prediction of each system at 50% beside the measured one;
7. ``cuda_tests``: the ``cuda``-marked tests (the kernels, the GPU tiers, int8/int4);
8. ``tier_gpu``: the shipped model on ``--tier gpu`` against the GPU-resident one.

The recorded routing is the shared sample (../shared/traces, which the project cannot ship):
``--prepare`` copies its first 8 layers to out/gpu_check/routing.npz (ignored by git), to be
carried to the GPU machine with the crc32c wheel (gpu_check.sh's header), with
stmoe-plus-split's caches sized in it (the GPU machine would compile numba's replay kernels
for about 20 s to size them; the JSON's ``split.sized`` says which it used).

``--dry-run`` runs every stage's plumbing on the CPU with tiny sizes and synthetic routing,
the gpu tiers on the CPU's stand-in for a GPU: its figures are not measurements of anything.
``--rehearse`` is a dry run of what the GPU run makes and reads: the real-shape checkpoint
(bfloat16, one MoE layer unless ``--layers``: 1.5 GiB of experts in a temporary folder,
removed at the end) and the recorded routing (``--prepare`` first), on the CPU (minutes).

The stages, the JSON and the targets are ``stmoe.runtime.gpu_check``'s (``run_stages``,
tested there with a dry run); this is its CLI.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

from stmoe.errors import StmoeError
from stmoe.runtime.gpu_check import STAGES, git_head, prepare_routing, run_stages, target_lines
from stmoe.runtime.gpu_check.rerun import read_rerun
from stmoe.runtime.gpu_check.setup import CARRIED

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "traces"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON (default docs/results/gpu_check.json; a dry run: "
                         "out/gpu_check.dry-run.json)")
    ap.add_argument("--dry-run", "--device-cpu", dest="dry", action="store_true",
                    help="every stage's plumbing on the CPU, tiny sizes: no measurement")
    ap.add_argument("--rehearse", action="store_true",
                    help="a dry run at the real shape: the GPU run's checkpoint (1 MoE layer "
                         "unless --layers) and recorded routing, on the CPU; no measurement")
    ap.add_argument("--prepare", action="store_true",
                    help=f"write {CARRIED} from {SHARED} (to carry to the GPU machine)")
    ap.add_argument("--commit", default=os.environ.get("STMOE_COMMIT"),
                    help="the commit checked (default: $STMOE_COMMIT, else git's HEAD)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation")
    ap.add_argument("--layers", type=int, default=None,
                    help="the decode table's MoE layers (default 4; 8 at most)")
    ap.add_argument("--routing", type=Path, default=None,
                    help=f"a trace to replay (default {CARRIED}, else the shared sample)")
    ap.add_argument("--rerun", type=Path, default=None, metavar="JSON",
                    help="a former run's JSON: run again only its stages that did not finish "
                         "ok (or --stages), keep the rest (default --out: that JSON)")
    ap.add_argument("--stages", default=None,
                    help=f"with --rerun, the stages to run again, comma-separated "
                         f"({', '.join(STAGES)}); those that read them run too")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stages (and decode-table runs) still to start after this many "
                         "seconds are skipped")
    a = ap.parse_args()
    a.dry = a.dry or a.rehearse
    if a.prepare:
        print(f"wrote {prepare_routing(SHARED, REPO / CARRIED)}")
        return
    try:
        earlier, names = read_rerun(a.rerun, a.stages, list(STAGES))
    except StmoeError as exc:
        ap.error(str(exc))
    chosen = {n: STAGES[n] for n in names} if names is not None else None
    if earlier is not None and chosen is not None:
        print(f"running again: {', '.join(chosen)}; kept from {a.rerun}: "
              f"{', '.join(n for n in earlier['stages'] if n not in chosen) or 'none'}")
    out = a.out or a.rerun or REPO / ("out/gpu_check.rehearsal.json" if a.rehearse else
                                      "out/gpu_check.dry-run.json" if a.dry else
                                      "docs/results/gpu_check.json")
    commit = a.commit or git_head(REPO)
    # a hang (a copy that never lands) leaves every thread's stack in the output before the
    # machine's own limit kills the command
    faulthandler.dump_traceback_later(a.budget_s + 90.0, exit=False)
    made = None  # the shipped model's store is packed under a cache of this run's own
    if "STMOE_CACHE" not in os.environ:
        made = os.environ["STMOE_CACHE"] = tempfile.mkdtemp(prefix="stmoe-gpu-check-cache-")
    try:
        doc = run_stages(out, dry_run=a.dry, commit=commit, repo=REPO, tokens=a.tokens,
                         budget_s=a.budget_s, layers=a.layers, routing=a.routing,
                         real_shape=a.rehearse, stages=chosen, earlier=earlier)
    except StmoeError as exc:  # before any stage ran: the earlier run's stages do not fit
        ap.error(f"--rerun {a.rerun}: {exc}")
    finally:
        if made is not None:  # (each run had left one behind: 28 MB)
            shutil.rmtree(made, ignore_errors=True)
    for line in target_lines(doc):
        print(line)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
