"""``stmoe split-capacity``: the counts ``--capacity`` takes, one per MoE layer, the same
total as the cache split; what cannot be split refused in one line."""

from __future__ import annotations

import pytest

import stmoe
from conftest import one_line_error
from stmoe.evaluate.layer_capacity import size_split


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    trace = stmoe.synthesize(tokens=120, layers=4, experts=16, top_k=2, sequences=4, seed=5)
    path = tmp_path_factory.mktemp("split") / "t.npz"
    stmoe.save_trace(trace, path)
    return trace, path


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_it_prints_one_count_per_layer_summing_to_the_cache(cli, traced, policy):
    trace, path = traced
    res = cli("split-capacity", path, "--capacity", "25%", "--policy", policy, "--folds", "2")
    assert res.exit_code == 0, res.output
    counts = [int(c) for c in res.stdout.strip().split(",")]  # stdout: the counts alone
    assert len(counts) == 4 and sum(counts) == 4 * 4 and all(2 <= c <= 16 for c in counts)
    assert "SYNTHETIC" in res.output and "2 held-out parts of 4 sequences" in res.output
    want = size_split(trace, 4, "stmoe-plus", policy, folds=2)  # the library's, alike
    assert tuple(counts) == want.capacities
    assert want.hit_rate >= want.uniform_hit_rate  # on the curves it was fitted to


@pytest.mark.parametrize("args,says", [
    (["--capacity", "64MB"], "--capacity '64MB'"),
    (["--capacity", "1"], "below the router's top-2"),
    (["--policy", "belady"], "'belady' applies in the cache replay only"),
    (["--predictor", "nope"], "unknown predictor 'nope'"),
    (["--folds", "1"], "--folds"),
])
def test_what_cannot_be_split_is_refused_in_one_line(cli, traced, args, says):
    one_line_error(cli("split-capacity", traced[1], *args), says)


def test_one_sequence_is_split_by_its_own_held_out_tail(cli, tmp_path):
    """One long sequence (a single prompt's capture): its tail replayed with tables of its
    head, said so; one too short for that is refused in one line."""
    path = tmp_path / "one.npz"
    one = stmoe.synthesize(tokens=50, layers=2, experts=8, top_k=2, sequences=1, seed=1)
    stmoe.save_trace(one, path)
    res = cli("split-capacity", path)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == ",".join(map(str, size_split(one, 4).capacities))
    assert "its one sequence's decode tail" in res.stderr
    stmoe.save_trace(stmoe.synthesize(tokens=3, layers=2, experts=8, top_k=2, sequences=1),
                     path)
    one_line_error(cli("split-capacity", path), "too short to replay its decode tail")
