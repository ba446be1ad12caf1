"""--memory: one budget for the whole process, the cache sized from it, and honoured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import one_line_error  # noqa: E402
from stmoe.errors import OffloadError  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.memory import KV_RESERVE, plan_memory  # noqa: E402
from stmoe.runtime.store import pack  # noqa: E402
from stmoe.util.cgroup import cgroup_peak, make_cgroup, remove_cgroup  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

MIB = 1 << 20


def test_the_plan_hand_worked():
    """4 layers of 10 experts of 10 MiB, top-2, 2 workers (3 read buffers: 30 MiB), a
    process of 500 MiB. All 400 MiB of experts fit in 500 + 256 + 30 + 400 MiB: 10 a layer,
    no spare rows. 1 MiB less: L x C + (N - C) experts must fit in 399 MiB, C = (399 - 100) /
    30 = 9 (rounded down); the reserve then holds the prompt's 1 spare row."""
    base = 500 * MIB + KV_RESERVE + 30 * MIB
    full = plan_memory(base + 400 * MIB, 500 * MIB, 4, 10, 2, 10 * MIB, 2)
    assert (full.per_layer, full.cache, full.reserve) == (10, 400 * MIB, KV_RESERVE + 30 * MIB)
    less = plan_memory(base + 399 * MIB, 500 * MIB, 4, 10, 2, 10 * MIB, 2)
    assert (less.per_layer, less.cache) == (9, 360 * MIB)
    assert less.reserve == KV_RESERVE + 30 * MIB + 10 * MIB
    assert less.process + less.reserve + less.cache <= less.memory
    # top-2 needs 3 x 2 + 10 experts: 500 + 256 + 30 + 160 = 946 MiB = 0.92 GiB
    with pytest.raises(OffloadError, match=r"cannot hold .* top-2 .* give at least 0\.92 GiB "
                                           r"\(--memory 946MiB\)$"):
        plan_memory(base + 100 * MIB, 500 * MIB, 4, 10, 2, 10 * MIB, 2)
    assert plan_memory(946 * MIB, 500 * MIB, 4, 10, 2, 10 * MIB, 2).per_layer == 2  # it does


def test_offload_sizes_its_cache_from_the_budget(tmp_path):
    model, _ = tiny_model("qwen3_moe")
    store = pack(model, tmp_path / "store")
    with offload(tiny_model("qwen3_moe")[0], store, memory="64GB", predictor="ondemand") as om:
        plan = om.config["memory_plan"]
        assert om.config["capacity"] == plan["per_layer"] == 8  # everything fits in 64 GB
        assert plan["memory"] == 64 * 10**9 and plan["process"] > 0
    with pytest.raises(OffloadError, match="give capacity or memory, not both"):
        offload(tiny_model("qwen3_moe")[0], store, memory="1GB", capacity=4)
    with pytest.raises(OffloadError, match=r"--memory .* cannot hold"):
        offload(tiny_model("qwen3_moe")[0], store, memory="10MB", predictor="ondemand")
    with pytest.raises(OffloadError, match="--memory"):
        offload(tiny_model("qwen3_moe")[0], store, memory="lots")
    # the emulated link reads a host copy of the whole store, which the plan never counted
    with pytest.raises(OffloadError, match="emulated tier keeps the whole store in host"):
        offload(tiny_model("qwen3_moe")[0], store, memory="64GB", tier="emulated",
                bandwidth="1GB")


def test_the_budget_measures_the_process_with_its_predictor_made(tmp_path, monkeypatch):
    """The predictor (its tables, stmoe-plus's compiled kernels: tens of MiB) is made
    before the process is measured, so the cache's share of the budget leaves room for it."""
    import stmoe.runtime.api as api
    import stmoe.runtime.placement as placement

    order = []
    real_resolve, real_measure = api.resolve_predictor, placement.process_bytes
    monkeypatch.setattr(api, "resolve_predictor",
                        lambda *a: order.append("predictor") or real_resolve(*a))
    monkeypatch.setattr(placement, "process_bytes",
                        lambda m: order.append("measured") or real_measure(m))
    store = pack(tiny_model("qwen3_moe")[0], tmp_path / "store")
    with offload(tiny_model("qwen3_moe")[0], store, memory="64GB", predictor="ondemand"):
        assert order == ["predictor", "measured"]


def test_the_cli_refuses_both_and_prints_the_split(cli):
    one_line_error(cli("generate", "--prompt", "x", "--memory", "2GB", "--capacity", "4"),
                   "give --capacity or --memory, not both")
    res = cli("generate", "--prompt", "def f(", "--max-new-tokens", "2", "--memory", "2GB",
              "--json", "-")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config"]["memory_plan"]["per_layer"] == 16


@pytest.mark.parametrize("store", ["packed", "in-place"])
def test_a_process_under_a_cgroup_of_its_budget_stays_within_it(store, tmp_path):
    """The shipped model under a memory cgroup of exactly --memory (page cache included),
    its experts from a packed store or read in place from its checkpoint: it generates,
    and the cgroup's peak stays within the bound. Skipped where no memory cgroup can be
    made (an unprivileged container)."""
    limit = int(1.2 * 2**30)
    group = make_cgroup(f"stmoe-test-memory-{tmp_path.name}", limit)
    if group is None:
        pytest.skip("no memory cgroup can be made here")
    try:
        code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
                "from stmoe.cli import app; sys.argv = ['stmoe'] + sys.argv[2:]; app()")
        done = subprocess.run([sys.executable, "-c", code, str(group), "generate", "--prompt",
                               "def fib(n):", "--max-new-tokens", "16", "--memory", str(limit),
                               "--store", str(_store(tmp_path, store))],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        peak = cgroup_peak(group)
        assert peak is None or peak <= limit, (peak, limit)
    finally:
        remove_cgroup(group)


def _store(tmp_path: Path, kind: str = "packed") -> Path:
    from stmoe.models import SHIPPED_MODEL
    from stmoe.runtime.store import pack_folder
    from stmoe.runtime.store.in_place_index import make_in_place

    if kind == "in-place":
        return make_in_place(SHIPPED_MODEL, tmp_path / "store")
    return pack_folder(SHIPPED_MODEL, tmp_path / "store")
