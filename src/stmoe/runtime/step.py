"""The engine's unit of work: a *step*, one forward call over one or more sequences.

Why: transformers' forward hooks, the server's step batcher and the vLLM plugin's hooks
all drive the same engine. Each describes what it runs as a ``Step``
and calls the engine's ``begin_step`` / ``serve_layer`` / ``end_step`` (``leave_step``
whatever happened); the engine alone keeps the run's books from it. A solo forward is
a step of one part (its whole batch, rows computed together); a server's step has one
part per request (each part's rows computed alone, so each keeps its solo bits).

A thread whose forward is driven by something else than transformers' own call (a
request of the step batcher, or the batcher's batched forward) runs under
``driven_by(driver)``: its experts calls go to ``driver.experts_call`` and the forward
hooks keep no books (its driver calls the step API instead).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from stmoe.errors import BlockError, OffloadError
from stmoe.runtime.forced_routing import RoutingSource


@dataclass(frozen=True)
class Part:
    """Rows of a step computed in one experts call: a solo forward's whole batch, or one
    request of a server's step."""

    slots: tuple[int, ...]  # the predictor's slot of each of its rows
    call: int  # its sequence's forward calls before this one (0: its prompt)
    routing: RoutingSource | None = None  # a recorded routing in place of the router's
    prompt: int = 0  # its prompt's tokens (where ``limit`` is given: the oracle's positions)
    limit: int | None = None  # forward calls its sequence makes in all (None: not known)


@dataclass(frozen=True)
class Step:
    """One forward call the engine serves (``OffloadEngine.begin_step``)."""

    parts: tuple[Part, ...]
    length: int  # tokens per row in this call
    prefill: bool  # a prompt (else one token per row: decode)
    mask: np.ndarray | None = None  # [rows, length] real (not padding) positions; None: all

    @property
    def slots(self) -> list[int]:
        """The predictor's slot of each row, in row order."""
        return [s for p in self.parts for s in p.slots]

    @property
    def rows(self) -> int:
        return sum(len(p.slots) for p in self.parts)


@dataclass(frozen=True)
class LayerTally:
    """What one step's MoE layer met: each part's distinct experts and how many of them
    were cached as the layer began, the layer's stall and the bytes it read; the parts
    (by index) that failed for a block that did not read (``runtime.step_layer``)."""

    needed: tuple[int, ...]
    hits: tuple[int, ...]
    stall_s: float
    bytes_read: int
    failed: Mapping[int, BlockError] = field(default_factory=dict)


class StepDriver(Protocol):
    """Who serves the experts calls of a driven forward (the step batcher)."""

    def experts_call(self, layer: int, hidden: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor: ...


class Holder(Protocol):
    """A driver that holds an offloaded model for its whole life (the step batcher), as the
    model sees it: ``close`` ends it first, and no other run starts meanwhile."""

    thread: threading.Thread  # its own thread (the one run it lets in)
    closed: bool

    def close(self) -> None: ...


_DRIVER: ContextVar[StepDriver | None] = ContextVar("stmoe_step_driver", default=None)


def current_driver() -> StepDriver | None:
    """The driver of this thread's forward (None: transformers' own call, a solo step)."""
    return _DRIVER.get()


@contextmanager
def driven_by(driver: StepDriver) -> Iterator[None]:
    """This thread's forward calls, while inside, are driven by ``driver``."""
    token = _DRIVER.set(driver)
    try:
        yield
    finally:
        _DRIVER.reset(token)


def foresee(future: dict[tuple[int, int], tuple[int, ...]], fwd: int, step: Step,
            num_layers: int) -> None:
    """(engine lock held) The oracle's knowledge of a step of recorded routings: each
    layer's union over the step's parts, for this call and (where they go on) the next."""
    if any(p.routing is None or p.limit is None for p in step.parts):
        raise OffloadError("the oracle serves recorded routings only (force_routing)")
    for key in [k for k in future if k[0] < fwd]:
        del future[key]
    for ahead in (0, 1):
        for layer in range(num_layers):
            ids: set[int] = set()
            for p in step.parts:
                call = p.call + ahead
                if call <= p.limit - 1:  # type: ignore[operator]
                    span = p.routing.positions(call, p.prompt if call == 0 else 1)  # type: ignore[union-attr]
                    ids.update(int(e) for e in
                               p.routing.plan.experts[span, layer].reshape(-1))  # type: ignore[union-attr]
            future[(fwd + ahead, layer)] = tuple(sorted(ids))
