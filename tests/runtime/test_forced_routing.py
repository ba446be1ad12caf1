"""Routing replay: a trace's choices, forward call by forward call, in place of the router's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stmoe.runtime.forced_routing import (  # noqa: E402
    ForcedRouting,
    ForcedRoutingError,
    RoutingSource,
    plan_routing,
)
from stmoe.trace.schema import RoutingTrace, TraceMeta  # noqa: E402


def _trace(prefill: int = 3, decode: int = 4, layers: int = 5, weights: bool = True):
    rng = np.random.default_rng(0)
    t = prefill + decode
    experts = np.stack([np.stack([rng.choice(16, 4, replace=False) for _ in range(layers)])
                        for _ in range(t)]).astype(np.int16)
    w = rng.random((t, layers, 4)).astype(np.float32) if weights else None
    return RoutingTrace(experts, np.array([0]), np.arange(t) >= prefill,
                        TraceMeta(num_experts=16, top_k=4, num_layers=layers, model="m"),
                        weights=w, token_ids=np.arange(100, 100 + t))


def test_each_forward_call_gets_its_tokens_routing():
    trace = _trace()
    plan = plan_routing(trace, 0, num_layers=3, num_experts=16, top_k=4, vocab_size=4096)
    assert plan.prefill == 3 and plan.decode_steps == 4 and plan.new_tokens == 5
    assert plan.token_ids == [100, 101, 102]
    replay = RoutingSource(plan)
    ids = torch.zeros((3, 4), dtype=torch.long)
    w = torch.zeros((3, 4), dtype=torch.bfloat16)
    got_ids, got_w = replay.routing(0, 2, ids, w)
    assert got_ids.tolist() == trace.experts[0:3, 2].tolist()
    assert got_w.dtype == torch.bfloat16
    assert torch.equal(got_w, torch.from_numpy(trace.weights[0:3, 2]).to(torch.bfloat16))
    for step in range(1, 5):  # decode call j: the trace's decode token j - 1
        got_ids, _ = replay.routing(step, 1, ids[:1], w[:1])
        assert got_ids.tolist() == trace.experts[2 + step : 3 + step, 1].tolist()
    with pytest.raises(ForcedRoutingError, match="forward call 5"):
        replay.routing(5, 0, ids[:1], w[:1])
    with pytest.raises(ForcedRoutingError, match="computes 2"):
        replay.routing(1, 0, ids[:2], w[:2])


def test_uniform_weights_and_foreign_vocabulary():
    plan = plan_routing(_trace(weights=False), 0, 5, 16, 4, vocab_size=50)
    assert np.all(plan.weights == 0.25)
    assert all(0 <= t < 50 for t in plan.token_ids)


@pytest.mark.parametrize(("kw", "message"), [
    ({"num_experts": 8}, "top-4 of 16 experts but the model top-4 of 8"),
    ({"top_k": 2}, "top-2 of"),
    ({"num_layers": 6}, "at most 5"),
    ({"sequence": 1}, r"outside 0\.\.0"),
])
def test_a_trace_of_another_shape_is_refused(kw, message):
    args = {"sequence": 0, "num_layers": 5, "num_experts": 16, "top_k": 4, "vocab_size": 99}
    args.update(kw)
    with pytest.raises(ForcedRoutingError, match=message):
        plan_routing(_trace(), **args)


@pytest.fixture(scope="module")
def replay_setup(tmp_path_factory):
    """A 3-layer random checkpoint of the shipped model's shape, a SYNTHETIC trace of
    that shape, its tables and the store."""
    pytest.importorskip("transformers")
    from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint
    from stmoe.predictors import profile, save_tables
    from stmoe.runtime.store import pack
    from stmoe.trace import save_trace
    from stmoe.trace.synth import synthesize

    root = tmp_path_factory.mktemp("replay")
    model_dir = make_checkpoint(plan_checkpoint("stmoe-tiny", layers=3, dtype="float32"),
                                root / "m")
    trace = synthesize(tokens=60, layers=5, experts=16, top_k=4, sequences=2, seed=1)
    save_trace(trace, root / "t.npz")
    from stmoe.trace.select import first_layers

    save_tables(profile(first_layers(trace, 3)), root / "tables.npz")
    from stmoe.hf.loading import load_causal_lm

    pack(load_causal_lm(model_dir), root / "store", source=model_dir)
    return root, model_dir, trace


def _resident_replay(model_dir, plan):
    """Plain transformers with the same routing forced on every experts module."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ForcedRouting(model, plan)
    ids = torch.tensor([plan.token_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens,
                             pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("predictor", ["stmoe-plus", "oracle"])
def test_replay_feeds_the_trace_to_cache_and_predictor_losslessly(replay_setup, predictor):
    from stmoe.runtime.api import offload

    root, model_dir, trace = replay_setup
    plan = plan_routing(trace, 1, num_layers=3, num_experts=16, top_k=4, vocab_size=4096)
    seen = {}
    tables = root / "tables.npz" if predictor == "stmoe-plus" else None  # (the oracle takes none)
    with offload(model_dir, root / "store", capacity=8, predictor=predictor, tables=tables,
                 tier="emulated", bandwidth="200MB") as om:
        after = om.engine.planner.after_routing

        def record(layer, rows, hidden):
            seen[(om.engine.run.fwd, layer)] = rows.copy()
            return after(layer, rows, hidden)

        om.engine.planner.after_routing = record
        result = om.force_routing(plan)
    assert result.text == "" and result.config["routing_replay"]
    assert len(result.tokens) == plan.new_tokens
    a = int(trace.seq_starts[1])
    for layer in range(3):  # the prompt, then every decode token, as recorded
        assert seen[(0, layer)].tolist() == trace.experts[a : a + plan.prefill, layer].tolist()
        for step in range(1, plan.new_tokens):
            pos = a + plan.prefill + step - 1
            assert seen[(step, layer)].tolist() == [trace.experts[pos, layer].tolist()]
    assert result.tokens == _resident_replay(model_dir, plan)  # bit for bit


def test_generate_cli_replays_and_refuses_a_foreign_shape(replay_setup, cli):
    root, model_dir, _ = replay_setup
    args = ["generate", "--model", model_dir, "--store", root / "store", "--capacity", "8",
            "--predictor", "stmoe", "--tables", root / "tables.npz", "--routing",
            root / "t.npz", "--sequence", "1"]
    res = cli(*args, "--json", "-")
    assert res.exit_code == 0, res.output
    import json

    data = json.loads(res.stdout)
    assert data["text"] == "" and data["config"]["routing_replay"] is True
    res = cli(*args)  # the table says how many reads and how long one took
    assert res.exit_code == 0, res.output
    import re

    row = re.search(r"reads of the tier \(decode\)\W+(\d+)(, [\d.]+ ms each)? by the compute "
                    r"thread \(its misses\), (\d+)(, [\d.]+ ms each)? by the prefetch workers",
                    " ".join(res.output.split()))
    assert row is not None, res.output
    for count, each in ((row[1], row[2]), (row[3], row[4])):
        assert (int(count) > 0) == (each is not None), row[0]  # a time where there were reads
    assert int(row[1]) + int(row[3]) > 0, row[0]  # a cache of 8 of 16 experts reads some
    res = cli(*args[:-2], "--sequence", "5")
    assert res.exit_code == 1 and "outside 0..1" in res.output
    res = cli(*args, "--prompt", "hi")
    assert res.exit_code == 1 and "not both" in res.output
    from stmoe.trace import save_trace
    from stmoe.trace.synth import synthesize

    save_trace(synthesize(tokens=20, layers=3, experts=32, top_k=4, sequences=1),
               root / "wide.npz")
    res = cli(*args[:-4], "--routing", root / "wide.npz")
    assert res.exit_code == 1 and "top-4 of 32 experts" in res.output


def test_profile_the_first_layers_for_a_cut_model(replay_setup, cli):
    from stmoe.predictors import load_tables

    root, _, _ = replay_setup
    res = cli("profile", root / "t.npz", "--layers", "3", "-o", root / "t3.npz")
    assert res.exit_code == 0, res.output
    assert load_tables(root / "t3.npz").shape.num_layers == 3
    res = cli("profile", root / "t.npz", "--layers", "9", "-o", root / "t9.npz")
    assert res.exit_code == 1 and "1..5" in res.output


def test_tables_a_predictor_does_not_take_are_named_not_silently_ignored(replay_setup, cli):
    root, model_dir, _ = replay_setup
    res = cli("generate", "--model", model_dir, "--store", root / "store", "--capacity", "8",
              "--predictor", "ondemand", "--tables", root / "tables.npz", "--routing",
              root / "t.npz", "--max-new-tokens", "2")
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "predictor 'ondemand' takes no profiled tables" in said and "tables.npz" in said


def test_refusals_name_the_traces_file_not_its_model_label(tmp_path):
    """Issue 30, item 9: the model label of a trace ("m") says nothing about which file."""
    where = tmp_path / "routing.npz"
    for kw in ({"num_experts": 8}, {"num_layers": 6}, {"sequence": 1}):
        args = {"sequence": 0, "num_layers": 5, "num_experts": 16, "top_k": 4, "vocab_size": 99,
                **kw}
        with pytest.raises(ForcedRoutingError) as caught:
            plan_routing(_trace(), **args, source=where)
        assert str(caught.value).startswith(f"{where}: "), caught.value
        assert "'m'" not in str(caught.value)


def test_more_new_tokens_than_the_routing_holds_is_a_note(replay_setup, cli):
    """Issue 30, item 9: --max-new-tokens 500 on a sequence routing fewer gave fewer
    tokens without a word."""
    root, model_dir, trace = replay_setup
    plan = plan_routing(trace, 1, num_layers=3, num_experts=16, top_k=4, vocab_size=4096)
    args = ["generate", "--model", model_dir, "--store", root / "store", "--capacity", "8",
            "--predictor", "stmoe", "--tables", root / "tables.npz", "--routing",
            root / "t.npz", "--sequence", "1"]
    res = cli(*args, "--max-new-tokens", "500", "--json", root / "g.json")
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert (f"note: {root / 't.npz'}: sequence 1 holds the routing of {plan.new_tokens} new "
            f"tokens, so {plan.new_tokens} are generated, not --max-new-tokens 500") in said
    import json

    assert len(json.loads((root / "g.json").read_text())["tokens"]) == plan.new_tokens
    res = cli(*args, "--max-new-tokens", "2")
    assert res.exit_code == 0 and "--max-new-tokens" not in res.output, res.output
    # what the run was: random weights, synthetic routing, tables profiled on it
    said = " ".join(res.output.split())
    assert "the model's weights are RANDOM" in said and "replayed the SYNTHETIC routing" in said
    assert "so their figures are in-sample" in said, said
    res = cli(*args, "--layers", "4")
    assert res.exit_code == 1 and str(root / "t.npz") in res.output


def _set_rows(trace):
    """``trace`` as a set-only source imports it (vLLM: no weights, ``rank_order: false``)."""
    import dataclasses

    meta = dataclasses.replace(trace.meta, extra={**trace.meta.extra, "rank_order": False})
    return dataclasses.replace(trace, meta=meta, weights=None)


def test_set_rows_are_served_in_their_canonical_order():
    """Forced routing reads rows as sets (uniform weights: the rank decides no weight),
    so any order inside a row gives the same plan."""
    import dataclasses

    trace = _set_rows(_trace())
    flipped = dataclasses.replace(trace, experts=np.ascontiguousarray(trace.experts[:, :, ::-1]))
    a, b = (plan_routing(t, 0, 5, 16, 4, vocab_size=4096) for t in (trace, flipped))
    assert not a.ranked and np.array_equal(a.experts, b.experts)
    assert np.all(np.diff(a.experts, axis=-1) > 0) and np.all(a.weights == 0.25)
    assert plan_routing(_trace(), 0, 5, 16, 4, vocab_size=4096).ranked


def test_generate_refuses_set_rows_for_a_predictor_that_reads_rank(replay_setup, cli):
    from conftest import one_line_error
    from stmoe.trace import save_trace

    root, model_dir, trace = replay_setup
    save_trace(_set_rows(trace), root / "sets.npz")
    args = ["generate", "--model", model_dir, "--store", root / "store", "--capacity", "8",
            "--tables", root / "tables.npz", "--routing", root / "sets.npz", "--sequence", "1"]
    one_line_error(cli(*args, "--predictor", "stmoe"), "predictor 'stmoe' reads the router's "
                   "rank order", "online update", str(root / "sets.npz"), "rank_order: false")
    res = cli(*args, "--predictor", "stmoe-plus", "--json", "-")  # reads rows as sets
    assert res.exit_code == 0, res.output
