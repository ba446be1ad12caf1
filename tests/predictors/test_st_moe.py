"""ST-MoE exactly as docs/method.md: the worked example, a hand-worked update sequence, and
agreement with an independent pure-Python reading of the algorithms."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

import stmoe
from conftest import distinct_slots
from reference_stmoe import profile_reference, replay_reference
from stmoe.predictors import (
    REGISTRY,
    ModelShape,
    PredictorError,
    ProfiledTables,
    load_tables,
    make,
    profile,
    save_tables,
)
from stmoe.predictors.base import Predictor
from stmoe.predictors.st_moe import STMoEPredictor


def tables_with(rows: dict[int, list[tuple[int, int]]], n: int, layers: int = 2, width: int = 2):
    ids = np.full((layers - 1, n, width), -1, dtype=np.int16)
    conf = np.zeros(ids.shape, dtype=np.int8)
    for e, row in rows.items():
        for s, (f, c) in enumerate(row):
            ids[0, e, s], conf[0, e, s] = f, c
    shape = ModelShape(layers, n, 2)
    co = np.zeros((layers - 1, n, n), dtype=np.int64)
    return ProfiledTables(shape, ids, conf, co, np.zeros((layers, n), dtype=np.int64))


def test_spec_worked_example_prefetches_12_and_3():
    # docs/method.md: router chose {7, 21} at l; CCT[l][7] = [(12,2),(3,2)], CCT[l][21] =
    # [(12,2),(45,1)]; HT[l+1] = {12, 3}. Scores 12 -> 5, 3 -> 3, 45 -> 1; threshold 2.
    tables = tables_with({7: [(12, 2), (3, 2)], 21: [(12, 2), (45, 1)]}, n=64)
    p = STMoEPredictor(tables.shape, tables, online=False)
    p.update(0, np.array([12, 3]))  # previous token: HT[1] = {12, 3} after it ends...
    p.update(1, np.array([12, 3]))
    assert p.step(0, np.array([7, 21])).tolist() == [12, 3]
    # The same with the threshold lowered to 1 admits 45, ranked last (score 1).
    q = STMoEPredictor(tables.shape, tables, online=False, threshold=1)
    q.update(0, np.array([12, 3]))
    q.update(1, np.array([12, 3]))
    assert q.step(0, np.array([7, 21])).tolist() == [12, 3, 45]
    # A budget of 1 keeps the highest score.
    r = STMoEPredictor(tables.shape, tables, online=False, max_set_size=1)
    r.update(0, np.array([12, 3]))
    r.update(1, np.array([12, 3]))
    assert r.step(0, np.array([7, 21])).tolist() == [12]


def test_hand_worked_update_sequence_with_replacements():
    # N=8, L=2, K=2, row width 2; CCT[0][1] starts as [(4,2),(5,2)].
    tables = tables_with({1: [(4, 2), (5, 2)]}, n=8)
    p = STMoEPredictor(tables.shape, tables)

    def row(e):
        return [(int(f), int(c)) for f, c in zip(p.cct_ids[0, e], p.cct_conf[0, e], strict=True)]

    tokens = [([1, 2], [4, 6]), ([1, 3], [6, 7]), ([1, 3], [7, 0]), ([1, 3], [0, 5])]
    for layer0, layer1 in tokens:
        p.update(0, np.array(layer0))
        p.update(1, np.array(layer1))
    # Derivation (each step in docs/method.md Algorithm 3):
    # t1: row1 4 taken 2->3, 5 not 2->1; row2 empty -> filled [4,6] at 2.
    # t2: row1 4:3->2, 5:1->0; row3 filled [6,7].
    # t3: row1 4:2->1, 5 at 0 freed, 7 fills it at 2; row3 6:2->1, 7:2->3.
    # t4: row1 4:1->0, 7:2->1; row3 6:1->0, 7:3->2.
    assert row(1) == [(4, 0), (7, 1)]
    assert row(2) == [(4, 2), (6, 2)]
    assert row(3) == [(6, 0), (7, 2)]
    # Token 5 routes {1, 3} at layer 0: scores 7 -> 1+2 = 3, HT[1] = {0, 5} -> 1 each,
    # 4 and 6 -> 0. Threshold 2 -> {7}.
    assert p.step(0, np.array([1, 3])).tolist() == [7]
    p.update(1, np.array([2, 7]))
    # t5: row1 4 at 0 freed, 7:1->2, 2 fills slot 0; row3 6 freed, 7:2->3, 2 fills slot 0.
    assert row(1) == [(2, 2), (7, 2)]
    assert row(3) == [(2, 2), (7, 3)]
    # HT[0] = {1, 3} from token 5: layer 0 prefetches all of it.
    assert p.predict(0).tolist() == [1, 3]


def test_profile_matches_algorithm_1_including_ties():
    # Layer 0 -> 1 counts for expert 0: f=2 twice, f=1 twice, f=3 once -> ties to smaller id.
    ex = np.array([[[0, 5], [2, 1]], [[0, 6], [1, 2]], [[0, 7], [3, 4]]], dtype=np.int16)
    trace = stmoe.RoutingTrace(
        ex, np.array([0]), np.zeros(3, bool), stmoe.TraceMeta(num_experts=8, top_k=2, num_layers=2)
    )
    t = profile(trace)
    assert t.cct_ids[0, 0].tolist() == [1, 2] and t.cct_conf[0, 0].tolist() == [2, 2]
    assert t.cct_ids[0, 5].tolist() == [1, 2]
    assert t.cct_ids[0, 3].tolist() == [-1, -1]  # never chosen: empty row
    wide = profile(trace, row_width=3)
    assert wide.cct_ids[0, 0].tolist() == [1, 2, 3]
    ref = profile_reference(ex, 8, 3)
    assert [f for f, _ in ref[0][0]] == [1, 2, 3]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", [{}, {"use_ht": False}, {"online": False}, {"threshold": 3}])
def test_compiled_replay_equals_the_independent_reference(seed, variant):
    trace = stmoe.synthesize(
        tokens=240, layers=4, experts=12, top_k=3, sequences=3, seed=seed, spatial=0.7, temporal=0.4
    )
    prof, ev = stmoe.split(trace, 0.5)
    tables = profile(prof)
    plan = STMoEPredictor(tables.shape, tables, **variant).plan(ev)
    cct = profile_reference(np.asarray(prof.experts), 12, 3)
    expected = replay_reference(
        np.asarray(ev.experts),
        ev.seq_starts,
        copy.deepcopy(cct),
        3,
        **{k: v for k, v in variant.items()},
    )
    got = [
        plan.at(t, layer).tolist() for t in range(ev.num_tokens) for layer in range(ev.num_layers)
    ]
    assert got == expected


def test_compiled_plan_equals_step_by_step_protocol_for_every_predictor():
    trace = stmoe.synthesize(tokens=400, layers=5, experts=16, top_k=2, sequences=4, seed=5)
    # a stand-in gate lookahead for hybrid: the true experts, then two others, ranked
    look = distinct_slots(np.concatenate([trace.experts, (trace.experts + 3) % 16], axis=2))
    look[:, 0] = -1
    trace = dataclasses.replace(trace, lookahead=look)
    prof, ev = stmoe.split(trace, 0.5)
    tables = profile(prof)
    shape = ModelShape.of(trace)
    for name in stmoe.predictors.names():
        if REGISTRY[name].needs_domain_tables:  # stmoe-mix: no compiled plan, other tables
            continue
        fast = make(name, shape, tables).plan(ev)
        slow = Predictor.plan(make(name, shape, tables), ev)
        assert fast.equals(slow), name


def test_online_learning_never_touches_the_callers_tables():
    trace = stmoe.synthesize(tokens=200, layers=3, experts=8, top_k=2, sequences=2)
    tables = profile(trace)
    before = tables.cct_ids.copy(), tables.cct_conf.copy()
    STMoEPredictor(tables.shape, tables).plan(trace)
    assert np.array_equal(tables.cct_ids, before[0]) and np.array_equal(tables.cct_conf, before[1])


def test_batch_of_one_equals_the_single_predictor_and_batches_union():
    trace = stmoe.synthesize(tokens=120, layers=4, experts=16, top_k=2, sequences=2, seed=3)
    tables = profile(trace)
    single, batched = STMoEPredictor(tables.shape, tables), STMoEPredictor(tables.shape, tables)
    for t in range(60):
        for layer in range(4):
            assert np.array_equal(single.predict(layer), batched.predict_batch(layer, [0]))
            single.update(layer, trace.experts[t, layer])
            batched.update(layer, trace.experts[t, layer], 0)
    # Two slots: their union, experts both want first.
    pair = STMoEPredictor(tables.shape, tables, online=False)
    for layer in range(4):
        pair.update(layer, trace.experts[0, layer], slot=0)
        pair.update(layer, trace.experts[60, layer], slot=1)
    pair.update(0, trace.experts[1, 0], slot=0)
    pair.update(0, trace.experts[61, 0], slot=1)
    a, b = pair.predict(1, 0), pair.predict(1, 1)
    union = pair.predict_batch(1, [0, 1])
    assert set(union.tolist()) == set(a.tolist()) | set(b.tolist())
    both = set(a.tolist()) & set(b.tolist())
    assert set(union[: len(both)].tolist()) == both


def test_bad_settings_and_shapes_are_clear_errors():
    trace = stmoe.synthesize(tokens=50, layers=3, experts=8, top_k=2, sequences=1)
    tables = profile(trace)
    other = ModelShape(3, 16, 2)
    with pytest.raises(PredictorError, match="profiled for L=3 layers, N=8 experts, top-2"):
        make("stmoe", other, tables)
    with pytest.raises(PredictorError, match="needs profiled tables"):
        make("cct-online", other)
    with pytest.raises(PredictorError, match="unknown predictor 'magic'"):
        make("magic", other)
    with pytest.raises(PredictorError, match="no option 'seed'"):
        make("frequency", ModelShape.of(trace), tables, seed=1)
    with pytest.raises(PredictorError, match=r"no option 'thresold'.*threshold"):
        make("stmoe", ModelShape.of(trace), tables, thresold=3)
    with pytest.raises(PredictorError, match="layer 3 is out of range"):
        make("stmoe", ModelShape.of(trace), tables).predict(3)


def test_batch_union_respects_the_budget():
    trace = stmoe.synthesize(tokens=200, layers=3, experts=16, top_k=2, sequences=2, seed=7)
    tables = profile(trace)
    p = STMoEPredictor(tables.shape, tables, max_set_size=1, online=False)
    for slot, t in ((0, 0), (1, 100)):
        for layer in range(3):
            p.update(layer, trace.experts[t, layer], slot)
        p.update(0, trace.experts[t + 1, 0], slot)
    assert len(p.predict_batch(1, [0, 1])) <= 1
    assert len(p.predict_batch(1, [0, 1], max_size=0)) >= len(p.predict(1, 0))


def test_corrupt_tables_are_refused_before_the_kernels_see_them(tmp_path):
    trace = stmoe.synthesize(tokens=100, layers=3, experts=8, top_k=2, sequences=1)
    tables = profile(trace)
    for field, value, message in (
        ("cct_ids", 8, "holds expert 8, expected -1..7"),
        ("cct_conf", 5, "outside 0..3"),
    ):
        bad = np.array(getattr(tables, field))
        bad[0, 0, 0] = value
        broken = ProfiledTables(**{**tables.__dict__, field: bad})
        path = save_tables(broken, tmp_path / f"{field}.npz")
        with pytest.raises(PredictorError, match=message):
            load_tables(path)
        with pytest.raises(PredictorError, match=message):
            STMoEPredictor(tables.shape, broken)
