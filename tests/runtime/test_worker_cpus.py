"""The prefetch workers' CPUs: a runtime that binds its compute thread to some cores (vLLM's
CPU worker does, and threads inherit the binding) gives the workers the others; each worker
pins itself as it starts, and only itself."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from stmoe.runtime.prefetch import Prefetcher


def _state() -> SimpleNamespace:
    lock = threading.Lock()
    return SimpleNamespace(lock=lock, cv=threading.Condition(lock), max_block=4096,
                           copy_stream=lambda: None)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell them apart")
def test_each_worker_pins_itself_to_the_cpus_it_is_given():
    allowed = sorted(os.sched_getaffinity(0))
    want = {allowed[-1]}
    p = Prefetcher(_state(), 2, cpus=want)
    p.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
                os.sched_getaffinity(t.native_id) != want for t in p._threads):
            time.sleep(0.01)
        assert [os.sched_getaffinity(t.native_id) for t in p._threads] == [want, want]
        assert os.sched_getaffinity(0) == set(allowed)  # the caller's own are untouched
    finally:
        p.close()


def test_without_cpus_the_workers_keep_the_starting_threads():
    p = Prefetcher(_state(), 1)
    p.start()
    try:
        time.sleep(0.05)
        assert os.sched_getaffinity(p._threads[0].native_id) == os.sched_getaffinity(0)
    finally:
        p.close()
