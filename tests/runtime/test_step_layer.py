"""``runtime.step_layer.serve_parts`` on its own: which parts a block that does not read
fails, with whose error, and what the call made again is given (a path stand-in that
fails on damaged experts; the served bits are tests/serve/test_damaged_block.py's)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from stmoe.errors import BlockError  # noqa: E402
from stmoe.runtime.step import Part  # noqa: E402
from stmoe.runtime.step_layer import serve_parts  # noqa: E402

LAYER = 1


class _Path:
    """An experts path whose read of a damaged expert fails; it teaches before reading,
    as the CPU path does, and records what each call was given."""

    def __init__(self, damaged: set[int]) -> None:
        self.damaged, self.calls = damaged, []
        self.planner = SimpleNamespace(lessons=0, quiet=False)

    def run(self, layer, hidden, index, weights, segments):
        self.calls.append((index.reshape(-1).tolist(), self.planner.quiet))
        if not self.planner.quiet:
            self.planner.lessons += 1
        bad = sorted(self.damaged & set(index.reshape(-1).tolist()))
        if bad:
            raise BlockError(f"layer {layer}, expert {bad[0]} fails its checksum", layer, bad[0])
        return hidden * 2, 0.25


def _state(rows: int):
    run = SimpleNamespace(stats=SimpleNamespace(bytes_moved=0), pending=[None, (7, {1}), None],
                          slots=list(range(rows)), batch=(rows, 1))
    return SimpleNamespace(cv=threading.Condition(), run=run,
                           caches=[SimpleNamespace(where={}) for _ in range(3)])


def _calls(routes: list[list[int]]):
    return [(torch.full((1, 4), float(i + 1)), torch.tensor([r]), torch.ones(1, len(r)))
            for i, r in enumerate(routes)]


def test_each_part_fails_with_the_error_of_its_own_block():
    """Parts 0 and 2 need damaged experts 5 and 6, part 1 neither: the first call fails on
    5, the second (parts 1, 2) on 6, the third serves part 1. Before, the second error
    reached every part, part 0 told of a block it never needed."""
    path, state = _Path({5, 6}), _state(3)
    parts = [Part((s,), 1) for s in range(3)]
    out, segments, tally = serve_parts(path, state, LAYER, parts, _calls([[5, 0], [1, 2],
                                                                          [6, 3]]), None,
                                       partial=True)
    assert {i: e.expert for i, e in tally.failed.items()} == {0: 5, 2: 6}
    assert torch.equal(out[segments[1]], torch.full((1, 4), 4.0))  # part 1 served
    assert not out[segments[0]].any() and not out[segments[2]].any()  # zeros, not computed
    assert [c[0] for c in path.calls] == [[5, 0, 1, 2, 6, 3], [1, 2, 6, 3], [1, 2]]
    # the calls made again: not taught again, the layer's prediction given back, the rows
    # and slots narrowed to part 1's, every call's stall charged
    assert [c[1] for c in path.calls] == [False, True, True] and path.planner.lessons == 1
    assert state.run.pending[LAYER] == (7, {1})
    assert state.run.slots == [1] and state.run.batch == (1, 1)
    assert tally.stall_s >= 0.25 and tally.needed == (2, 2, 2)


def test_every_part_failing_at_once_is_the_steps_error_and_without_partial_any_is():
    path = _Path({5})
    with pytest.raises(BlockError, match="expert 5"):  # both need it: raised, as before
        serve_parts(path, _state(2), LAYER, [Part((0,), 1), Part((1,), 1)],
                    _calls([[5, 0], [5, 1]]), None, partial=True)
    with pytest.raises(BlockError, match="expert 5"):  # a driver that does not take it
        serve_parts(_Path({5}), _state(2), LAYER, [Part((0,), 1), Part((1,), 1)],
                    _calls([[5, 0], [1, 2]]), None)


def test_a_block_of_another_layer_is_raised_whole():
    path = _Path(set())

    def elsewhere(*args, **kwargs):
        raise BlockError("layer 2, expert 0 fails its checksum", 2, 0)

    path.run = elsewhere
    with pytest.raises(BlockError, match="layer 2"):
        serve_parts(path, _state(2), LAYER, [Part((0,), 1), Part((1,), 1)],
                    _calls([[0, 1], [2, 3]]), None, partial=True)
