"""The host pipeline counts the predictor's own time on the compute thread."""

from __future__ import annotations

import re

import numpy as np
import pytest

from stmoe.sim.host import pipeline as host

LAYERS, DECODE = 3, 5


def costs(**extra: float) -> host.HostCosts:
    return host.HostCosts(layer_s=0.5, token_s=0.25, expert_s=0.125, read_s=1.0,
                          first_touch_s=0.0, parallel=1.0, workers=2, fifo=True, **extra)


def cached_run(admission: bool) -> host.HostRun:
    """Every token routes experts 0 and 1 at every layer, a cache of 4 of 8: after the prompt
    nothing is read, so a decode's time is the compute thread's own work alone."""
    experts = np.tile(np.asarray([0, 1]), (2 + DECODE, LAYERS, 1)).astype(np.int64)
    sets = [[0, 1, 2]] * (experts.shape[0] * LAYERS)  # a prediction for every (token, layer)
    ptr = np.cumsum([0] + [len(s) for s in sets]).astype(np.int64)
    ids = np.asarray([e for s in sets for e in s], dtype=np.int64)
    return host.HostRun(experts, 2, (ptr, ids), False, 4, "lru", admission)


def test_each_decode_layer_call_pays_learning_and_predicting():
    plain = host.simulate_host(cached_run(False), costs(), 8)
    timed = host.simulate_host(cached_run(False), costs(learn_s=0.01, predict_s=0.02), 8)
    assert plain["stall"] == timed["stall"] == 0.0
    assert plain["time"] == pytest.approx(DECODE * (LAYERS * (0.5 + 2 * 0.125) + 0.25))
    assert timed["time"] - plain["time"] == pytest.approx(DECODE * LAYERS * 0.03)


def test_a_layer_admission_keeps_off_pays_learning_and_admission_only(monkeypatch):
    """Admission off for a layer: the runtime's planner does not ask the predictor, so
    only the teaching (it still learns every routing) and admission's look are paid."""
    monkeypatch.setattr(host.Admission, "wants", lambda self, layer: False)
    plain = host.simulate_host(cached_run(True), costs(), 8)
    timed = host.simulate_host(cached_run(True), costs(learn_s=0.01, predict_s=0.02,
                                                       admission_s=0.004), 8)
    assert timed["time"] - plain["time"] == pytest.approx(DECODE * LAYERS * 0.014)
    # admission off (NAME-all): no look, every call asks
    off = host.simulate_host(cached_run(False), costs(learn_s=0.01, predict_s=0.02,
                                                      admission_s=0.004), 8)
    assert off["time"] - plain["time"] == pytest.approx(DECODE * LAYERS * 0.03)



PREDICTORS = ('\n[host.predictors]\nstmoe = { learn_s = 2e-05, predict_s = 3e-05, '
              'admission_s = 1e-05 }\n')


def test_a_presets_predictor_table_is_read_and_checked(tmp_path):
    from test_simulator import HOST_TOML

    from stmoe.sim.specs import SpecError, hardware_preset

    base = HOST_TOML.format(pe=1.0, bw=1e9, par=1e9, tier="disk", touch=0.0)
    path = tmp_path / "hw.toml"
    path.write_text(base)
    assert hardware_preset(str(path)).host.predictors == {}  # a preset from before: none
    path.write_text(base + PREDICTORS)
    cost = hardware_preset(str(path)).host.predictors["stmoe"]
    assert (cost.learn_s, cost.predict_s, cost.admission_s) == (2e-05, 3e-05, 1e-05)
    for edit, message in (
        (("stmoe =", "nope ="), "unknown predictor 'nope'"),
        (("predict_s = 3e-05", "predict_s = -1.0"), "stmoe.predict_s is -1.0"),
        (("predict_s = 3e-05", 'predict_s = "fast"'), "stmoe.predict_s is 'fast'"),
        ((", predict_s = 3e-05", ""), "expected { learn_s = SECONDS, predict_s = SECONDS,"),
        (("learn_s = 2e-05", "learn_s = inf"), "stmoe.learn_s is inf"),
    ):
        path.write_text(base + PREDICTORS.replace(*edit))
        with pytest.raises(SpecError, match=re.escape(message)):
            hardware_preset(str(path))
