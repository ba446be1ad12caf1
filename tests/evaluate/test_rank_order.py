"""The audit of issue 31: which consumers of a trace's rows read the order inside a row.

Each verdict is shown empirically: a trace whose rows are sets (``rank_order: false``)
and the same trace with the ids inside every row shuffled must give the same output
(set semantics), or the consumer must refuse it in one line (it reads rank). The
refusing ones are shown to depend on the order, on a ranked trace.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import REPO, distinct_slots, one_line_error
from stmoe.analysis.evidence import analyze
from stmoe.errors import StmoeNote, TraceError
from stmoe.evaluate.replay import evaluate, replay
from stmoe.predictors import REGISTRY, ModelShape, make, names, names_for, profile, rank_readers
from stmoe.trace import save_trace, split_auto, synthesize
from stmoe.trace.ranks import is_ranked

VLLM = REPO / "tests" / "trace" / "data" / "vllm_cpu"
RANK_READERS = ["stmoe", "cct-online"]  # the verdict: they refuse a trace of set rows
SET_READERS = [n for n in names() if n not in RANK_READERS]


def as_set_rows(trace):
    """``trace`` as an importer of a set-only source leaves it (no weights, the flag)."""
    meta = dataclasses.replace(trace.meta, extra={**trace.meta.extra, "rank_order": False})
    return dataclasses.replace(trace, meta=meta, weights=None)


def shuffled(trace, seed: int = 7):
    """The ids inside every row in a random order (empty slots moved too)."""
    ex = np.asarray(trace.experts)
    order = np.argsort(np.random.default_rng(seed).random(ex.shape), axis=-1)
    return dataclasses.replace(trace, experts=np.take_along_axis(ex, order, axis=-1))


@pytest.fixture(scope="module")
def pair():
    """SYNTHETIC: a set-row trace of two domains with a gate lookahead (its own ranked
    array, left as it is), and the same with every row shuffled; each split in two."""
    trace = synthesize(tokens=900, layers=5, experts=16, top_k=4, sequences=6, domains=2,
                       skew=0.8, seed=4)
    look = (np.asarray(trace.experts) + 3) % 16
    look = distinct_slots(np.concatenate([look, np.full(look.shape, -1)], axis=2))
    look[:, 0] = -1
    a = as_set_rows(dataclasses.replace(trace, lookahead=look))
    b = shuffled(a)
    assert not np.array_equal(a.experts, b.experts)
    return split_auto(a, 0.5), split_auto(b, 0.5)


def test_the_audit_lists_the_predictors_that_read_rank():
    assert rank_readers() == RANK_READERS
    assert all(REGISTRY[n].needs_rank_order for n in RANK_READERS)
    # ST-MoE reads rank only through its online update: static tables or HT only do not
    shape = ModelShape(3, 8, 2)
    assert make("stmoe", shape, profile(synthesize(tokens=40, layers=3, experts=8, top_k=2)),
                online=False).rank_order_reason() == ""


def test_the_rank_readers_do_depend_on_the_order_inside_a_row():
    """Why they refuse: on a ranked trace, shuffling the rows changes their sets."""
    trace = synthesize(tokens=600, layers=5, experts=16, top_k=4, sequences=3, seed=2)
    prof, held = split_auto(trace, 0.5)
    tables, shape = profile(prof), ModelShape.of(trace)
    for name in RANK_READERS:
        a = make(name, shape, tables).plan(held)
        b = make(name, shape, tables).plan(shuffled(held))
        assert not a.equals(b), name


def _sets(plan, trace):
    return [[frozenset(plan.at(t, layer).tolist()) for layer in range(trace.num_layers)]
            for t in range(trace.num_tokens)]


def test_predictors_in_integer_arithmetic_read_rows_as_sets_by_themselves(pair):
    """Without the canonical order (``plan`` on the rows as given) their sets are the
    same; the oracle lists its row as given, so only its order follows the row."""
    (prof_a, held_a), (prof_b, held_b) = pair
    ta, tb = profile(prof_a), profile(prof_b)
    shape = ModelShape.of(held_a)
    for name in ("ondemand", "previous-token", "cct-static", "frequency", "random", "oracle",
                 "gate-lookahead"):
        a, b = make(name, shape, ta).plan(held_a), make(name, shape, tb).plan(held_b)
        assert a.equals(b) or name == "oracle", name
        assert _sets(a, held_a) == _sets(b, held_b), name


def test_profiling_reads_rows_as_sets(pair):
    (prof_a, _), (prof_b, _) = pair
    ta, tb = profile(prof_a, by_domain=True), profile(prof_b, by_domain=True)
    for field in ("cct_ids", "cct_conf", "cooccurrence", "layer_counts", "pair_counts",
                  "temporal", "recent"):  # (recent: the token memory, in canonical order)
        assert np.array_equal(getattr(ta, field), getattr(tb, field)), field
    assert ta.info["plus"] == tb.info["plus"]  # stmoe-plus's fit


def test_every_other_predictor_replays_set_rows_to_the_same_results(pair):
    """Recall, budget curves and the cache replay (every policy) of every set-reading
    predictor, stmoe-mix included, are the same for any order inside the rows."""
    (prof_a, held_a), (prof_b, held_b) = pair
    ta, tb = profile(prof_a, by_domain=True), profile(prof_b, by_domain=True)
    assert names_for(held_a) == [n for n in SET_READERS if n != "stmoe-mix"]
    for policy in ("lru", "belady"):
        a = replay(held_a, SET_READERS, ta, capacity=6, policy=policy).to_dict()
        b = replay(held_b, SET_READERS, tb, capacity=6, policy=policy).to_dict()
        assert list(a["predictors"]) == SET_READERS
        assert a == b, policy


def test_the_rank_readers_refuse_set_rows_in_one_line(pair):
    (prof_a, held_a), _ = pair
    tables, shape = profile(prof_a), ModelShape.of(held_a)
    for name in RANK_READERS:
        for run in (lambda p: p.plan(held_a), lambda p: evaluate(held_a, p),
                    lambda p: replay(held_a, {"first": make("oracle", shape), p.name: p})):
            with pytest.raises(TraceError) as caught:
                run(make(name, shape, tables))
            text = str(caught.value)
            assert "\n" not in text and f"predictor {name!r}" in text
            assert "rank_order: false" in text and "online update" in text
    assert is_ranked(prof_a) is False  # (the split keeps the flag)
    evaluate(held_a, make("stmoe", shape, tables, online=False))  # no online update: fine


def test_analysis_reads_rows_as_sets_and_says_what_it_left_out(pair):
    (a, _), (b, _) = pair
    with pytest.warns(StmoeNote, match="stmoe, cct-online not replayed"):
        got_a = analyze(a)
    with pytest.warns(StmoeNote):
        got_b = analyze(b)
    assert got_a == got_b
    assert got_a["predictability"]["skipped_rank_order"] == RANK_READERS
    assert "stmoe" not in got_a["predictability"]["recall"]


@pytest.fixture(scope="module")
def vllm_trace(tmp_path_factory):
    """The real vLLM CPU routing (sets: its router takes topk unsorted), imported."""
    from stmoe.trace import import_files
    from stmoe.trace.engines.common import EngineOptions

    record = json.loads((VLLM / "offline.json").read_text())
    lengths = ",".join(str(len(r["prompt_token_ids"])) for r in record)
    trace = import_files([VLLM / f"req{i}.npy" for i in range(3)],
                         engine=EngineOptions.parse(lengths))
    assert not is_ranked(trace)
    path = tmp_path_factory.mktemp("vllm") / "vllm.npz"
    save_trace(trace, path)
    return trace, path


def test_eval_of_real_vllm_routing_skips_and_refuses_the_rank_readers(vllm_trace, cli, tmp_path):
    trace, path = vllm_trace
    tables, split = tmp_path / "t.npz", ("--split", "0.5")
    assert cli("profile", path, "-o", tables, *split).exit_code == 0
    res = cli("eval", path, "--tables", tables, *split, "--json", "-")
    assert res.exit_code == 0, res.output
    said = " ".join(res.stderr.split())
    assert "note: skipping stmoe, cct-online: they read the router's rank order" in said
    assert list(json.loads(res.stdout)["predictors"]) == names_for(trace)
    one_line_error(cli("eval", path, "--tables", tables, *split, "--predictor", "stmoe"),
                   "predictor 'stmoe' reads the router's rank order", "rank_order: false",
                   "req0.npy")  # (the trace's source names the files it came from)
    # and the same routing with other orders inside its rows gives the same figures
    shuffled_path = tmp_path / "shuffled.npz"
    save_trace(shuffled(trace, seed=3), shuffled_path)
    runs = [json.loads(cli("eval", p, "--tables", tables, *split, "--capacity", "6", "--json",
                           "-").stdout)["predictors"] for p in (path, shuffled_path)]
    assert runs[0] == runs[1] and list(runs[0]) == names_for(trace)
