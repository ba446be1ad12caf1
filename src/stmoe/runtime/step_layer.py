"""A step's MoE layer for its parts in one experts-path call, and what a block that does
not read does to it: only the parts routed to that expert fail.

Why apart from the engine: a server's step shares its reads, so one request's expert
whose block is damaged (``BlockError``) would fail every request of the step, though
the others, alone, never read it. Here the parts that need the expert fail with that
error; the step goes on for the rest (the call again without them, the run's rows and
predictor slots narrowed to theirs), each of them computed alone as before, so its bits
are its solo run's. A part's failed rows in the output are zeros, never computed with.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Executor

import numpy as np
import torch

from stmoe.errors import BlockError
from stmoe.runtime.experts_path import ExpertsPath
from stmoe.runtime.state import EngineState
from stmoe.runtime.step import LayerTally, Part

Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (hidden, top-k ids, top-k weights)


def serve_parts(path: ExpertsPath, state: EngineState, layer: int, parts: list[Part],
                calls: list[Call], pool: Executor | None
                ) -> tuple[torch.Tensor, list[slice], LayerTally]:
    """``calls`` (each part's, its routing final) at ``layer`` in one path call: the
    output, each part's rows in it, and what the layer met (``failed``: the parts a block
    that did not read failed, with its error)."""
    segments = _segments(calls)
    with state.cv:
        moved0 = state.run.stats.bytes_moved
    failed: dict[int, BlockError] = {}
    left = list(range(len(calls)))
    while True:
        try:
            out, own, needed, hits, stall = _call(path, state, layer,
                                                  [calls[i] for i in left], pool)
            break
        except BlockError as exc:
            bad = [i for i in left if exc.layer == layer and exc.expert in _ids(calls[i])]
            if not bad or len(bad) == len(left):
                raise  # every part left needs it (or it is not this layer's): the step's
            failed.update(dict.fromkeys(bad, exc))
            left = [i for i in left if i not in failed]
            _narrow(state, [parts[i] for i in left])
    with state.cv:
        moved = state.run.stats.bytes_moved - moved0
    if failed:  # the output with every part's rows where they were, zeros for the failed
        whole = out.new_zeros((segments[-1].stop, *out.shape[1:]))
        for i, s in zip(left, own, strict=True):
            whole[segments[i]] = out[s]
        out = whole
        done = dict(zip(left, zip(needed, hits, strict=True), strict=True))
        needed = tuple(done.get(i, (0, 0))[0] for i in range(len(calls)))
        hits = tuple(done.get(i, (0, 0))[1] for i in range(len(calls)))
    return out, segments, LayerTally(needed, hits, stall, moved, failed)


def _call(path: ExpertsPath, state: EngineState, layer: int, calls: list[Call],
          pool: Executor | None
          ) -> tuple[torch.Tensor, list[slice], tuple[int, ...], tuple[int, ...], float]:
    """One path call for ``calls``: the output, each call's rows, its distinct experts and
    how many were cached as the layer began, the layer's stall."""
    hidden, index = torch.cat([c[0] for c in calls]), torch.cat([c[1] for c in calls])
    weights = torch.cat([c[2] for c in calls])
    segments = _segments(calls)
    with state.cv:
        where = state.caches[layer].where
        distinct = [_ids(c) for c in calls]
        needed = tuple(len(ids) for ids in distinct)
        hits = tuple(sum(e in where for e in ids) for ids in distinct)
    out, stall = path.run(layer, hidden, index, weights,
                          segments=(segments, pool if len(calls) > 1 else None))
    return out, segments, needed, hits, stall


def _segments(calls: list[Call]) -> list[slice]:
    bounds = np.cumsum([0] + [int(c[0].shape[0]) for c in calls]).tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def _ids(call: Call) -> set[int]:
    return set(call[1].reshape(-1).tolist())


def _narrow(state: EngineState, parts: list[Part]) -> None:
    """The run's rows and predictor slots from here on: ``parts``' (the step's others
    failed), as the planner reads them row by row."""
    with state.cv:
        run = state.run
        run.slots = [s for p in parts for s in p.slots]
        run.batch = (len(run.slots), run.batch[1])
