"""Rows into the experts' id order by moves (runtime.arrange), and the spare rows' memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from stmoe.runtime.arrange import plan_id_order  # noqa: E402
from stmoe.runtime.cache import TEMP, LayerCache, ParamSpec  # noqa: E402


@st.composite
def _cases(draw):
    capacity = draw(st.integers(1, 12))
    num_experts = draw(st.integers(capacity, 30))
    needed = sorted(draw(st.sets(st.integers(0, num_experts - 1), min_size=1, max_size=20)))
    cached = draw(st.integers(max(0, len(needed) - (num_experts - capacity)),
                              min(capacity, len(needed))))
    which = draw(st.permutations(needed))[:cached]
    slots = dict(zip(which, draw(st.permutations(range(capacity)))[:cached], strict=True))
    return needed, slots, capacity


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_the_moves_put_every_needed_expert_in_a_row_that_follows_its_id(case):
    needed, slots, capacity = case
    extra = [e for e in needed if e not in slots]
    target, moves = plan_id_order(needed, slots, len(extra), capacity)
    rows: dict[int, int] = {s: e for e, s in slots.items()}  # row -> what it holds
    for src, dst in moves:  # executed in order, as the compute thread does
        rows[dst] = rows[src]
    for e in extra:  # read straight into their rows afterwards
        rows[target[e]] = e
    assert [target[e] for e in needed] == sorted(target.values())  # ids and rows agree
    assert len(set(target.values())) == len(needed)
    assert all(rows[target[e]] == e for e in needed)
    # rows stay among the experts' own slots, then the spare rows past the capacity
    assert set(target.values()) == set(slots.values()) | set(range(capacity, capacity + len(extra)))
    parked = sum(dst == TEMP for _, dst in moves)
    assert len(moves) <= len(slots) + 2 * parked  # each row copied once, + 2 per cycle


def test_rows_already_in_id_order_need_no_move():
    target, moves = plan_id_order([3, 7, 9], {3: 0, 7: 2, 9: 5}, 0, 6)
    assert moves == [] and target == {3: 0, 7: 2, 9: 5}


def test_a_cycle_goes_through_the_buffer():
    target, moves = plan_id_order([1, 2], {1: 1, 2: 0}, 0, 2)
    assert target == {1: 0, 2: 1}
    assert moves[0][1] == TEMP and len(moves) == 3


def test_spare_rows_are_given_back_after_a_call():
    """Rows past the capacity are paged in when written and released after the call: once
    released they read as zeros (the kernel dropped the pages), the slots untouched."""
    spec = ParamSpec("w", torch.float32, (1024,), 0, 4096)
    cache = LayerCache(0, 2, [spec], num_experts=6, policy="lru", device=torch.device("cpu"))
    assert cache.reserved == 6 and cache.slabs["w"].shape[0] == 2
    cache.rows["w"].fill_(1.0)
    cache.release_spare(3)
    assert bool((cache.rows["w"][:2] == 1).all())  # the slots keep their experts
    assert bool((cache.rows["w"][2:5] == 0).all())  # three spare rows given back
    assert bool((cache.rows["w"][5] == 1).all())  # a row not used stays as written
