"""Each predictor's own time on the compute thread, per decode layer call.

Why: at every MoE layer the runtime's planner teaches the predictor the router's choice and
asks it for the next layer's set on the compute thread (on a device, after the layer's
kernels are launched), and admission judges the layer's last prediction as the layer
begins. Where a layer computes in well under a millisecond (a GPU, a small model) that is
a share of every layer that prefetch must repay, and the simulator's host pipeline counts
it (``[host.predictors]``, docs/simulator.md). Three parts, as the simulator adds them:

* ``learn_s``: the planner's work besides the predictor's answer (the routing taught, the
  set admitted and queued), every decode layer call;
* ``predict_s``: the predictor asked for a set, per call that asks (admission does not
  ask for a layer whose prefetch it has off);
* ``admission_s``: admission's look at the layer's last prediction, every decode layer
  call where admission is on (the runtime's default).

Measured with ``stmoe.offload`` itself, every expert cached (so no read is timed) and
admission on, the system's own predictor (``stmoe-plus`` at its compared set size), on the
same routing as the compute measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.runtime.forced_routing import RoutingPlan
from stmoe.runtime.options import CalibrateOptions

# the predictors a preset times: the runtime pipeline's (hybrid reads the routers, which a
# routing replay overrides)
TIMED_PREDICTORS = ("stmoe", "stmoe-plus")


def measure_predictors(model_dir: Path, store_path: Path | None, o: CalibrateOptions,
                       names: Sequence[str], tables: Path, top_k: int
                       ) -> dict[str, dict[str, float]]:
    """{predictor: {learn_s, predict_s, calls}} per decode layer call, for each of ``names``
    (``TIMED_PREDICTORS``) with ``tables``; the routing is ``o.routing``'s (else the same
    top-K experts at every token)."""
    from stmoe.evaluate.systems import compared_predictor
    from stmoe.predictors import load_tables
    from stmoe.runtime.api import offload
    from stmoe.runtime.calibrate.compute import decode_plan
    from stmoe.runtime.warm_up import warm_up

    unknown = [n for n in names if n not in TIMED_PREDICTORS]
    if unknown:
        raise OffloadError(f"--predictors: {', '.join(map(repr, unknown))} not timed; choose "
                           f"from {', '.join(TIMED_PREDICTORS)}")
    loaded = load_tables(tables)
    torch.set_num_threads(o.threads)
    link = {"bandwidth": o.bandwidth, "latency": o.latency} if o.tier == "emulated" else {}
    out = {}
    for name in names:
        predictor = compared_predictor(name, loaded)  # stmoe-plus at its compared size
        with offload(model_dir, store_path, capacity="100%", predictor=predictor,
                     tables=tables if isinstance(predictor, str) else None, policy="lru",
                     tier=o.tier, **link) as om:  # admission on: the runtime's default
            plan, steps = decode_plan(o, om, top_k)
            warm_up(om)  # numba's kernels compiled, not timed
            om.force_routing(plan, max_new_tokens=steps)  # every routed expert cached
            out[name] = _timed_run(om, plan, steps)
    return out


def _timed_run(om: Any, plan: RoutingPlan, steps: int) -> dict[str, float]:
    """One warm run with clocks around the planner's decode work and admission's."""
    from stmoe.runtime import experts_path

    planner, state = om.engine.planner, om.engine.state
    spent = {"all": 0.0, "predict": 0.0, "admission": 0.0, "calls": 0, "asked": 0}
    inside = [0]  # inside a timed planner entry (its predictor calls are its predict part)

    def clocked(fn: Callable[..., Any], key: str, count: str | None = None
                ) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if state.run.phase != "decode" or (key == "predict" and not inside[0]):
                return fn(*args, **kwargs)
            inside[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
                if count is not None:
                    spent[count] += 1
                inside[0] -= 1
        return run

    names = ("after_routing", "layer_started", "_predicted")
    saved = {n: getattr(planner, n) for n in names}
    planner.after_routing = clocked(saved["after_routing"], "all", "calls")
    planner.layer_started = clocked(saved["layer_started"], "all")
    planner._predicted = clocked(saved["_predicted"], "predict", "asked")
    record = experts_path.record_call
    experts_path.record_call = clocked(record, "admission")
    try:
        om.force_routing(plan, max_new_tokens=steps, cold=False)
    finally:
        experts_path.record_call = record
        for n in names:
            delattr(planner, n)  # the class's methods again
    calls, asked = int(spent["calls"]), int(spent["asked"])
    if calls < 1 or asked < 1:
        raise OffloadError(f"calibrate's predictor run made {calls} decode layer calls and "
                           f"asked the predictor {asked} times; nothing to time")
    return {"learn_s": (spent["all"] - spent["predict"]) / calls,
            "predict_s": spent["predict"] / asked,
            "admission_s": spent["admission"] / calls, "calls": calls, "asked": asked}
