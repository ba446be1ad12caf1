"""Prefetch admission (stmoe.admission): scripted outcomes with hand-worked verdicts, and
the runtime turning a layer's prefetch off on an adversarial prediction and back on once
the prediction is right, its tokens the resident model's all along."""

from __future__ import annotations

import numpy as np
import pytest

from stmoe.admission import Admission, AdmissionConfig

CFG = AdmissionConfig(window=4, backoff=3, max_backoff=12, ema=0.5, prior=0.5)


def _losing_call(adm: Admission, fwd: int, layer: int = 0) -> None:
    """A call whose prefetch evicted a routed expert (a miss LRU would have hit)."""
    adm.admit(fwd, layer, [5, 6])
    adm.evicted(layer, 1)
    adm.layer_called(fwd, layer, needed={0, 1}, prefetch_hits=0, misses={1})


def _paying_call(adm: Admission, fwd: int, layer: int = 0) -> None:
    adm.admit(fwd, layer, [0, 1])
    adm.layer_called(fwd, layer, needed={0, 1}, prefetch_hits=1, misses=set())


def test_a_losing_window_turns_the_layer_off_and_a_paying_probe_turns_it_back_on():
    adm = Admission(num_layers=2, capacity=4, horizon=1, config=CFG)
    for fwd in range(4):  # one window, each call -1: off for 3 calls
        assert adm.admit(fwd, 0, [5, 6]) != [] or fwd > 0
        _losing_call(adm, fwd)
    assert not adm.layers[0].on and adm.turned_off == 1
    assert adm.layers[1].on  # the other layer is its own
    for fwd in range(4, 7):  # off: nothing admitted, the calls counted
        assert adm.admit(fwd, 0, [0, 1]) == []
        adm.layer_called(fwd, 0, {0, 1}, 0, set())
    assert adm.layers[0].on and adm.probes == 1  # the third off call starts a probe
    for fwd in range(7, 11):
        _paying_call(adm, fwd)
    assert adm.layers[0].on and adm.layers[0].backoff == 0  # the probe paid: on for good
    assert adm.summary()["layers_off"] == [] and adm.summary()["off_calls"] == [3, 0]


def test_a_layer_call_made_again_is_observed_once():
    """A server's step whose layer call is made again for the requests a damaged block
    left (runtime.step_layer) reaches ``observe`` twice for one (call, layer): counted
    twice, the layer's off calls ran out twice as fast."""
    adm = Admission(num_layers=1, capacity=4, horizon=1, config=CFG)
    for fwd in range(4):  # one losing window: off for 3 calls
        _losing_call(adm, fwd)
    assert adm.layers[0].off_left == 3
    for again in range(2):
        adm.observe(4, 0, {0, 1}, 0, set(), now=1.0 + again, read_s=0.0, reads=0)
    assert adm.layers[0].off_left == 2 and adm.summary()["off_calls"] == [1]


def test_a_losing_probe_doubles_the_backoff_up_to_its_cap():
    adm = Admission(num_layers=1, capacity=4, horizon=1, config=CFG)
    fwd, waits = 0, []
    for _ in range(4):  # lose, then lose every probe
        while adm.layers[0].on:
            _losing_call(adm, fwd)
            fwd += 1
        waits.append(adm.layers[0].off_left)
        while not adm.layers[0].on:
            adm.layer_called(fwd, 0, {0, 1}, 0, set())
            fwd += 1
    assert waits == [3, 6, 12, 12]


def test_ranks_below_the_break_even_precision_are_not_loaded_on_a_saturated_tier():
    """Busy share 1: a wasted read costs a saved one, so a rank pays at precision >= 1/2.
    Rank 0 is always routed, rank 1 never: after a few calls only rank 0 is admitted; on
    an idle tier (busy share 0) every rank is."""
    adm = Admission(num_layers=1, capacity=4, horizon=1, config=CFG)
    adm.busy = 1.0
    for fwd in range(3):
        adm.admit(fwd, 0, [3, 7])
        adm.layer_called(fwd, 0, needed={3, 4}, prefetch_hits=1, misses=set())
    assert adm.layers[0].precision[:2] == [pytest.approx(0.9375), pytest.approx(0.0625)]
    assert adm.admit(3, 0, [3, 7]) == [3]
    adm.busy = 0.0
    assert adm.admit(4, 0, [3, 7]) == [3, 7]


def test_the_budget_is_what_the_tier_delivers_within_the_horizon():
    adm = Admission(num_layers=1, capacity=8, horizon=2, config=CFG)
    assert adm.budget() == 8  # nothing measured: every load
    adm.timings(read_s=0.004, layer_s=0.005, busy=0.0)
    assert adm.budget() == 2  # 2 layers x 5 ms / 4 ms
    adm.timings(read_s=0.100)  # reads get slower: at least one load still goes
    assert adm.budget() == 1
    assert adm.admit(0, 0, [1, 2, 3]) == [1]

    # a serial link (the emulated tier): what it cannot deliver in time is dropped
    # unstarted when its layer begins, so only the confidence rule cuts the set
    serial = Admission(num_layers=1, capacity=8, horizon=2, config=CFG, serial=True)
    serial.timings(read_s=0.100, layer_s=0.005, busy=0.0)
    assert serial.budget() == 8
    assert serial.admit(0, 0, [1, 2, 3]) == [1, 2, 3]


