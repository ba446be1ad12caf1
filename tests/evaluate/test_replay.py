"""Replay evaluation and cache replay: hand-derived small cases and the JSON contract."""

from __future__ import annotations

import numpy as np
import pytest

import stmoe
from conftest import CONTRACT_PREDICTORS
from stmoe.evaluate.cache_replay import replay_cache
from stmoe.evaluate.replay import cross_domain_matrix, replay
from stmoe.predictors import ModelShape, PredictorError, PrefetchPlan, make, profile


def one_layer_trace(demands, n=4):
    ex = np.asarray(demands, dtype=np.int16).reshape(-1, 1, 1)
    return stmoe.RoutingTrace(
        ex,
        np.array([0]),
        np.zeros(len(demands), bool),
        stmoe.TraceMeta(num_experts=n, top_k=1, num_layers=1),
    )


@pytest.mark.parametrize(
    "demands, expected",
    [
        # Derived by hand with capacity 2 (see each policy's rule in cache_replay.py):
        # LRU evicts 0 at t4 and keeps 1,2 -> hits t1,t2,t5,t6,t7. LFU keeps the frequent
        # 0 and thrashes 1/2 -> hits t1,t2,t8. Belady evicts 0 (next use t8) -> as LRU.
        ([0, 0, 0, 1, 2, 1, 2, 1, 0], {"lru": 5, "lfu": 3, "belady": 5}),
        # Cyclic 0,1,2: LRU and LFU miss always; Belady keeps what returns soonest.
        ([0, 1, 2, 0, 1, 2], {"lru": 0, "lfu": 0, "belady": 2}),
    ],
)
def test_scripted_demand_sequences_separate_the_policies(demands, expected):
    trace = one_layer_trace(demands)
    plan = make("ondemand", ModelShape.of(trace)).plan(trace)
    for policy, hits in expected.items():
        assert replay_cache(trace, plan, 2, policy).hits == hits, policy


def test_prefetch_hits_waste_and_read_amplification():
    trace = one_layer_trace([0, 1, 2])
    # Prefetch 1 before t0 (wasted: evicted by t1? no, capacity 2: used at t1),
    # 3 before t1 (never used), nothing before t2.
    plan = PrefetchPlan(ptr=np.array([0, 1, 2, 2]), ids=np.array([1, 3], np.int16), num_layers=1)
    stats = replay_cache(trace, plan, 2, "lru")
    # t0: load 1 (prefetch), miss 0 -> {1,0}. t1: prefetch 3 evicts LRU 1? 1 was loaded at
    # clock 1, 0 used at clock 1 -> ties broken by smaller id -> evict 0; {1,3}; demand 1 hit.
    # t2: miss 2 evicts LRU 3 (unused: wasted) -> moved 4, useful 3, wasted 1.
    assert (stats.hits, stats.moved, stats.prefetched, stats.useful, stats.wasted) == (
        1,
        4,
        2,
        3,
        1,
    )
    assert stats.read_amplification == pytest.approx(4 / 3)
    assert stats.hit_rate == pytest.approx(1 / 3)


def test_a_prefetch_never_evicts_a_member_of_its_own_set():
    """A set loaded in rank order once evicted its own resident lower-ranked member to
    make room for a higher one, then loaded it again: the oracle (P = A at each step)
    moved more experts than plain LRU, none wasted (issue 31). With the whole set
    protected first, the oracle moves exactly what LRU's misses move, and hits every time."""
    trace = stmoe.synthesize(tokens=400, layers=4, experts=16, top_k=4, sequences=4, seed=2,
                             temporal=0.5)
    shape = ModelShape.of(trace)
    oracle, lru = make("oracle", shape).plan(trace), make("ondemand", shape).plan(trace)
    for capacity in (4, 6, 8, 12):
        for policy in ("lru", "lfu"):
            o = replay_cache(trace, oracle, capacity, policy)
            base = replay_cache(trace, lru, capacity, policy)
            assert o.hit_rate == 1.0 and o.wasted == 0, (capacity, policy)
            assert o.moved == base.moved, (capacity, policy)
    # by hand, capacity 2, one layer, top-2: t0 routes [1, 0] (rank order), t1 [2, 0] ->
    # at t1 the prefetch loads 2 first; the LRU tie (1 and 0 both used at t0) goes to the
    # smaller id, 0, but 0 is in the set: 1 is evicted. moved 3 (the old code: 4)
    two = stmoe.RoutingTrace(np.array([[[1, 0]], [[2, 0]]], np.int16), np.array([0]),
                             np.zeros(2, bool), stmoe.TraceMeta(num_experts=3, top_k=2,
                                                                num_layers=1))
    stats = replay_cache(two, make("oracle", ModelShape.of(two)).plan(two), 2, "lru")
    assert (stats.moved, stats.hits, stats.wasted) == (3, 4, 0)


