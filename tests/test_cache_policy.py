"""The cache policies (stmoe.cache_policy): one vocabulary, one victim rule, and the
runtime's cache giving the same hits as the cache replay on the same requests."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import stmoe
from stmoe import cache_policy as cp
from stmoe.evaluate.cache_replay import replay_cache
from stmoe.predictors import ModelShape, make
from stmoe.predictors.base import PredictorError, PrefetchPlan
from stmoe.sim.accelerator.systems import RunOptions, run_system
from stmoe.sim.specs import SpecError, hardware_preset, model_preset

PLACES = (cp.REPLAY, cp.SIMULATOR, cp.RUNTIME)
EVERY_NAME = (*cp.POLICIES, *cp.ALIASES)


@pytest.mark.parametrize("name", EVERY_NAME)
def test_every_name_is_valid_where_documented_and_a_clear_error_elsewhere(name):
    canonical = cp.ALIASES.get(name, name)
    assert f"``{canonical}``" in (cp.__doc__ or "")  # documented once, in the module
    for where in PLACES:
        if where in cp.VALID_IN[canonical]:
            assert cp.POLICIES[cp.policy_code(name, where)] == canonical
            assert name in cp.names_for(where)
        else:
            with pytest.raises(cp.CachePolicyError, match=f"'{name}' applies in .* not in {where}"):
                cp.policy_code(name, where)
            assert name not in cp.names_for(where)
    with pytest.raises(KeyError):
        cp.policy_code("fifo", cp.REPLAY, KeyError)


@pytest.mark.parametrize("name", cp.POLICIES)
def test_the_victim_is_an_unprotected_resident_and_ties_go_to_the_smaller_id(name):
    code = cp.policy_code(name, cp.VALID_IN[name][0])
    n = 6
    resident = np.array([False, True, True, True, True, False])
    protected = np.array([0, 0, 1, 0, 0, 0])
    flat = np.zeros(n, dtype=np.int64)
    never = np.full(n, cp.NEVER, dtype=np.int64)
    assert cp.choose_victim(resident, protected, flat, flat, never, cp.NO_SCORES, code) == 1
    everyone = np.ones(n, dtype=np.int64)
    assert cp.choose_victim(resident, everyone, flat, flat, never, cp.NO_SCORES, code) == -1
    rng = np.random.default_rng(0)
    for _ in range(50):
        res, prot = rng.random(n) < 0.7, rng.random(n) < 0.3
        last, uses, nxt = (rng.integers(0, 3, n) for _ in range(3))
        score = rng.integers(0, 3, n).astype(np.float32)
        v = cp.choose_victim(res, prot, last, uses, nxt, score, code)
        assert v == -1 if not (res & ~prot).any() else res[v] and not prot[v]


def test_scripted_victims_tell_the_policies_apart():
    # expert 0: oldest use; 1: fewest uses; 2: needed farthest ahead
    resident, protected = np.ones(3, dtype=bool), np.zeros(3, dtype=bool)
    last, uses, nxt = np.array([1, 3, 2]), np.array([5, 1, 2]), np.array([10, 20, 30])
    score = np.array([0.5, 0.9, 0.2], dtype=np.float32)  # 2: scored lowest
    victims = {p: cp.choose_victim(resident, protected, last, uses, nxt, score,
                                   cp.POLICIES.index(p))
               for p in ("lru", "lfu", "belady", "score")}
    assert victims == {"lru": 0, "lfu": 1, "belady": 2, "score": 2}
    assert cp.admits(cp.LRU, 9, 1) and not cp.admits(cp.BELADY, 9, 1) and cp.admits(cp.BELADY, 1, 9)


def test_score_evicts_the_lowest_score_ties_to_the_least_recent_and_is_lru_without_scores():
    resident, protected = np.ones(4, dtype=bool), np.array([0, 0, 0, 1])
    last, uses, nxt = np.array([3, 2, 1, 0]), np.zeros(4, np.int64), np.zeros(4, np.int64)
    score = np.array([0.5, 0.1, 0.1, 0.0], dtype=np.float32)  # 3: lowest, but protected
    assert cp.choose_victim(resident, protected, last, uses, nxt, score, cp.SCORE) == 2
    assert cp.choose_victim(resident, protected, last, uses, nxt, cp.NO_SCORES, cp.SCORE) == 2
    last = np.array([0, 2, 1, 3])  # no scores: the least recent, as LRU
    assert cp.choose_victim(resident, protected, last, uses, nxt, cp.NO_SCORES, cp.SCORE) == 0
    assert cp.choose_victim(resident, protected, last, uses, nxt, score, cp.SCORE) == 2


def _one_layer_trace(rows: list[list[int]], n: int = 5):
    """A 1-layer, top-1 trace demanding ``rows``, with nothing prefetched."""
    experts = np.array(rows, dtype=np.int16).reshape(-1, 1, 1)
    trace = stmoe.synthesize(tokens=len(rows), sequences=1, layers=1, experts=n, top_k=1, seed=0)
    trace = dataclasses.replace(trace, experts=experts, weights=None)
    plan = PrefetchPlan(np.zeros(len(rows) + 1, dtype=np.int64), np.zeros(0, np.int16), 1)
    return trace, plan


def test_scripted_sequences_where_only_one_policy_hits_most():
    # capacity 2. LRU keeps the two most recent; LFU keeps the frequent 0; Belady sees ahead.
    cases = {
        "lru": [0, 0, 0, 1, 2, 1, 2, 1, 2],  # LFU pins 0 and thrashes 1/2
        "lfu": [0, 0, 0, 1, 2, 0, 1, 2, 0],
    }
    for winner, rows in cases.items():
        trace, plan = _one_layer_trace([[e] for e in rows])
        hits = {p: replay_cache(trace, plan, 2, p).hits for p in ("lru", "lfu")}
        assert hits[winner] > max(h for p, h in hits.items() if p != winner), (winner, hits)
    trace, plan = _one_layer_trace([[0], [1], [2], [0], [1], [2]])
    hits = {p: replay_cache(trace, plan, 2, p).hits for p in ("lru", "lfu", "belady")}
    assert hits["belady"] > max(hits["lru"], hits["lfu"])


def test_the_simulator_takes_the_same_names(tmp_path):
    trace = stmoe.synthesize(tokens=120, sequences=2, layers=2, experts=8, top_k=2, seed=1)
    model = dataclasses.replace(model_preset("qwen1.5-moe-a2.7b"), layers=2, num_experts=8,
                                top_k=2)
    hw = dataclasses.replace(hardware_preset("stmoe-asic"), cache_experts_per_layer=3)
    loaded = {}
    for name in cp.names_for(cp.SIMULATOR):
        run = run_system("previous-token", trace, model, hw, RunOptions(policy=name))
        loaded[name] = run.counters
    assert loaded["predicted"] == loaded["lru"]
    none = dataclasses.replace(hw, cache_experts_per_layer=0)
    assert loaded["none"] == run_system("previous-token", trace, model, none).counters
    with pytest.raises(SpecError, match="'belady' applies in the cache replay only"):
        run_system("previous-token", trace, model, hw, RunOptions(policy="belady"))


def _drive_runtime_cache(trace, plan: PrefetchPlan, capacity: int, policy: str,
                         scores: np.ndarray | None = None):
    """The engine's calls on one LayerCache per layer (no threads: in request order):
    the prediction's scores handed over (policy score) and its set protected whole and
    claimed most confident first (residency checked at the claim, as a worker does),
    then the demand pinned, missed experts claimed, every used slot touched."""
    torch = pytest.importorskip("torch", reason="the runtime's cache needs torch")
    from stmoe.runtime.cache import LayerCache, ParamSpec

    spec = ParamSpec("w", torch.float32, (1,), 0, 4)
    caches = [LayerCache(layer, capacity, [spec], trace.num_experts, policy,
                         torch.device("cpu")) for layer in range(trace.num_layers)]
    hits = moved = prefetched = 0
    for t in range(trace.num_tokens):
        for layer, cache in enumerate(caches):
            wanted = tuple(int(e) for e in plan.at(t, layer))[:capacity]
            if scores is not None:  # as the planner's _prefetch, with the set
                cache.scores = scores[t * trace.num_layers + layer]
            cache.protected = frozenset(wanted)  # the whole set, as the planner sets it
            for e in wanted:
                if e in cache.where:
                    continue
                slot, _ = cache.claim(e, prefetch=True)
                if slot is None:
                    break  # only the set is left: the rest of it is dropped
                cache.filled(slot)
                moved, prefetched = moved + 1, prefetched + 1
            needed = sorted({int(e) for e in trace.experts[t, layer] if e >= 0})
            cache.protected = frozenset()
            cache.pinned = frozenset(needed)
            hits += sum(e in cache.where for e in needed)
            for e in needed:
                if e not in cache.where:
                    slot, _ = cache.claim(e, prefetch=False)
                    cache.filled(slot)
                    moved += 1
            for e in needed:
                cache.touch(cache.where[e])
            cache.pinned = frozenset()
            cache.check()
    return hits, moved, prefetched


@pytest.mark.parametrize("policy", ["lru", "lfu", "predicted"])
@pytest.mark.parametrize("capacity", [3, 5])
@pytest.mark.parametrize("predictor", ["random", "frequency", "stmoe"])
def test_the_runtime_cache_and_the_cache_replay_give_the_same_hits(policy, capacity, predictor):
    trace = stmoe.synthesize(tokens=300, sequences=3, layers=3, experts=10, top_k=2, seed=4)
    tables = stmoe.predictors.profile(trace) if predictor != "random" else None
    options = {"set_size": 3} if predictor == "frequency" else {}
    plan = make(predictor, ModelShape.of(trace), tables, **options).plan(trace)
    stats = replay_cache(trace, plan, capacity, policy)
    hits, moved, prefetched = _drive_runtime_cache(trace, plan, capacity, policy)
    assert (hits, moved, prefetched) == (stats.hits, stats.moved, stats.prefetched)
    assert stats.hits > 0 and stats.prefetched > 0


@pytest.mark.parametrize("capacity", [3, 5])
def test_score_eviction_gives_the_same_hits_in_the_runtime_cache_and_the_replay(capacity):
    trace = stmoe.synthesize(tokens=300, sequences=3, layers=3, experts=10, top_k=2, seed=4)
    tables = stmoe.predictors.profile(trace)
    plan, scores = make("stmoe-plus", ModelShape.of(trace), tables).scored_plan(trace)
    assert plan.equals(make("stmoe-plus", ModelShape.of(trace), tables).plan(trace))
    stats = replay_cache(trace, plan, capacity, "score", scores=scores)
    hits, moved, prefetched = _drive_runtime_cache(trace, plan, capacity, "score", scores)
    assert (hits, moved, prefetched) == (stats.hits, stats.moved, stats.prefetched)
    lru = replay_cache(trace, plan, capacity, "lru")
    assert (stats.hits, stats.moved) != (lru.hits, lru.moved)  # the scores chose the victims
    with pytest.raises(PredictorError, match="policy 'score' evicts by the predictor's scores"):
        replay_cache(trace, plan, capacity, "score")
    with pytest.raises(PredictorError, match="scores of shape"):
        replay_cache(trace, plan, capacity, "score", scores=scores[1:])


def test_the_runtime_refuses_belady_naming_where_it_applies():
    torch = pytest.importorskip("torch", reason="the runtime's cache needs torch")
    from stmoe.runtime.cache import POLICIES, LayerCache, ParamSpec

    assert "belady" not in POLICIES and "predicted" in POLICIES
    spec = ParamSpec("w", torch.float32, (1,), 0, 4)
    with pytest.raises(cp.CachePolicyError, match="'belady' applies in the cache replay only"):
        LayerCache(0, 2, [spec], 4, "belady", torch.device("cpu"))
