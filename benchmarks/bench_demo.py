"""Wall time of the main job, `stmoe demo` (target: at most 5 minutes on 2 cores).

Runs the full demo in a subprocess, as a user would, and prints its time as a
share of the target. Run it once with numba's kernel cache cleared to see the
fresh-install cost (compiling the kernels), and again to see the warm cost.

    python benchmarks/bench_demo.py [--output DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

TARGET_S = 300.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=None, help="demo folder (default: a temporary one)")
    args = parser.parse_args()
    folder = args.output or tempfile.mkdtemp(prefix="stmoe-demo-")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stmoe", "demo", "-o", folder], check=True,
                   stdout=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    verdict = "PASS" if elapsed <= TARGET_S else "FAIL"
    print(f"stmoe demo: {elapsed:.1f} s = {elapsed / TARGET_S:.2f} of the {TARGET_S:.0f} s target "
          f"({verdict}); report in {folder}/index.html")


if __name__ == "__main__":
    main()
