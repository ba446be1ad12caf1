"""The arithmetic of a comparison in rounds (stmoe.evaluate.compare, which the benchmarks
use): the order of the systems within a round and the share of the gap a system closes."""

from __future__ import annotations

import math

from stmoe.evaluate import compare as bench
from stmoe.evaluate.systems import OFFLOAD_SYSTEMS


def test_rounds_rotate_so_every_system_takes_every_position():
    systems = list(OFFLOAD_SYSTEMS)
    orders = [bench.rotated(systems, rnd) for rnd in range(len(systems))]
    assert all(sorted(order) == sorted(systems) for order in orders)
    for position in range(len(systems)):  # each system first, second, ... exactly once
        assert sorted(order[position] for order in orders) == sorted(systems)
    assert bench.rotated(systems, len(systems)) == systems


def test_the_gap_closed_is_the_share_of_lru_only_to_oracle_time():
    assert bench.closed(0.140, 0.140, 0.100) == 0.0  # no faster than lru-only
    assert bench.closed(0.140, 0.100, 0.100) == 1.0  # as fast as the oracle
    assert math.isclose(bench.closed(0.140, 0.112, 0.100), 0.7)
    assert bench.closed(0.140, 0.095, 0.100) > 1.0  # faster than the oracle: noise, shown
    assert math.isnan(bench.closed(0.100, 0.100, 0.100))  # no gap to close


def test_one_rule_judges_a_system_against_a_baseline():
    base = [5.0, 5.2, 5.4]
    assert bench.against([6.0, 6.1, 6.3], base) == "faster"  # ranges apart
    assert bench.against([5.3, 5.5, 5.6], base) == "as fast"  # higher median, overlapping
    assert bench.against([4.9, 5.1, 5.3], base) == "within noise"  # lower, overlapping
    assert bench.against([4.0, 4.5, 4.9], base) == "slower"  # ranges apart
    assert bench.against([6.0], base) == "single run"
    # two rounds a side are apart by chance a third of the time: no verdict either way
    assert bench.against([6.0, 6.1], [5.0, 5.2]) == "too few rounds"
    assert bench.against([6.0, 6.1, 6.3], [5.0, 5.2]) == "too few rounds"
    assert [bench.not_slower(m, base) for m in ([6.0, 6.1], [4.9, 5.1], [4.0, 4.9])] == [
        True, True, False]
    assert bench.not_slower([5.3], [5.2]) and not bench.not_slower([5.1], [5.2])
