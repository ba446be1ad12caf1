"""Every reading of "prediction accuracy" (stmoe.analysis.accuracy): hand-computed small
cases, the sequence-start rule of H, traces without rank order, agreement with the
replay's recall, and the report benchmarks/paper_accuracy.py prints
(stmoe.analysis.accuracy_report)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import stmoe
from conftest import SHARED_TRACES
from stmoe.analysis import accuracy as acc
from stmoe.analysis.accuracy_report import READINGS, accuracy_report, report_lines
from stmoe.evaluate.metrics import scope_tokens
from stmoe.evaluate.replay import evaluate
from stmoe.predictors import ModelShape, PrefetchPlan, make, profile
from stmoe.trace import split_auto, synthesize

# Two sequences (t0-t2, t3-t4), L=2, K=2, N=5; t0 is prefill, the rest decode.
EXPERTS = [
    [[0, 1], [2, 3]],  # t0
    [[0, 2], [2, 4]],  # t1
    [[1, 3], [3, 4]],  # t2
    [[0, 1], [2, 4]],  # t3: a new sequence; t2's {3, 4} at layer 1 must not count as H
    [[4, 0], [1, 2]],  # t4
]
# Ranked prefetch sets in (token, layer) order.
PLAN = [[], [2], [0, 1], [4, 0, 2], [0, 2], [3], [], [1], [0], [2, 1, 3]]


def toy_trace(extra: dict | None = None) -> stmoe.RoutingTrace:
    return stmoe.RoutingTrace(
        np.asarray(EXPERTS, dtype=np.int16), np.array([0, 3]),
        np.array([False, True, True, True, True]),
        stmoe.TraceMeta(num_experts=5, top_k=2, num_layers=2, extra=extra or {}),
    )


def plan_of(sets: list[list[int]], num_layers: int) -> PrefetchPlan:
    ptr = np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(np.int64)
    ids = np.asarray([i for s in sets for i in s], dtype=np.int16)
    return PrefetchPlan(ptr=ptr, ids=ids, num_layers=num_layers)


def test_hand_computed_readings_over_the_scope():
    # Layer 1 of t1..t4 (by hand): A sizes 2+2+2+2 = 8; |P∩A| = 2 (4,2) + 1 (3) + 0 + 2 (2,1)
    # = 5; with H: t2 gains 4 (t1 routed 2,4), t3 gains nothing (sequence start), t4's 2
    # is already in P -> 6; top-2 of P: [4,0] -> 1, [3] -> 1, [1] -> 0, [2,1] -> 2 = 4;
    # |P| = 3+1+1+3 = 8; top-1 (2, 3, 2, 1) in P at t1, t2, t4 -> 3 of 4.
    r = acc.accuracy(toy_trace(), plan_of(PLAN, 2)).scope
    assert (r.steps, r.actual, r.predicted, r.hits, r.hits_with_previous, r.hits_top_k) == (
        4, 8, 8, 5, 6, 4)
    assert r.recall == pytest.approx(5 / 8)
    assert r.hit_rate_with_previous == pytest.approx(6 / 8)
    assert r.precision == pytest.approx(5 / 8)
    assert r.top_k_overlap == pytest.approx(4 / 8)
    assert r.top1_covered == pytest.approx(3 / 4)
    assert r.set_size == pytest.approx(2.0)


def test_hand_computed_readings_with_layer0():
    # Layer 0 of t1..t4 adds: hits 1 (0) + 0 + 0 + 1 (0) = 2; H adds nothing (t1's 2 is
    # not in t0's {0,1}; t2's {1,3} not in t1's {0,2}; t3 starts a sequence; t4's 4 not
    # in t3's {0,1}); top-2 = the same 2; |P| = 2+2+0+1 = 5; top-1 (0,1,0,4): t1 only.
    r = acc.accuracy(toy_trace(), plan_of(PLAN, 2)).with_layer0
    assert (r.steps, r.actual, r.predicted, r.hits, r.hits_with_previous, r.hits_top_k) == (
        8, 16, 13, 7, 8, 6)
    assert r.top1_covered == pytest.approx(4 / 8)
    assert r.set_size == pytest.approx(13 / 8)


def test_history_is_empty_at_a_sequence_start():
    # As one sequence, t3's layer 1 would take t2's {3,4}: 4 is routed at t3 -> one more hit.
    one_seq = toy_trace()
    one_seq = stmoe.RoutingTrace(one_seq.experts, np.array([0]), one_seq.is_decode, one_seq.meta)
    two = acc.accuracy(toy_trace(), plan_of(PLAN, 2)).scope.hits_with_previous
    assert acc.accuracy(one_seq, plan_of(PLAN, 2)).scope.hits_with_previous == two + 1
    # Nothing predicted: the reading is exactly the previous token's overlap
    # (t1: 2 from t0's {2,3}; t2: 4; t3: none, a sequence start; t4: 2).
    empty = acc.accuracy(toy_trace(), plan_of([[]] * 10, 2)).scope
    assert (empty.hits, empty.hits_with_previous, empty.precision) == (0, 3, 0.0)


def test_top1_is_none_without_rank_order():
    plan = plan_of(PLAN, 2)
    r = acc.accuracy(toy_trace({"rank_order": False}), plan)
    ranked = acc.accuracy(toy_trace(), plan)
    assert r.scope.top1_covered is None and r.with_layer0.top1_covered is None
    assert r.scope.recall == ranked.scope.recall and r.scope.top_k_overlap == 0.5


def test_empty_slots_are_not_routed_experts():
    trace = stmoe.RoutingTrace(np.array([[[0, -1]]], np.int16), np.array([0]),
                               np.array([True]), stmoe.TraceMeta(5, 2, 1))
    r = acc.accuracy(trace, plan_of([[1, 0]], 1)).scope  # one layer: the scope keeps it
    assert (r.actual, r.hits, r.hits_top_k, r.precision, r.top1_covered) == (1, 1, 1, 0.5, 1.0)


@pytest.fixture(scope="module")
def held_out():
    trace = synthesize(tokens=800, layers=6, experts=16, top_k=2, sequences=4, seed=3)
    first, rest = split_auto(trace, 0.5)
    return rest, profile(first, fit_plus=False)


@pytest.mark.parametrize("name", ["stmoe", "previous-token", "random"])
def test_recall_precision_and_size_equal_the_replays(held_out, name):
    trace, tables = held_out
    given = tables if name == "stmoe" else None
    result = evaluate(trace, make(name, ModelShape.of(trace), given))
    got = acc.accuracy(trace, make(name, ModelShape.of(trace), given).plan(trace))
    want = result.overall
    assert got.scope.recall == pytest.approx(want.recall)
    assert got.scope.precision == pytest.approx(want.precision)
    assert got.scope.set_size == pytest.approx(want.set_size)
    every = result.over(np.broadcast_to(scope_tokens(trace)[:, None], result.hits.shape))
    assert got.with_layer0.recall == pytest.approx(every.recall)


def test_chunks_give_the_loop_s_counts(held_out, monkeypatch):
    """Small chunks (boundaries inside tokens) against a plain per-step loop."""
    trace, tables = held_out
    plan = make("stmoe", ModelShape.of(trace), tables).plan(trace)
    monkeypatch.setattr(acc, "CHUNK_STEPS", 7)
    counts = acc.step_counts(trace, plan)
    starts = set(trace.seq_starts.tolist())
    for t in range(trace.num_tokens):
        for layer in range(trace.num_layers):
            a = {int(e) for e in trace.experts[t, layer] if e >= 0}
            p = [int(i) for i in plan.at(t, layer)]
            h = set() if t in starts else {int(e) for e in trace.experts[t - 1, layer]}
            assert counts["hits"][t, layer] == len(a & set(p))
            assert counts["hits_prev"][t, layer] == len(a & (set(p) | h))
            assert counts["hits_top_k"][t, layer] == len(a & set(p[: trace.top_k]))


def test_null_readings_of_a_random_set():
    null = acc.null_readings(60, 4, 6.0)
    assert null["recall"] == pytest.approx(0.1)
    assert null["hit_rate_with_previous"] == pytest.approx(1 - 0.9 * (1 - 4 / 60))
    assert null["precision"] == pytest.approx(4 / 60)
    assert null["top_k_overlap"] == pytest.approx(4 / 60)


def test_the_report_on_a_synthetic_trace(tmp_path):
    """What benchmarks/paper_accuracy.py prints and writes, without the real traces."""
    report = accuracy_report(tmp_path / "absent", synth_tokens=400)
    printed = "\n".join(report_lines(report))
    assert "SYNTHETIC" in printed and "| recall |" in printed and "not found" in printed
    data = json.loads(json.dumps(report.to_json()))
    assert list(data) == ["date", "band", "notes", "held_out_mean", "rows"]
    assert data["held_out_mean"] == {} and len(data["notes"]) == 2
    (row,) = data["rows"]
    assert row["kind"] == "SYNTHETIC" and row["synthetic"] is True
    assert set(row["scope"]) >= {"stmoe", "previous_token", "random_set", "in_band"}


@pytest.mark.skipif(not (SHARED_TRACES / "qwen15" / "cooking_1.routes.json").exists(),
                    reason=f"the real Qwen1.5 prompts are not at {SHARED_TRACES / 'qwen15'} "
                    "(set STMOE_SHARED to the shared/ folder)")
def test_the_report_on_the_real_traces():
    report = accuracy_report(SHARED_TRACES, synth_tokens=400)
    rows = json.loads(json.dumps(report.to_json()))["rows"]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("held-out") == 3 and kinds.count("IN-SAMPLE, overstates") == 3
    for r in rows:
        s = r["scope"]["stmoe"]
        assert 0 < s["recall"] <= s["hit_rate_with_previous"] <= 1
        assert s["top_k_overlap"] <= s["recall"]
    assert set(report.held_out_mean) == set(READINGS)
    assert "held-out Qwen1.5-MoE, mean of the prompts" in "\n".join(report_lines(report))
