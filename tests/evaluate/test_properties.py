"""Properties that must hold for any routing (hypothesis draws the traces)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import stmoe
from stmoe.evaluate.cache_replay import replay_cache
from stmoe.evaluate.replay import evaluate
from stmoe.predictors import ModelShape, make, profile
from stmoe.predictors.st_moe import STMoEPredictor


@st.composite
def traces(draw, max_tokens=40):
    """Random valid traces: any shape, several sequences, some empty slots."""
    k = draw(st.integers(1, 3))
    n = draw(st.integers(k, 9))
    layers = draw(st.integers(1, 4))
    t_count = draw(st.integers(1, max_tokens))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ex = np.stack([[rng.permutation(n)[:k] for _ in range(layers)] for _ in range(t_count)])
    if draw(st.booleans()) and k > 1:  # empty trailing slots here and there
        ex[:, :, -1] = np.where(rng.random((t_count, layers)) < 0.3, -1, ex[:, :, -1])
    n_seq = draw(st.integers(1, t_count))
    starts = np.unique(np.r_[0, rng.choice(t_count, n_seq - 1, replace=True)]) if n_seq > 1 else [0]
    return stmoe.RoutingTrace(
        experts=ex.astype(np.int16),
        seq_starts=np.asarray(starts, dtype=np.int64),
        is_decode=rng.random(t_count) < 0.7,
        meta=stmoe.TraceMeta(num_experts=n, top_k=k, num_layers=layers, synthetic=True),
    )


@settings(max_examples=60, deadline=None)
@given(traces(), traces())
def test_tables_stay_well_formed_under_any_updates(prof, run):
    tables = profile(prof)
    if ModelShape.of(run) != tables.shape:
        run = prof
    p = STMoEPredictor(tables.shape, tables)
    p.plan(run)
    assert p.cct_conf.size == 0 or (p.cct_conf.min() >= 0 and p.cct_conf.max() <= 3)
    for layer_rows in p.cct_ids:
        for row in layer_rows:
            ids = row[row >= 0]
            assert len(set(ids.tolist())) == len(ids)  # never an expert twice in a row
    assert np.all(p.cct_conf[p.cct_ids < 0] >= 0)


@settings(max_examples=60, deadline=None)
@given(traces())
def test_oracle_recall_and_precision_are_one(trace):
    result = evaluate(trace, make("oracle", ModelShape.of(trace)))
    s = result.overall
    assert s.hits == s.actual and s.predicted == s.actual
    if s.actual:
        assert s.recall == 1.0 and s.precision == 1.0


@settings(max_examples=60, deadline=None)
@given(traces(), st.floats(0.5, 4), st.floats(0, 3))
def test_raising_the_threshold_never_grows_the_set(trace, low, extra):
    tables = profile(trace)
    a = STMoEPredictor(tables.shape, tables, threshold=low).plan(trace)
    b = STMoEPredictor(tables.shape, tables, threshold=low + extra).plan(trace)
    for t in range(trace.num_tokens):
        for layer in range(trace.num_layers):
            assert set(b.at(t, layer).tolist()) <= set(a.at(t, layer).tolist())


@settings(max_examples=60, deadline=None)
@given(traces(), st.integers(0, 4), st.sampled_from(["lru", "lfu", "belady"]))
def test_ondemand_moves_exactly_the_misses(trace, extra, policy):
    plan = make("ondemand", ModelShape.of(trace)).plan(trace)
    stats = replay_cache(trace, plan, trace.top_k + extra, policy)
    assert stats.moved == stats.demanded - stats.hits
    assert stats.wasted == 0 and stats.prefetched == 0


@settings(max_examples=60, deadline=None)
@given(traces(), st.integers(0, 4), st.sampled_from(["stmoe", "random", "frequency"]))
def test_cache_accounting_balances_and_belady_bounds_the_other_policies(trace, extra, name):
    tables = profile(trace)
    shape = ModelShape.of(trace)
    cap = trace.top_k + extra
    stats = replay_cache(trace, make(name, shape, tables).plan(trace), cap, "lru")
    assert stats.moved == stats.useful + stats.wasted  # every load ends used or wasted
    assert stats.hits <= stats.demanded
    # belady is the bound for the same prefetches (tests/evaluate/test_belady_bound.py);
    # its furthest-next-use on the plain next demand was not: this test once found lru
    # one hit above it
    for plan in (make("ondemand", shape).plan(trace), make(name, shape, tables).plan(trace)):
        best = replay_cache(trace, plan, cap, "belady")
        for policy in ("lru", "lfu"):
            assert replay_cache(trace, plan, cap, policy).hits <= best.hits


@settings(max_examples=40, deadline=None)
@given(traces(max_tokens=15))
def test_batch_of_one_equals_single_on_any_trace(trace):
    tables = profile(trace)
    single, batched = STMoEPredictor(tables.shape, tables), STMoEPredictor(tables.shape, tables)
    for t in range(trace.num_tokens):
        if t in set(trace.seq_starts.tolist()):
            single.reset()
            batched.reset(0)
        for layer in range(trace.num_layers):
            assert np.array_equal(single.predict(layer), batched.predict_batch(layer, [0]))
            single.update(layer, trace.experts[t, layer])
            batched.update(layer, trace.experts[t, layer], 0)
