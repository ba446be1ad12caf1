"""The step batcher's books of a running request (its ``Member``), and the two objects
through which transformers' ``generate`` on the request's thread talks to it.

Why apart from ``Request``: the client holds a ``Request`` (its tokens, usage, end); the
member is the batcher's private mailbox between the request's thread and the batcher's
(the call it waits at, the result handed back), written only under the batcher's lock."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.runtime.batcher.requests import Cancelled, Request
from stmoe.runtime.step import LayerTally, Part

# an experts call waiting for its step's layer: (layer, hidden [T, H], top-k ids, weights)
ExpertsCall = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(eq=False)
class Member:
    """A request taking part in steps: its predictor slot and the call it waits at."""

    request: Request
    slot: int
    calls: int = 0  # forward calls completed (0: the prompt is next)
    arrival: ExpertsCall | None = None  # its experts call, waiting for the step's layer
    result: torch.Tensor | BaseException | None = None  # the batcher's answer to its call
    row_call: tuple[torch.nn.Module, torch.Tensor] | None = None  # a gathered linear's input
    in_step: bool = False  # in a step whose gathered linears wait for each other
    forward_call: dict[str, Any] | None = None  # a decode call waiting for the batched forward
    thread: threading.Thread | None = None

    def part(self) -> Part:
        """This request's part of the engine's step (``runtime.step``)."""
        r = self.request
        return Part((self.slot,), self.calls, r.routing, int(r.ids.shape[1]), r.max_new_tokens)

    def waiting(self) -> bool:
        """Whether its thread waits for the batcher (an experts call, a linear, a forward)."""
        return (self.arrival is not None or self.row_call is not None
                or self.forward_call is not None)

    def await_result(self, cv: threading.Condition,
                     stopped: Callable[[], BaseException | None]) -> Any:
        """(``cv`` held, a call of this member posted) The batcher's result for it, raised
        if an error; ``stopped()``: the batcher thread's error once it has stopped."""
        while self.result is None:
            error = stopped()
            if error is not None:
                self.arrival = self.forward_call = None
                raise OffloadError(f"the batcher stopped: {error}")
            cv.wait()
        result, self.result = self.result, None
        if isinstance(result, BaseException):
            raise result
        return result


def next_step(members: list[Member], cv: threading.Condition) -> list[Member] | None:
    """(``cv``, the batcher's lock, held) The next step's members once each waits at its
    first MoE layer or its batched decode call (or has finished): the oldest new prompt
    alone, else all; None: not yet (a request at another layer is answered an error)."""
    if not members or any(m.arrival is None and m.forward_call is None for m in members):
        return None
    bad = next((m for m in members if m.arrival is not None and m.arrival[0] != 0), None)
    if bad is not None:
        bad.result = OffloadError("a request reached a step at a layer other than the first")
        cv.notify_all()
        return None
    prompts = [m for m in members if m.calls == 0]
    if prompts:
        return [min(prompts, key=lambda m: m.request.submitted)]
    return sorted(members, key=lambda m: m.slot)


def spread(out: torch.Tensor, rows: list[int], n: int) -> torch.Tensor:
    """A batched forward's experts output: ``out`` (the rows ``rows`` served) as its ``n``
    rows, zeros in a failed member's (never computed with: its request ends with its
    error)."""
    if len(rows) == n:
        return out
    return out.new_zeros((n, *out.shape[1:])).index_copy_(
        0, torch.tensor(rows, device=out.device), out)


def charge(live: list[Member], tally: LayerTally) -> None:
    """A step's layer in each member's usage: its hits, the layer's stall, and an even
    share of the bytes read."""
    for m, needed, hits in zip(live, tally.needed, tally.hits, strict=True):
        usage = m.request.usage
        usage.needed, usage.hits = usage.needed + needed, usage.hits + hits
        usage.stall_s += tally.stall_s
        usage.bytes_read += tally.bytes_read / len(live)


def generate_extra(request: Request) -> dict[str, Any]:
    """transformers' ``generate`` arguments that tie it to ``request``: its streamer, its
    cancellation, and where it samples or records log-probabilities, its ``Sampler``."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    extra: dict[str, Any] = {"streamer": Streamer(request),
                             "stopping_criteria": StoppingCriteriaList([Cancel(request)])}
    sampler = request.sampling.processor(request.logprobs)
    if sampler is not None:
        extra["logits_processor"] = LogitsProcessorList([sampler])
    return extra


def finish(request: Request, error: BaseException | None) -> None:
    """The request's end (``error`` None: done), told to its client."""
    request.error = error
    request.done.set()
    request.emit(None)


def drop_cancelled(waiting: deque[Request]) -> None:
    """(the batcher's lock held) The queued requests cancelled before they started (their
    clients went away) ended now: their places are free at once, not when a running one
    ends and the queue moves."""
    for r in [r for r in waiting if r.cancelled.is_set()]:
        waiting.remove(r)
        finish(r, Cancelled("cancelled before it started"))


class Streamer:
    """transformers' streamer protocol: the prompt first, then each new token."""

    def __init__(self, request: Request) -> None:
        self.request, self.prompt_seen = request, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        for t in value.reshape(-1).tolist():
            self.request.token_times.append(now)
            self.request.output.append(int(t))
            self.request.emit(int(t))

    def end(self) -> None:
        pass


class Cancel:
    """A stopping criterion: the request stops after its current forward call."""

    def __init__(self, request: Request) -> None:
        self.request = request

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        stop = self.request.cancelled.is_set()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool)
