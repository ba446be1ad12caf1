"""A step's MoE layer for its parts in one experts-path call, and what a block that does
not read does to it: only the parts routed to that expert fail.

Why apart from the engine: a server's step shares its reads, so one request's expert
whose block is damaged (``BlockError``) would fail every request of the step, though
the others, alone, never read it. Where the driver takes it (``partial``: the step
batcher, which hands each request its own error), the parts that need the expert fail
with that error and the call is made again for the rest (the run's rows and predictor
slots narrowed to theirs), each of them computed alone as before, so its bits are its
solo run's. A failed part's rows in the output are zeros, never computed with. The
call made again keeps the layer's prediction, is not taught the routing a failed call
already taught, and each part is charged what the layer met as it began (the stall:
every call's); the engine's own per-layer counters see the last call only.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Executor

import numpy as np
import torch

from stmoe.errors import BlockError
from stmoe.runtime.experts_path import ExpertsPath
from stmoe.runtime.state import EngineState
from stmoe.runtime.step import LayerTally, Part

Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (hidden, top-k ids, top-k weights)


def serve_parts(path: ExpertsPath, state: EngineState, layer: int, parts: list[Part],
                calls: list[Call], pool: Executor | None, partial: bool = False
                ) -> tuple[torch.Tensor, list[slice], LayerTally]:
    """``calls`` (each part's, its routing final) at ``layer`` in one path call: the
    output, each part's rows in it, and what the layer met. ``partial``: a block that
    does not read fails only the parts routed to it (``LayerTally.failed``), unless it
    fails them all at once (then it is raised, as without ``partial``)."""
    segments = _segments(calls)
    with state.cv:
        run = state.run
        moved0, pending = run.stats.bytes_moved, run.pending[layer]
        where = state.caches[layer].where
        distinct = [_ids(c) for c in calls]
        needed = tuple(len(ids) for ids in distinct)
        hits = tuple(sum(e in where for e in ids) for ids in distinct)
    failed: dict[int, BlockError] = {}
    left, stall, quiet, out, own = list(range(len(calls))), 0.0, False, None, segments
    planner = path.planner
    while left:
        start, lessons = time.perf_counter(), planner.lessons
        planner.quiet = quiet  # (a failed call taught the layer's routing already)
        try:
            out, own, took = _call(path, layer, [calls[i] for i in left], pool)
            stall += took
            break
        except BlockError as exc:
            bad = [i for i in left if exc.layer == layer and exc.expert in distinct[i]]
            if not partial or not bad or (len(bad) == len(left) and not failed):
                raise  # not this layer's, or every part needs it: the step's error
            stall += time.perf_counter() - start  # (it failed waiting for its reads)
            quiet = quiet or planner.lessons != lessons
            failed.update(dict.fromkeys(bad, exc))
            left = [i for i in left if i not in failed]
            _narrow(state, [parts[i] for i in left], layer, pending)
        finally:
            planner.quiet = False
    with state.cv:
        moved = state.run.stats.bytes_moved - moved0
    if failed:  # every part's rows where they were, zeros for the failed
        first = calls[0][0]
        whole = first.new_zeros((segments[-1].stop, *first.shape[1:]))
        if out is not None:
            for i, s in zip(left, own, strict=True):
                whole[segments[i]] = out[s]
        out = whole
    assert out is not None
    return out, segments, LayerTally(needed, hits, stall, moved, failed)


def _call(path: ExpertsPath, layer: int, calls: list[Call], pool: Executor | None
          ) -> tuple[torch.Tensor, list[slice], float]:
    """One path call for ``calls``: the output, each call's rows, the layer's stall."""
    hidden, index = torch.cat([c[0] for c in calls]), torch.cat([c[1] for c in calls])
    weights = torch.cat([c[2] for c in calls])
    segments = _segments(calls)
    out, stall = path.run(layer, hidden, index, weights,
                          segments=(segments, pool if len(calls) > 1 else None))
    return out, segments, stall


def _segments(calls: list[Call]) -> list[slice]:
    bounds = np.cumsum([0] + [int(c[0].shape[0]) for c in calls]).tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def _ids(call: Call) -> set[int]:
    return set(call[1].reshape(-1).tolist())


def _narrow(state: EngineState, parts: list[Part], layer: int,
            pending: tuple[int, frozenset[int]] | None) -> None:
    """The run from here on: ``parts``' rows and predictor slots (the step's others
    failed), as the planner reads them row by row; the layer's prediction, which the
    failed call took, back for the call made again."""
    with state.cv:
        run = state.run
        run.slots = [s for p in parts for s in p.slots]
        run.batch = (len(run.slots), run.batch[1])
        run.pending[layer] = pending
