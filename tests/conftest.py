"""Shared fixtures: the real sample in ../shared/traces and a CLI runner."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stmoe.cli import app

# Tests never write into the user's ~/.cache/stmoe: stores packed on first use (a 27 MB
# one for the shipped model) go to a cache of this session, set before any test runs and
# inherited by the commands tests start (runtime.store.default_store_dir reads it).
TEST_CACHE = Path(tempfile.mkdtemp(prefix="stmoe-test-cache-"))
os.environ["STMOE_CACHE"] = str(TEST_CACHE)
# vLLM names an IPC socket per engine in VLLM_RPC_BASE_PATH (default: /tmp) and leaves it
# there (about 200 a run of tests/vllm_plugin): this session's go into a folder of its own,
# removed with the cache (each xdist worker has its own)
VLLM_SOCKETS = Path(tempfile.mkdtemp(prefix="stmoe-test-vllm-ipc-"))
os.environ.setdefault("VLLM_RPC_BASE_PATH", str(VLLM_SOCKETS))

# Property tests draw new cases on a developer's machine (a failing one is kept in .hypothesis/
# and replayed there); CI (CI=true) draws one fixed set, so a submission's CI passes or fails
# on its code, not on the cases one run happened to draw (a fuzzed-index failure, once).
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:  # (an environment without the test tools' hypothesis: the vLLM one)
    pass

REPO = Path(__file__).resolve().parents[1]
SHARED_TRACES = Path(os.environ.get("STMOE_SHARED", REPO.parent / "shared")) / "traces"
REAL_ROUTES = SHARED_TRACES / "qwen3.6-35b-a3b_chat-1prompt.routes.json"
REAL_NPZ = SHARED_TRACES / "qwen3.6-35b-a3b_chat-1prompt.npz"

# The predictor names the eval issue fixes as a contract (tools outside the project parse them).
CONTRACT_PREDICTORS = (
    "stmoe", "ondemand", "previous-token", "cct-static", "cct-online", "frequency", "random",
    "oracle", "stmoe-plus",
)

needs_shared = pytest.mark.skipif(
    not (REAL_ROUTES.exists() and REAL_NPZ.exists()),
    reason=f"the real sample traces are not at {SHARED_TRACES} "
    "(set STMOE_SHARED to the shared/ folder)",
)


def distinct_slots(look):
    """A stand-in gate lookahead ``[T, L, J]`` made legal: an id repeated later in a row
    (``(experts + 3) % N`` can meet a true expert) becomes -1, as validate requires."""
    import numpy as np

    look = np.array(look, dtype=np.int16)
    for j in range(1, look.shape[2]):
        seen = (look[:, :, :j] == look[:, :, j : j + 1]).any(axis=2)
        look[:, :, j][seen & (look[:, :, j] >= 0)] = -1
    return look


def one_line_error(result, *fragments: str) -> None:
    """The CLI refused with exit 1 and one ``error:`` line holding every fragment."""
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, (fragment, result.output)


class Cli:
    """Runs ``stmoe ARGS`` in-process and returns click's result."""

    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: str | os.PathLike[str]):
        return self.runner.invoke(app, [str(a) for a in args], prog_name="stmoe")


@pytest.fixture
def cli() -> Cli:
    return Cli()


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory: pytest.TempPathFactory):
    """``stmoe demo --quick`` once per session: (click's result, the report folder), read by
    tests/demo/test_demo.py and tests/demo/test_report_browser.py (about 30 s)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("quick-demo") / "demo"
    return Cli()("demo", "--quick", "-o", folder), folder


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(TEST_CACHE, ignore_errors=True)
    shutil.rmtree(VLLM_SOCKETS, ignore_errors=True)


# ---- tests/vllm_plugin, split over pytest-xdist's workers (``make test-vllm``: ``-n 2
# --dist loadfile --no-loadscope-reorder``: a file's tests, and so its engines' fixtures, in
# one worker), the longest files first, each worker's vLLM engines on a core of their own.
# Here, not in a tests/vllm_plugin/conftest.py, for the reason given below for tests/serve.
#
# Why: a vLLM run here is mostly process starts and imports (an engine core and a worker
# process per ``LLM``), so two files side by side halve the suite's time on two cores
# (journal 2026-12-06). xdist hands the files out in collection order, so the files whose
# engines take minutes go first, longest first, and the two workers end close together.
# vLLM's CPU worker binds its compute to cores it picks (``VLLM_CPU_OMP_THREADS_BIND=auto``:
# core 0 for every engine), so two workers' engines would take turns on core 0 while core 1
# idled: worker ``gwN`` binds its engines to core ``N`` (modulo the CPUs there are) unless
# the caller set the variable.
VLLM_BIND = "VLLM_CPU_OMP_THREADS_BIND"
# the files with minutes of engine runs, in the order that ends the two workers closest
# together (xdist gives a worker its next file once two of its tests are left, so the order
# was chosen by simulating that rule over each file's `pytest --durations` on 2 cores: about
# 3, 3, 0.8, 1.8, 1, 1.3 minutes; int8's are skipped without AMX); the others take seconds.
# (2026-12-08, most runs in one process (vllm_runs.drive), on a slower VM: 3.0, 5.4, 1.7,
# 1.9, 0.9, 1.0 minutes; 444 s in all, the two workers ending within a minute)
VLLM_LONGEST_FIRST = ("test_live.py", "test_docs.py", "test_live_refusals.py",
                      "test_own_formats.py", "test_live_bf16.py", "test_forced_live.py",
                      "test_int8_experts.py")


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...; unset: no xdist
    if worker.startswith("gw") and VLLM_BIND not in os.environ:
        cpus = sorted(os.sched_getaffinity(0))
        os.environ[VLLM_BIND] = str(cpus[int(worker[2:]) % len(cpus)])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(VLLM_LONGEST_FIRST)}
    vllm = REPO / "tests" / "vllm_plugin"
    items.sort(key=lambda item: rank.get(item.path.name, len(rank))
               if item.path.parent == vllm else len(rank))  # (stable: the rest keep theirs)


# ---- tests/serve: the live server of the shipped model (per test module) and its solo runs.
# Here, not in a tests/serve/conftest.py: every folder imports ``from conftest import ...``,
# and a second module named conftest would answer some of those imports.
@pytest.fixture(scope="module")
def server():
    """`stmoe serve` of the shipped model at 50%: (url, its Service); 3 running, 2 queued."""
    pytest.importorskip("fastapi")
    from serve_live import NAME

    from stmoe.models import SHIPPED_MODEL
    from stmoe.runtime.api import offload
    from stmoe.serve.runner import ServerThread
    from stmoe.serve.service import Service

    om = offload(SHIPPED_MODEL, capacity="50%", predictor="stmoe-plus")
    service = Service(om, NAME, max_batch=3, max_queue=2)
    try:
        with ServerThread(service) as url:
            yield url, service
    finally:
        om.close()


@pytest.fixture(scope="module")
def solo():
    """The resident model's greedy output, alone (``serve_live.Solo``)."""
    from serve_live import Solo
    from transformers import AutoModelForCausalLM

    from stmoe.models import SHIPPED_MODEL

    return Solo(AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL).eval())
