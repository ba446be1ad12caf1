"""The engine's step API (runtime/step.py): one entry for every driver, one home of the books.

A driver that is neither transformers' forward hooks nor the step batcher (what a GPU
stream or a vLLM MoE layer will be) drives the engine through ``begin_step`` /
``serve_layer`` / ``end_step`` / ``leave_step`` alone and gets the resident model's bits;
the books are kept once per step whoever drives it; a step is one thread's at a time."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.step import Part, Step, current_driver, driven_by  # noqa: E402
from tiny_moe import packed_with_tables, tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11]


class LayerDriver:
    """A driver of its own: each experts call of the driven forward served at once through
    ``serve_layer`` as a step of one part (as a vLLM MoE layer would call the engine)."""

    def __init__(self, engine, part: Part) -> None:
        self.engine, self.part, self.layers = engine, part, []

    def experts_call(self, layer, hidden, index, weights):
        out, segments, tally = self.engine.serve_layer(layer, [self.part],
                                                       [(hidden, index, weights)])
        assert segments == [slice(0, hidden.shape[0])]
        assert tally.needed[0] == len(set(index.reshape(-1).tolist()))
        self.layers.append(layer)
        return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model, store, tables = packed_with_tables("qwen2_moe", tmp_path_factory.mktemp("qwen"))
    return model, store, tables


def _driven_logits(om, ids: torch.Tensor) -> tuple[torch.Tensor, LayerDriver]:
    engine = om.engine
    part = Part((0,), call=0)
    step = Step((part,), length=int(ids.shape[1]), prefill=True)
    driver = LayerDriver(engine, part)
    with om.exclusive():
        engine.reset(cold=True)
        engine.begin_step(step)
        try:
            with driven_by(driver), torch.no_grad():
                logits = om.model(input_ids=ids).logits
            engine.end_step(step)
        finally:
            engine.leave_step()
        stats = engine.finish()
    assert stats.phases["prefill"].summary()["needed"] > 0  # the driver's layers were counted
    return logits, driver


@pytest.mark.parametrize("capacity", [2, 4, 8])
def test_a_driver_of_its_own_gets_the_resident_bits(qwen, capacity):
    model, store, tables = qwen
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    fresh, _ = tiny_model("qwen2_moe")
    with offload(fresh, store, capacity=capacity, predictor="stmoe-plus",
                 tables=tables) as om:
        got, driver = _driven_logits(om, ids)
        assert driver.layers == list(range(om.engine.num_layers))  # every layer, in order
        assert om.engine.run.fwd == 0 and om.engine.run.forward_ends.count == 1  # books once
    assert torch.equal(got, want)


def test_a_solo_forward_is_a_step_of_one_part_with_its_books_kept_once(qwen):
    _, store, _ = qwen
    fresh, _ = tiny_model("qwen2_moe")
    ids = torch.tensor([PROMPT, PROMPT])
    with offload(fresh, store, capacity=4, predictor="ondemand") as om:
        engine = om.engine
        engine.reset()
        for n in (1, 2, 3):
            with torch.no_grad():
                om.model(input_ids=ids)
            run = engine.run
            assert run.fwd == n - 1 and run.forward_ends.count == n
            assert run.step.parts == (Part((0, 1), n - 1),) and run.step.rows == 2
            assert run.phase == "prefill" and run.batch == (2, len(PROMPT))
        assert engine.state.owner is None  # each call let the engine go
        assert not hasattr(engine.state, "gate")


def test_end_step_of_another_step_and_a_second_thread_are_refused(qwen):
    _, store, _ = qwen
    fresh, _ = tiny_model("qwen2_moe")
    with offload(fresh, store, capacity=4, predictor="ondemand") as om:
        engine = om.engine
        mine = Step((Part((0,), 0),), 3, prefill=True)
        engine.begin_step(mine)
        try:
            with pytest.raises(OffloadError, match="not running"):
                engine.end_step(Step((Part((0,), 0),), 3, prefill=True))
            errors = []

            def other() -> None:
                try:
                    engine.begin_step(Step((Part((0,), 0),), 3, prefill=True))
                except OffloadError as exc:
                    errors.append(str(exc))

            t = threading.Thread(target=other)
            t.start()
            t.join(30)
            assert errors and "busy" in errors[0]
        finally:
            engine.leave_step()
        assert engine.state.owner is None
        with torch.no_grad():  # free again: a forward runs
            om.model(input_ids=torch.tensor([PROMPT]))


def test_a_failed_driven_forward_lets_the_engine_go(qwen):
    _, store, _ = qwen
    fresh, _ = tiny_model("qwen2_moe")

    class Failing:
        def experts_call(self, layer, hidden, index, weights):
            raise RuntimeError("the driver failed")

    with offload(fresh, store, capacity=4, predictor="ondemand") as om:
        engine = om.engine
        step = Step((Part((0,), 0),), len(PROMPT), prefill=True)
        engine.begin_step(step)
        try:
            with driven_by(Failing()), pytest.raises(RuntimeError, match="driver failed"):
                om.model(input_ids=torch.tensor([PROMPT]))
        finally:
            engine.leave_step()
        assert current_driver() is None and engine.state.owner is None
        with torch.no_grad():
            om.model(input_ids=torch.tensor([PROMPT]))
        assert engine.run.fwd == 1  # the driven call kept no books of its own
