"""Each layer's cache size (stmoe.evaluate.layer_capacity, the cache replay's per-layer
capacities): a layer's hits depend on its own capacity only, the curves are the replay's,
and the split spends the whole budget where the curves rise."""

from __future__ import annotations

import numpy as np
import pytest

import stmoe
from stmoe.evaluate.cache_replay import replay_cache
from stmoe.evaluate.layer_capacity import allocate, default_grid, layer_hits
from stmoe.predictors import ModelShape, PredictorError, make, profile


@pytest.fixture(scope="module")
def replayed():
    trace = stmoe.synthesize(tokens=120, layers=3, experts=16, top_k=2, sequences=2, seed=3)
    shape = ModelShape.of(trace)
    plan, scores = make("stmoe-plus", shape, profile([trace]), set_size=3).scored_plan(trace)
    return trace, plan, scores


@pytest.mark.parametrize("policy", ["lru", "score", "belady"])
def test_a_layers_hits_depend_on_its_own_capacity_only(replayed, policy):
    trace, plan, scores = replayed
    scored = scores if policy == "score" else None
    caps = (2, 9, 5)
    mixed = replay_cache(trace, plan, caps, policy, scores=scored)
    assert mixed.capacity == caps and len(mixed.layer_hits) == 3
    for layer, c in enumerate(caps):
        alone = replay_cache(trace, plan, c, policy, scores=scored)
        assert mixed.layer_hits[layer] == alone.layer_hits[layer]
        assert mixed.layer_demanded[layer] == alone.layer_demanded[layer]
    assert sum(mixed.layer_hits) == mixed.hits and sum(mixed.layer_demanded) == mixed.demanded


def test_the_curves_are_the_replays_and_rise_with_capacity(replayed):
    trace, plan, _ = replayed
    grid = default_grid(16, 2, steps=4)
    assert grid == [2, 4, 8, 12, 16]
    hits, demanded = layer_hits(trace, plan, grid)
    assert hits.shape == (3, 5)
    for i, c in enumerate(grid):
        assert hits[:, i].sum() == replay_cache(trace, plan, c).hits
    assert (np.diff(hits, axis=1) >= 0).all()  # LRU is a stack algorithm: more never hurts
    # a cache of every expert never evicts: each expert misses at most once per layer
    assert (demanded - hits[:, -1] <= 16).all() and (hits[:, 0] < hits[:, -1]).all()


def test_the_budget_goes_where_the_hits_rise():
    grid = [2, 4, 6, 8]
    hits = np.array([[10, 10, 10, 10],    # saturated at once: keeps the floor
                     [10, 20, 30, 40],    # steady
                     [10, 10, 10, 60]])   # flat, then a rise worth more than the steady one
    caps = allocate(hits, grid, total=14)
    assert caps.tolist() == [2, 4, 8]
    assert allocate(hits, grid, total=6).tolist() == [2, 2, 2]
    # what no step buys is spread a slot at a time: the whole budget is used
    spread = allocate(hits, grid, total=15, num_experts=8)
    assert spread.sum() == 15 and spread.tolist() == [2, 5, 8]
    assert allocate(hits, grid, total=100, num_experts=8).tolist() == [8, 8, 8]


def test_bad_capacities_are_refused_in_one_line(replayed):
    trace, plan, _ = replayed
    with pytest.raises(PredictorError, match="2 cache capacities for a trace of 3 MoE layers"):
        replay_cache(trace, plan, [4, 4])
    with pytest.raises(PredictorError, match=r"capacity 1 \(layer 2\) is below top-k 2"):
        replay_cache(trace, plan, [4, 4, 1])
    with pytest.raises(PredictorError, match="cannot give 3 layers 2 each"):
        allocate(np.zeros((3, 2)), [2, 4], total=5)
    with pytest.raises(PredictorError, match="distinct increasing"):
        allocate(np.zeros((3, 2)), [4, 2], total=12)


