"""The engine's side of a step of the step batcher (``runtime.batching``): the run's books
opened and closed as a solo forward call's hooks keep them, and each MoE layer served in
one engine call for the step's requests' experts calls, whether they come from each
request's own forward or from one batched forward (``runtime.step_forward``)."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch

from stmoe.runtime.requests import Request, foresee

# one request's experts call: (layer, hidden [T, H], top-k ids [T, k], top-k weights [T, k])
Call = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


def begin_step(engine: Any, step: list[Request], prompt: bool) -> None:
    """The run's books for a step's forward call (a prompt alone, or one token per
    request), and the planner told it starts."""
    length = int(step[0].ids.shape[1]) if prompt else 1
    with engine.cv:
        run = engine.state.run
        run.fwd += 1
        run.batch, run.phase = (len(step), length), "prefill" if prompt else "decode"
        run.prefill_routing, run.mask, run.slots = [], None, [r.slot for r in step]
        if run.future is not None:
            foresee(run.future, run.fwd, step, engine.num_layers)
    engine.planner.forward_started()


def end_step(engine: Any, step: list[Request], prompt: bool) -> None:
    """A step's forward call ended: the books closed, each request's call counted."""
    engine.state.run.forward_ends.append(time.perf_counter())
    engine.planner.forward_ended()
    for r in step:
        r.calls += 1
        r.usage.steps += 1
        r.usage.batch_sum += 0 if prompt else len(step)


def serve_calls(engine: Any, pool: Executor | None, layer: int, live: list[Request],
                calls: list[Call]) -> tuple[torch.Tensor, list[slice]]:
    """``live``'s calls at ``layer`` in ONE engine call (the union of their experts loaded
    once, each request's rows computed alone: ``LayerServer.serve_segments``): the output
    and each request's rows in it. A request replaying a recorded routing has its own
    position's; each request's usage counts its hits, the call's stall and a share of the
    bytes read. Raises what the engine raises (every request of the call fails with it)."""
    calls = list(calls)
    for i, r in enumerate(live):  # a recorded routing at the request's own position
        if r.routing is not None:
            lay, hid, idx, w = calls[i]
            calls[i] = (lay, hid, *r.routing.routing(r.calls, layer, idx, w))
    hidden = torch.cat([c[1] for c in calls])
    index = torch.cat([c[2] for c in calls])
    weights = torch.cat([c[3] for c in calls])
    bounds = np.cumsum([0] + [int(c[1].shape[0]) for c in calls])
    segments = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
    state = engine.state
    module = engine.layout.modules[layer][1]
    with engine.cv:
        cache, phase = state.caches[layer], state.run.stats.phases[state.run.phase]
        for r, s in zip(live, segments, strict=True):
            ids = set(index[s].reshape(-1).tolist())
            r.usage.needed += len(ids)
            r.usage.hits += sum(e in cache.where for e in ids)
        stall0, moved0 = phase._stall[layer], state.run.stats.bytes_moved
    out = engine.server.serve_segments(module, hidden, index, weights, segments,
                                       pool if len(live) > 1 else None)
    with engine.cv:
        stall = phase._stall[layer] - stall0
        moved = state.run.stats.bytes_moved - moved0
    for r in live:
        r.usage.stall_s += stall
        r.usage.bytes_read += moved / len(live)
    return out, segments