def test_wasted_reads_cost_their_share_of_the_tier():
    """Each call: one prefetch hit, two wasted reads; on an idle tier that pays (+1), on a
    saturated one it loses (1 - 2 x 1 < 0)."""
    for busy, stays_on in ((0.0, True), (1.0, False)):
        adm = Admission(num_layers=1, capacity=4, horizon=1, config=CFG)
        adm.busy = busy
        _hit_and_two_wasted(adm)
        assert adm.layers[0].on is stays_on


def _hit_and_two_wasted(adm: Admission) -> None:
    """A window of calls, each with one prefetch hit and two wasted reads."""
    for fwd in range(4):
        adm.admit(fwd, 0, [0])
        adm.wasted_read(0)
        adm.wasted_read(0)
        adm.layer_called(fwd, 0, {0}, prefetch_hits=1, misses=set())


def test_a_gpus_copies_cost_no_saved_read():
    """On the gpu tier (copies from pinned memory on a device's engine, a demand's ahead of
    the queued ones) a wasted read costs nothing in saved reads, whatever the busy share:
    a low-precision rank is admitted and wasted reads do not turn the layer off. The rule is
    one function for the runtime and the simulator."""
    from stmoe.admission import link_of

    assert link_of("gpu") == (True, True) and link_of("emulated") == (True, False)
    assert link_of("disk") == link_of("gpu-disk") == (False, False)
    for free, admitted, stays_on in ((True, [0, 1, 2], True), (False, [], False)):
        adm = Admission(num_layers=1, capacity=4, horizon=1, config=CFG, serial=True,
                        free_waste=free)
        adm.busy = 1.0
        adm.layers[0].precision = [0.1] * 4
        assert adm.admit(0, 0, [0, 1, 2]) == admitted
        assert adm.waste_cost() == (0.0 if free else 1.0)
        _hit_and_two_wasted(adm)
        assert adm.layers[0].on is stays_on


# ---- through the runtime ---------------------------------------------------------------
torch = pytest.importorskip("torch")


class _Scripted:
    """A predictor wrong for its first ``wrong`` tokens (it names two experts the forced
    routing never picks), right afterwards (the two it always picks)."""

    def __new__(cls, shape, wrong: int):
        from stmoe.predictors.base import Predictor

        class Scripted(Predictor):
            name = "scripted"

            def __init__(self) -> None:
                super().__init__(shape)
                self.tokens = 0

            def update(self, layer, experts, slot=0):
                super().update(layer, experts, slot)
                self.tokens += layer == 0

            def predict(self, layer, slot=0):
                ids = [6, 7] if self.tokens <= wrong else [0, 1]
                return np.asarray(ids, dtype=np.int16)

        return Scripted()


@pytest.mark.parametrize("tier", ["emulated", "gpu"])
def test_the_runtime_turns_an_adversarial_prefetch_off_and_back_on(tmp_path, tier):
    """On the gpu tier (the CPU's stand-in) too, where wasted copies cost nothing: the
    experts the wrong prefetches evicted, then missed, turn the layers off."""
    from contextlib import nullcontext

    from stmoe.predictors.base import ModelShape
    from stmoe.runtime.accelerator import stand_in
    from stmoe.runtime.api import offload
    from stmoe.runtime.forced_routing import ForcedRouting, RoutingPlan
    from stmoe.runtime.store import pack
    from tiny_moe import tiny_model

    model, layers = tiny_model("mixtral")
    store = pack(model, tmp_path / "store")
    steps = 48  # decode tokens; the prediction is wrong for the first 12
    experts = np.broadcast_to(np.array([0, 1]), (steps + 2, layers, 2)).copy()
    plan = RoutingPlan(experts, np.full(experts.shape, 0.5, dtype=np.float32), 2, [1, 2])
    forced = ForcedRouting(model, plan)
    with torch.no_grad():
        want = model.generate(torch.tensor([plan.token_ids]), max_new_tokens=plan.new_tokens,
                              min_new_tokens=plan.new_tokens, do_sample=False)[0, 2:].tolist()
    forced.remove()
    fresh, _ = tiny_model("mixtral")
    predictor = _Scripted(ModelShape(layers, 8, 2), wrong=12)
    link = {"bandwidth": "1GB"} if tier == "emulated" else {}
    with (stand_in() if tier == "gpu" else nullcontext()), offload(
            fresh, store, capacity=3, predictor=predictor, tier=tier, workers=1, **link) as om:
        result = om.force_routing(plan)
    assert result.tokens == want  # lossless, whatever admission decided
    adm = result.stats["admission"]
    assert adm["serial"] is True and adm["free_waste"] is (tier == "gpu")
    assert adm["turned_off"] >= layers - 1  # every predicted layer lost its first window
    assert adm["probes"] >= layers - 1 and sum(adm["off_calls"]) > 0
    assert adm["layers_off"] == []  # the prediction turned right: prefetch back on


def test_the_first_busy_measurement_is_taken_whole():
    """An unmeasured tier is not an idle one: the first busy share measured is the estimate
    (averaged from 0 it would keep the break-even near 0, every rank admitted, for the
    first several calls of a saturated tier)."""
    adm = Admission(1, 4, 1)
    assert adm.busy is None and adm.waste_cost() == 0.0
    adm.timings(busy=0.8)
    assert adm.busy == 0.8
    adm.timings(busy=0.3)
    assert adm.busy == pytest.approx(0.8 * 0.8 + 0.2 * 0.3)