def test_capacity_below_top_k_is_refused():
    trace = stmoe.synthesize(tokens=20, layers=2, experts=8, top_k=4, sequences=1)
    plan = make("ondemand", ModelShape.of(trace)).plan(trace)
    with pytest.raises(PredictorError, match="capacity 3 is below top-k 4"):
        replay_cache(trace, plan, 3)
    with pytest.raises(PredictorError, match="unknown cache policy 'fifo'"):
        replay_cache(trace, plan, 4, "fifo")


def test_recall_counts_decode_tokens_at_layers_1_and_up():
    # Two tokens, two layers, K=1: token 0 prefill, token 1 decode.
    ex = np.array([[[0], [1]], [[0], [2]]], dtype=np.int16)
    trace = stmoe.RoutingTrace(
        ex,
        np.array([0]),
        np.array([False, True]),
        stmoe.TraceMeta(num_experts=4, top_k=1, num_layers=2),
    )
    r = replay(trace, ["previous-token", "oracle"]).to_dict()
    prev = r["predictors"]["previous-token"]
    # Decode token 1, layer 1: HT = {1}, actual {2} -> miss. (Layer 0 would hit.)
    assert (prev["recall"], prev["steps"], prev["set_size"]) == (0.0, 1, 1.0)
    # Waste: 1 expert prefetched in vain; moved = |P| + misses = 2 for 1 needed.
    assert (prev["waste"], prev["read_amplification"]) == (1, 2.0)
    assert prev["per_layer"][0]["recall"] == 1.0
    assert r["scope"] == "decode tokens, layers 1..1"
    assert r["predictors"]["oracle"]["recall"] == 1.0


def test_json_contract_and_budget_curve():
    trace = stmoe.synthesize(tokens=600, layers=6, experts=16, top_k=2, sequences=4, domains=2)
    prof, ev = stmoe.split(trace, 0.5)
    data = replay(
        ev, stmoe.predictors.names_for(ev), profile(prof), capacity=4, options={"seed": 1}
    ).to_dict()
    assert set(data["predictors"]) >= set(CONTRACT_PREDICTORS)
    for entry in data["predictors"].values():
        for key in (
            "recall",
            "precision",
            "set_size",
            "per_layer",
            "per_domain",
            "decode",
            "prefill",
            "budget_curve",
            "cache",
        ):
            assert key in entry
        curve = entry["budget_curve"]
        assert curve["budget"] == list(range(1, 9))
        assert all(
            a <= b + 1e-12 for a, b in zip(curve["recall"], curve["recall"][1:], strict=False)
        )
        assert curve["recall"][-1] <= entry["recall"] + 1e-12
        assert set(entry["per_domain"]) == {"synth-0", "synth-1"}
    assert data["predictors"]["oracle"]["budget_curve"]["recall"][1] == 1.0


def test_cross_domain_matrix_favours_the_diagonal_on_distinct_domains():
    trace = stmoe.synthesize(
        tokens=6000,
        layers=4,
        experts=32,
        top_k=2,
        sequences=6,
        domains=3,
        spatial=0.9,
        temporal=0.0,
        seed=2,
    )
    m = cross_domain_matrix(trace, "cct-static")
    recall = np.asarray(m["recall"])
    assert m["profiled_on"] == ["synth-0", "synth-1", "synth-2"]
    off = recall[~np.eye(3, dtype=bool)]
    assert np.diag(recall).min() > off.max() + 0.2


def test_cross_domain_survives_a_domain_too_small_to_split():
    big = stmoe.synthesize(tokens=400, layers=3, experts=8, top_k=2, sequences=4, seed=1)
    tiny = stmoe.RoutingTrace(big.experts[:1], np.array([0]), np.array([True]), big.meta,
                              domains=("tiny",))
    joined = stmoe.concat([big, tiny], drop_partial=True)  # tiny has no gate weights
    m = cross_domain_matrix(joined, "stmoe", max_set_size=2)
    assert m["profiled_on"] == ["unlabelled", "tiny"]
    assert m["recall"][0][0] is not None and m["recall"][1] == [None, None]
    assert m["recall"][0][1] is None


