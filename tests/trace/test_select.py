"""Selection, splitting and concatenation keep every token's routing intact."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import distinct_slots
from stmoe import (
    TraceError,
    concat,
    decode_only,
    select_domain,
    select_sequences,
    split,
    synthesize,
)


@pytest.fixture
def trace():
    # 5 sequences of 20 tokens, domains synth-0/1/2 round-robin, first 5 of each prefill.
    return synthesize(tokens=100, layers=3, experts=8, top_k=2, sequences=5, domains=3, seed=9)


def test_select_sequences_keeps_their_tokens_in_the_given_order(trace):
    part = select_sequences(trace, [3, 1])
    assert part.seq_starts.tolist() == [0, 20]
    assert np.array_equal(part.experts[:20], trace.experts[60:80])
    assert np.array_equal(part.experts[20:], trace.experts[20:40])
    assert np.array_equal(part.weights[:20], trace.weights[60:80])
    assert part.domains == (trace.domains[3], trace.domains[1])
    with pytest.raises(TraceError, match="out of range"):
        select_sequences(trace, [5])


def test_select_domain(trace):
    part = select_domain(trace, "synth-1")
    assert part.domains == ("synth-1", "synth-1")  # sequences 1 and 4
    assert np.array_equal(part.experts, trace.experts[np.r_[20:40, 80:100]])
    with pytest.raises(TraceError, match=r"no sequence has domain .web.*synth-0"):
        select_domain(trace, "web")


def test_decode_only(trace):
    part = decode_only(trace)
    assert part.num_tokens == int(trace.is_decode.sum()) == 75
    assert part.is_decode.all()
    assert part.seq_starts.tolist() == [0, 15, 30, 45, 60]
    assert np.array_equal(part.experts, trace.experts[trace.is_decode])
    no_decode = dataclasses.replace(trace, is_decode=np.zeros(100, dtype=bool))
    with pytest.raises(TraceError, match="no decode tokens"):
        decode_only(no_decode)


def test_split_by_sequence_partitions_the_sequences(trace):
    first, second = split(trace, 0.6)
    assert (first.num_sequences, second.num_sequences) == (3, 2)
    assert np.array_equal(np.concatenate([first.experts, second.experts]), trace.experts)
    a, b = split(trace, 0.4, seed=1)
    assert a.num_tokens + b.num_tokens == 100 and a.num_sequences == 2


def test_split_by_token_for_a_single_sequence():
    one = synthesize(tokens=50, layers=2, experts=8, top_k=2, sequences=1)
    with pytest.raises(TraceError, match="split by token instead"):
        split(one, 0.5)
    first, second = split(one, 0.3, by="token")
    assert (first.num_tokens, second.num_tokens) == (15, 35)
    assert np.array_equal(second.experts, one.experts[15:])


def test_concat_round_trips_a_split_and_refuses_other_shapes(trace):
    first, second = split(trace, 0.5)
    joined = concat([first, second])
    assert np.array_equal(joined.experts, trace.experts)
    assert np.array_equal(joined.seq_starts, trace.seq_starts)
    assert joined.domains == trace.domains
    other = synthesize(tokens=40, layers=3, experts=16, top_k=2, sequences=1)
    with pytest.raises(TraceError, match="trace 1 has num_experts 16 but trace 0 has 8"):
        concat([trace, other])


def test_both_gate_lookaheads_follow_their_tokens_and_a_bad_one_is_refused(trace):
    look = distinct_slots(np.concatenate([trace.experts, (trace.experts + 1) % 8], axis=2))
    late = look[:, :, ::-1].copy()
    t = dataclasses.replace(trace, lookahead=look, lookahead_late=late)
    part = select_sequences(t, [3, 1])
    assert np.array_equal(part.lookahead_late[:20], late[60:80])
    a, b = split(t, 0.5, by="token")
    both = concat([a, b])
    assert np.array_equal(both.lookahead_late, late) and np.array_equal(both.lookahead, look)
    early_only = dataclasses.replace(t, lookahead_late=None)
    with pytest.raises(TraceError, match="trace 1 has no late gate lookahead"):
        concat([t, early_only])
    dropped = concat([t, early_only], drop_partial=True)
    assert dropped.lookahead_late is None and dropped.lookahead is not None
    from stmoe.trace.schema import validate

    with pytest.raises(TraceError, match="lookahead_late expert id is out of range"):
        validate(dataclasses.replace(t, lookahead_late=late + 8))


def test_held_out_tail_replays_only_tokens_the_profile_never_saw(trace):
    from stmoe.trace.select import held_out_tail

    one = select_sequences(trace, [2])  # 5 prefill + 15 decode tokens
    head, tail = held_out_tail(one, at=12, prompt=3)
    assert head.num_tokens == 12 and np.array_equal(head.experts, one.experts[:12])
    # the tail: tokens 9..19, the first 3 (profiled) its prompt, the 8 decode tokens new
    assert np.array_equal(tail.experts, one.experts[9:])
    assert tail.is_decode.tolist() == [False] * 3 + [True] * 8
    assert tail.seq_starts.tolist() == [0] and tail.num_sequences == 1
    with pytest.raises(TraceError, match="inside the decode part"):
        held_out_tail(one, at=4, prompt=2)  # token 4 is a prompt token
    with pytest.raises(TraceError, match="1 sequence"):
        held_out_tail(trace, at=12, prompt=3)
    with pytest.raises(TraceError, match="prompt < at"):
        held_out_tail(one, at=12, prompt=12)