def test_cross_fitted_curves_replay_each_part_with_tables_of_the_others():
    from stmoe.evaluate.layer_capacity import cross_fitted_hits, size_split
    from stmoe.trace.select import select_sequences

    trace = stmoe.synthesize(tokens=90, layers=3, experts=16, top_k=2, sequences=3, seed=4)
    grid = [2, 4, 8, 16]
    hits, _, parts = cross_fitted_hits(trace, "stmoe-plus", "lru", grid, folds=5,
                                       options={"set_size": 3})
    assert parts == 3  # no more parts than sequences
    want = np.zeros_like(hits)
    for i in range(3):  # sequence i replayed with tables of the two others
        held = select_sequences(trace, [i])
        rest = select_sequences(trace, [j for j in range(3) if j != i])
        plan = make("stmoe-plus", ModelShape.of(trace), profile([rest]), set_size=3).plan(held)
        want += layer_hits(held, plan, grid, "lru", np.asarray(held.is_decode) |
                           ~np.asarray(held.is_decode).any())[0]
    assert np.array_equal(hits, want)
    split = size_split(trace, 4, folds=5, options={"set_size": 3})
    assert sum(split.capacities) == 12 and split.folds == 3


def test_one_sequence_is_cut_by_tokens_its_tail_replayed_with_tables_of_its_head():
    """One long prompt's routing (the shared Qwen3.6 sample, the GPU check's): the curves are
    its decode tail's from 60% of its tokens on (after the 8 before), replayed with tables of
    the tokens before, so none is in-sample; a sequence too short for that is refused."""
    from stmoe.evaluate.layer_capacity import cross_fitted_hits, size_split
    from stmoe.trace.select import held_out_tail, select_sequences

    one = select_sequences(stmoe.synthesize(tokens=90, layers=3, experts=16, top_k=2,
                                            sequences=3, seed=4), [1])
    grid = [2, 4, 8, 16]
    hits, _, parts = cross_fitted_hits(one, "stmoe-plus", "lru", grid,
                                       options={"set_size": 3})
    first = int(np.flatnonzero(np.asarray(one.is_decode))[0])
    at = max(round(0.6 * one.num_tokens), first)
    head, tail = held_out_tail(one, at, 8)
    assert tail.num_tokens == one.num_tokens - at + 8
    plan = make("stmoe-plus", ModelShape.of(one), profile([head]), set_size=3).plan(tail)
    want, _ = layer_hits(tail, plan, grid, "lru", np.asarray(tail.is_decode))
    assert parts == 1 and np.array_equal(hits, want)
    assert sum(size_split(one, 4, options={"set_size": 3}).capacities) == 12
    short = select_sequences(stmoe.synthesize(tokens=3, layers=3, experts=16, top_k=2,
                                              sequences=1, seed=4), [0])
    with pytest.raises(PredictorError, match="too short to replay its decode tail"):
        cross_fitted_hits(short, "stmoe-plus", "lru", grid)
    prompt_only = stmoe.synthesize(tokens=40, layers=3, experts=16, top_k=2, sequences=1,
                                   prefill_fraction=1.0, seed=4)
    with pytest.raises(PredictorError, match="all of them prompt"):
        cross_fitted_hits(prompt_only, "stmoe-plus", "lru", grid)
    # a prompt past 60% of the tokens: the tail starts at its first generated token
    late = stmoe.synthesize(tokens=40, layers=3, experts=16, top_k=2, sequences=1,
                            prefill_fraction=0.8, seed=4)
    first = int(np.flatnonzero(np.asarray(late.is_decode))[0])
    assert first > 24
    _, tail = held_out_tail(late, first, 8)
    plan = make("stmoe-plus", ModelShape.of(late), profile([held_out_tail(late, first, 8)[0]]),
                set_size=3).plan(tail)
    want, _ = layer_hits(tail, plan, grid, "lru", np.asarray(tail.is_decode))
    got, _, _ = cross_fitted_hits(late, "stmoe-plus", "lru", grid, options={"set_size": 3})
    assert np.array_equal(got, want)
