"""The vLLM tests split over pytest-xdist's workers (``make test-vllm``: ``-n 2 --dist
loadfile --no-loadscope-reorder``: a file's tests, and so its engines' fixtures, in one
worker), the longest files first, each worker's vLLM engines bound to a core of their own.

Why: a vLLM run here is mostly process starts and imports (an engine core and a worker
process per ``LLM``), so two files side by side cut the suite's time on two cores by about
a third (journal 2026-12-06). xdist hands the files out in collection order, so the files
whose engines take minutes go first, longest first: the two workers end close together.
vLLM's CPU worker binds its compute to cores it picks (``VLLM_CPU_OMP_THREADS_BIND=auto``:
core 0 for every engine), so two workers' engines would take turns on core 0 while core 1
idled; worker ``gwN`` binds its engines to core ``N`` (modulo the CPUs there are) unless
the caller set the variable.
"""

from __future__ import annotations

import os

import pytest

BIND = "VLLM_CPU_OMP_THREADS_BIND"
# the files with minutes of engine runs, longest first (`pytest --durations` on 2 cores:
# about 6.5, 2.7, 2.6, 2.5 and 2.1 minutes); the others take seconds
LONGEST_FIRST = ("test_live.py", "test_docs.py", "test_own_formats.py",
                 "test_int8_experts.py", "test_forced_live.py")


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...; unset: no xdist
    if worker.startswith("gw") and BIND not in os.environ:
        cpus = sorted(os.sched_getaffinity(0))
        os.environ[BIND] = str(cpus[int(worker[2:]) % len(cpus)])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # (stable)
