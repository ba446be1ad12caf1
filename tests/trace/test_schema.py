"""The trace invariants: each broken one raises a TraceError that says where and what."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stmoe import RoutingTrace, TraceError, TraceMeta, validate


def make(experts, *, n=8, seq_starts=(0,), weights=None, **meta) -> RoutingTrace:
    ex = np.asarray(experts)
    t, layers, k = ex.shape if ex.ndim == 3 else (len(ex), 1, 1)
    return RoutingTrace(
        experts=ex,
        seq_starts=np.asarray(seq_starts, dtype=np.int64),
        is_decode=np.zeros(t, dtype=bool),
        weights=weights,
        meta=TraceMeta(
            num_experts=n,
            top_k=meta.get("top_k", k),
            num_layers=meta.get("num_layers", layers),
        ),
    )


GOOD = [[[0, 1], [2, 3]], [[1, 0], [3, -1]]]  # [T=2, L=2, K=2]


def test_a_good_trace_validates_and_reports_its_shape():
    trace = validate(make(GOOD))
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts) == (2, 2, 2, 8)
    assert trace.domains == ("unlabelled",)
    assert trace.seq_lengths.tolist() == [2]


@pytest.mark.parametrize(
    "trace, fragments",
    [
        (make(np.zeros((2, 2), dtype=np.int16)), ["rank 2", "rank 3, [T, L, K]"]),
        (make(np.zeros((0, 2, 2), dtype=np.int16)), ["empty", "at least one token"]),
        (
            make([[[0, 9], [2, 3]], [[1, 0], [3, 4]]]),
            ["expert id 9", "token 0, layer 0, slot 1", "0..7"],
        ),
        (make([[[0, 1], [2, 3]], [[1, -2], [3, 4]]]), ["expert id -2", "token 1, layer 0, slot 1"]),
        (
            make([[[0, 1], [2, 3]], [[1, 0], [5, 5]]]),
            ["expert 5 appears twice", "token 1, layer 1"],
        ),
        (make(GOOD, top_k=3), ["2 expert slots but top_k is 3", "K == 3"]),
        (make(GOOD, num_layers=3), ["2 MoE layers but num_layers is 3"]),
        (make(GOOD, seq_starts=(1,)), ["first sequence starts at token 1"]),
        (make(GOOD, seq_starts=(0, 0)), ["sequence 1 starts at token 0", "strictly increasing"]),
        (make(GOOD, seq_starts=(0, 2)), ["starts at token 2 of 2"]),
        (
            make(GOOD, weights=np.array([[[0.5, 0.5]] * 2, [[0.5, np.nan], [1.0, 0.0]]])),
            ["gate weight is nan", "token 1, layer 0, slot 1", "finite"],
        ),
        (make(GOOD, weights=np.ones((2, 2, 3))), ["weights has shape (2, 2, 3)"]),
        (make(np.asarray(GOOD, dtype=float)), ["dtype float64", "integer expert ids"]),
    ],
)
def test_each_broken_invariant_names_position_and_expectation(trace, fragments):
    with pytest.raises(TraceError) as info:
        validate(trace, file="t.npz")
    msg = str(info.value)
    assert msg.startswith("t.npz: ")
    for fragment in fragments:
        assert fragment in msg


def test_domains_must_match_sequences():
    trace = dataclasses.replace(make(GOOD), domains=("a", "b"))
    with pytest.raises(TraceError, match="2 domain labels for 1 sequences"):
        validate(trace)


def test_empty_slots_may_repeat_without_counting_as_duplicates():
    validate(make([[[0, -1, -1]]]))


def test_sequence_helpers():
    trace = make([[[0]], [[1]], [[2]], [[3]], [[4]]], seq_starts=(0, 2))
    assert trace.seq_ends.tolist() == [2, 5]
    assert trace.sequence_of_token().tolist() == [0, 0, 1, 1, 1]
    assert [(s, (sl.start, sl.stop)) for s, sl in trace.sequences()] == [(0, (0, 2)), (1, (2, 5))]


# ---- issue 30: what validate checks beyond the arrays -------------------------------------


def with_extra(trace, **extra):
    return trace.with_meta(extra={**trace.meta.extra, **extra})


@pytest.mark.parametrize(("ids", "why"), [
    ([0, 0], "all zeros: an export put every layer in model layer 0"),
    ([-1, 1], "a negative layer number"),
    ([1, 10**9], "an export would build 10^9 layers"),
    ([3, 1], "out of model order"),
    ([1, 2, 3], "one per MoE layer, not three for two"),
    ([1, True], "a flag, not a number"),
    ("1-2", "text"),
])
def test_model_layer_ids_must_be_one_increasing_number_per_layer(ids, why):
    with pytest.raises(TraceError, match=r"meta.extra.model_layer_ids is .*expected 2 "
                                         r"increasing model layer numbers in 0\.\.4095"):
        validate(with_extra(make(GOOD), model_layer_ids=ids))
    validate(with_extra(make(GOOD), model_layer_ids=[1, 3]))  # dense layers 0 and 2


def test_select_layers_keeps_the_model_layer_ids_of_the_layers_kept():
    from stmoe.trace.select import select_layers

    trace = with_extra(make([[[0, 1], [2, 3], [4, 5]]]), model_layer_ids=[1, 3, 5])
    assert select_layers(trace, "1:3").meta.extra["model_layer_ids"] == [3, 5]
    assert select_layers(trace, 1).meta.extra["model_layer_ids"] == [1]


@pytest.mark.parametrize(("look", "fragment"), [
    (np.zeros((2, 2, 0), np.int16), r"lookahead has shape \(2, 2, 0\).*J >= 1"),
    (np.array([[[-1, -1], [2, 2]], [[-1, -1], [3, 1]]], np.int16),
     r"token 0, layer 1: lookahead names expert 2 twice"),
])
def test_a_lookahead_of_no_slots_or_repeated_ids_is_refused(look, fragment):
    with pytest.raises(TraceError, match=fragment):
        validate(dataclasses.replace(make(GOOD), lookahead=look))
    ok = np.array([[[-1, -1], [2, 3]], [[-1, -1], [3, 1]]], np.int16)  # -1 may repeat
    validate(dataclasses.replace(make(GOOD), lookahead=ok))


@pytest.mark.parametrize("field", ["domains", "model"])
def test_a_label_holding_a_lone_surrogate_is_refused(field):
    trace = make(GOOD)
    bad = (dataclasses.replace(trace, domains=("chat\ud800",)) if field == "domains"
           else trace.with_meta(model="m\udcff"))
    what = "the domain label of sequence 0" if field == "domains" else "the model name"
    with pytest.raises(TraceError, match=f"{what} holds .*a lone surrogate.*valid UTF-8"):
        validate(bad)
    validate(dataclasses.replace(trace, domains=("数学 ✓",)))  # any real text is fine