def test_plan_from_sets_with_empty_sets() -> None:
    """A predictor whose sets are empty (B = 0, e.g. fitted to predict nothing) plans nothing
    (found by the tables fuzz test: the reshape could not infer T x L from 0 entries)."""
    import numpy as np

    from stmoe.predictors.baselines import plan_from_sets

    sets = np.zeros((3, 4, 0), dtype=np.int16)
    plan = plan_from_sets(sets, np.zeros((3, 4, 0), dtype=bool), 4)
    assert plan.ptr.tolist() == [0] * 13 and plan.ids.size == 0


def _always(experts: tuple[int, int], tokens: int = 30) -> stmoe.RoutingTrace:
    """Every token routes ``experts`` at 4 layers of 256; its first 5 tokens the prompt."""
    ex = np.zeros((tokens, 4, 2), np.int16)
    ex[:, :] = experts
    return stmoe.RoutingTrace(ex, np.array([0]), np.arange(tokens) >= 5,
                              stmoe.TraceMeta(num_experts=256, top_k=2, num_layers=4))


def test_undefined_figures_are_null_not_zero(cli, tmp_path):
    """A group with nothing to divide by (no prompt tokens in scope, a layer that routed
    nothing, a predictor that names nothing) has no recall or precision: JSON null, '-' in
    the table, where a 0.0 would pull a mean over the groups down (a review's finding)."""
    trace = _always((255, 254))
    experts = trace.experts.copy()
    experts[:, 3] = -1  # layer 3 routed nothing
    trace = stmoe.RoutingTrace(experts, trace.seq_starts, trace.is_decode, trace.meta)
    data = replay(trace, ["oracle", "ondemand", "random"], None, capacity=4,
                  options={"seed": 1}).to_dict()["predictors"]
    assert data["oracle"]["recall"] == 1.0 and data["oracle"]["per_layer"][3]["recall"] is None
    assert data["oracle"]["per_layer"][3]["precision"] is None
    assert data["ondemand"]["precision"] is None and data["ondemand"]["recall"] == 0.0
    only_decode = _always((1, 2))
    only_decode = stmoe.RoutingTrace(only_decode.experts, only_decode.seq_starts,
                                     np.ones(30, bool), only_decode.meta)
    data = replay(only_decode, ["oracle"], None).to_dict()["predictors"]
    assert data["oracle"]["prefill"]["recall"] is None and data["oracle"]["prefill"]["steps"] == 0


def test_a_cache_replay_with_no_useful_load_prints_a_dash(cli, tmp_path):
    """Random predictions never naming the two experts every token routes: read
    amplification is undefined (it crashed the table with a TypeError)."""
    path = tmp_path / "t.npz"
    stmoe.save_trace(_always((255, 254)), path)
    res = cli("eval", path, "--predictor", "random", "--predictor", "ondemand",
              "--capacity", "4", "--json", tmp_path / "e.json")
    assert res.exit_code == 0, res.output
    import json

    data = json.loads((tmp_path / "e.json").read_text())["predictors"]
    assert data["ondemand"]["precision"] is None


def test_the_cache_replay_gives_the_bound_beside_each_hit_rate(cli, tmp_path):
    """`stmoe eval --capacity` shows, beside each predictor's hit rate, the most any
    eviction could make with its prefetches (belady): at least the policy's, and for
    belady itself, its own."""
    import json

    path = tmp_path / "t.npz"
    stmoe.save_trace(stmoe.synthesize(tokens=300, layers=3, experts=16, top_k=2, seed=3), path)
    assert cli("profile", path, "--split", "0.5", "-o", tmp_path / "tables.npz").exit_code == 0
    for policy in ("lru", "belady"):
        res = cli("eval", path, "--split", "0.5", "--tables", tmp_path / "tables.npz",
                  "--predictor", "stmoe", "--predictor", "ondemand", "--capacity", "4",
                  "--policy", policy, "--json", tmp_path / "e.json")
        assert res.exit_code == 0, res.output
        assert "bound" in res.output
        for e in json.loads((tmp_path / "e.json").read_text())["predictors"].values():
            c = e["cache"]
            assert c["hit_rate"] <= c["bound_hit_rate"] <= 1.0, c
            if policy == "belady":
                assert c["bound_hit_rate"] == c["hit_rate"]
