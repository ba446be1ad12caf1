"""stmoe's own int4 and int8 experts inside vLLM (``format=int4``/``int8``): stmoe's shipped
model (float32), its experts packed by stmoe into its own quantized store (the model's cached
one, as ``stmoe pack --format`` writes it) and computed by stmoe's kernels, gives at top-k and
50% of the experts cached the very tokens it gives with every expert cached (the model
resident in that format), at 8, 4 and 1 concurrent requests; vLLM never loads the experts;
the format is named in vLLM's log. Skipped where vLLM is not installed (``make test`` runs
these in ``.venv-vllm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")

from stmoe.models import SHIPPED_MODEL
from stmoe.quant.formats import WeightFormat
from stmoe.runtime.store import ExpertStore
from stmoe.runtime.store.packing import default_store_dir
from stmoe.vllm_plugin.own_format import TENSORS
from vllm_runs import BATCHES, drive, run_env

NEW = 12
RUNS = [("int4 100%", "format=int4,capacity=100%,predictor=ondemand"),
        # top-k and 50% of the layer in turn (an engine start a setting: one run for both)
        ("int4 top-k and 50%, stmoe-plus",
         "format=int4,capacity=4/8/4/8/4/8/4/8,predictor=stmoe-plus"),
        ("int8 100%", "format=int8,capacity=100%,predictor=ondemand"),
        ("int8 50%, lru-only", "format=int8,capacity=50%,predictor=ondemand,experts=stream")]


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-own")
    runs = [{"name": name, "stmoe": text, "max_tokens": NEW, "batches": BATCHES}
            for name, text in RUNS]
    results, log = drive(tmp, SHIPPED_MODEL, runs, prefix_caching=False)
    return tmp, results, log


def test_int4_and_int8_experts_give_the_tokens_of_every_expert_cached(driven):
    _, runs, _ = driven
    for fmt in ("int4", "int8"):
        ref = runs[f"{fmt} 100%"]["tokens"]
        assert all(len(t) == NEW for b in ref for t in b)
        for name, _ in RUNS:
            if name.startswith(fmt):
                assert runs[name]["tokens"] == ref, name


def test_the_log_names_the_format_and_the_store_is_stmoes_own(driven, monkeypatch):
    tmp, _, log = driven
    lines = [x for x in log.splitlines() if "stmoe: offloading 8 MoE layers" in x]
    assert len(lines) == len(RUNS)
    assert sum("experts int4 (groups of 32, lossy), stmoe's store and kernels, stream" in x
               for x in lines) == 2
    assert sum("experts int8 (per output channel, lossy), stmoe's store and kernels" in x
               for x in lines) == 2
    # packed once per format, then checked
    assert sum("packed now" in x for x in lines) == 2
    monkeypatch.setenv("STMOE_CACHE", run_env(tmp)["STMOE_CACHE"])
    for name in ("int4", "int8"):
        store = ExpertStore(default_store_dir(SHIPPED_MODEL, WeightFormat(name)))
        assert store.weights.name == name
        assert tuple(sorted(t.name for t in store.blocks[(0, 0)].tensors)) == TENSORS
