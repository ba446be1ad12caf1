"""``routing=TRACE`` inside vLLM (measurement only): stmoe's shipped model driven by a trace's
routing in place of its router's gives tokens that are not plain vLLM's (the routing did
change), and the same tokens at top-k with stmoe-plus as with every expert cached (the cache
stays lossless on the forced routing), at 8, 4 and 1 concurrent requests; the log line says
the routing is forced (a predictor that reads the model's own routers is refused as the
settings are read: test_config.py). The trace is SYNTHETIC (the shipped model's shape):
the mechanism is tested, not a predictor.
Skipped where vLLM is not installed (``make test`` runs these in ``.venv-vllm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")

from stmoe.models import SHIPPED_MODEL
from stmoe.trace import save_trace, synthesize
from vllm_runs import BATCHES, drive

NEW = 8


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-forced")
    routing = save_trace(synthesize(tokens=300, layers=8, experts=16, top_k=4, sequences=3,
                                    seed=4), tmp / "routing.npz")
    runs = [{"name": "plain", "stmoe": None, "max_tokens": NEW, "batches": BATCHES},
            {"name": "forced 100%", "max_tokens": NEW, "batches": BATCHES,
             "stmoe": f"capacity=100%,predictor=ondemand,routing={routing}"},
            {"name": "forced top-k", "max_tokens": NEW, "batches": BATCHES,
             "stmoe": f"capacity=4,predictor=stmoe-plus,routing={routing}"}]
    results, log = drive(tmp, SHIPPED_MODEL, runs, prefix_caching=False)
    return tmp, routing, results, log


def test_forced_routing_changes_the_tokens_and_the_cache_stays_lossless_on_it(driven):
    _, _, runs, log = driven
    assert runs["forced top-k"]["tokens"] == runs["forced 100%"]["tokens"]
    assert runs["forced 100%"]["tokens"] != runs["plain"]["tokens"]
    lines = [x for x in log.splitlines() if "stmoe: offloading 8 MoE layers" in x]
    assert len(lines) == 2 and all(
        "routing FORCED from synthetic (routing.npz, 300 tokens): the tokens are meaningless"
        in x for x in lines), lines

