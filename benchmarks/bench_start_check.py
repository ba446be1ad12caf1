"""What the vLLM plugin's start check costs (docs/vllm.md, A damaged block).

With ``experts=loaded`` the plugin reads and checks every block of its store once at each
start (``kernel_store.first_damaged``), reading the next block while one is checked. This
times that check on a store against the same blocks read and checked in turn (each through
``ExpertStore.read``, the runtime's plain read: the baseline), in rotated rounds, the page
cache dropped for the data file before each, and prints the medians, ranges, rates and the
ratio with MET / NOT MET (target: the overlapped check at least 1.2x faster than in turn).
The check reads blocks only, so a store of the checkpoint's layout (``stmoe pack``) times it
as the plugin's kernel-layout store would.

    python benchmarks/bench_start_check.py --store STORE [--rounds 5]

STORE: e.g. ``stmoe make-model --like qwen1.5-moe-a2.7b --layers 8 -o ck`` (8.5 GiB,
RANDOM weights), then ``stmoe pack ck -o STORE`` (7.7 GiB of experts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from stmoe.evaluate.compare import rotated, spread, verdict
from stmoe.runtime.store import ExpertStore
from stmoe.vllm_plugin.kernel_store import first_damaged

TARGET = 1.2


def in_turn(store: ExpertStore) -> None:
    """The baseline: each block read, then checked, one after the other."""
    fd = os.open(store.data_file, os.O_RDONLY)
    try:
        for block in sorted(store.blocks.values(), key=lambda b: b.offset):
            store.read(block.layer, block.expert, fd)
            os.posix_fadvise(fd, block.offset, block.nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def overlapped(store: ExpertStore) -> None:
    found = first_damaged(store)
    if found is not None:
        raise SystemExit(f"the store is damaged: {found}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    store = ExpertStore(args.store)
    size = sum(b.nbytes for b in store.blocks.values())
    print(f"{args.store}: {len(store.blocks)} blocks, {size / 2**30:.2f} GiB; load "
          f"{os.getloadavg()[0]:.2f}")
    runs = {"in turn": in_turn, "overlapped": overlapped}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(args.rounds):
        for name in rotated(list(runs), rnd):
            fd = os.open(store.data_file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[name](store)
            seconds[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    store.close()
    for name in runs:
        rate = size / statistics.median(seconds[name]) / 2**30
        print(f"{name:>10}: {spread(seconds[name])} s (median [min, max]), {rate:.2f} GiB/s; "
              f"CPU {spread(cpu[name])} s")
    ratio = statistics.median(seconds["in turn"]) / statistics.median(seconds["overlapped"])
    print(f"  {verdict(ratio >= TARGET):8} the overlapped check at least {TARGET}x faster than "
          f"in turn ({ratio:.2f}x); load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
