"""A request of the step batcher (``runtime.batching``): its prompt and limits, the
tokens it streams out, what it met (``Usage``), and how it ends (done, cancelled,
failed). transformers' ``generate`` drives it through ``Streamer`` and ``Cancel``."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.runtime.forced_routing import RoutingPlan, RoutingSource


class Cancelled(Exception):
    """The request was cancelled (its client went away, or the server is closing)."""


@dataclass
class Usage:
    """What one request met: its experts' hits at each layer call's start, the stall
    of the calls it took part in, and its share of the bytes read meanwhile."""

    needed: int = 0
    hits: int = 0
    stall_s: float = 0.0
    bytes_read: float = 0.0  # bytes moved during its steps, split evenly among their members
    steps: int = 0
    batch_sum: int = 0  # the members of its decode steps, summed (mean batch = / steps)

    def to_dict(self) -> dict[str, Any]:
        decode_steps = self.steps - 1  # its first step is its prompt, alone
        return {"hit_rate": self.hits / self.needed if self.needed else 0.0,
                "stall_s": self.stall_s, "bytes_read": int(self.bytes_read),
                "mean_batch": self.batch_sum / decode_steps if decode_steps > 0 else 1.0}


@dataclass(eq=False)
class Request:
    """One generation in the batcher: its tokens arrive on ``tokens`` (None: the end)."""

    ids: torch.Tensor  # [1, S] prompt
    max_new_tokens: int
    ignore_eos: bool = False
    routing: RoutingSource | None = None  # a recorded routing in place of the router's
    tokens: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    usage: Usage = field(default_factory=Usage)
    output: list[int] = field(default_factory=list)
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    slot: int = -1
    calls: int = 0  # forward calls completed (0: the prompt is next)
    arrival: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    result: torch.Tensor | BaseException | None = None
    row_call: tuple[torch.nn.Module, torch.Tensor] | None = None  # a gathered linear's input
    in_step: bool = False  # in a step whose gathered linears wait for each other
    forward_call: dict[str, Any] | None = None  # a decode call waiting for the batched forward
    thread: threading.Thread | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter at each token
    listener: Callable[[int | None], None] | None = None  # told each token, then None

    def emit(self, token: int | None) -> None:
        """A new token (None: the end) to the queue and the listener."""
        self.tokens.put(token)
        if self.listener is not None:
            self.listener(token)

    def decode_s(self) -> float:
        """From the first token to the last."""
        return self.token_times[-1] - self.token_times[0] if len(self.token_times) > 1 else 0.0

    def cancel(self) -> None:
        self.cancelled.set()

    def await_result(self, cv: threading.Condition,
                     stopped: Callable[[], BaseException | None]) -> Any:
        """(``cv`` held, a call of this request posted) The batcher's result for it, raised
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

    def wait(self, timeout: float | None = None) -> list[int]:
        """The generated ids, once done (the request's error raised)."""
        if not self.done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self.error is not None:
            raise self.error
        return self.output


class QueueFull(OffloadError):
    """More requests than the batch and its queue hold."""


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


def replay_request(plan: RoutingPlan, max_new_tokens: int | None = None) -> Request:
    """A request that replays ``plan``'s recorded routing (its tokens, its experts)."""
    steps = plan.new_tokens if max_new_tokens is None else min(max_new_tokens, plan.new_tokens)
    return Request(torch.tensor([plan.token_ids]), steps, ignore_eos=True,
                   routing=RoutingSource(plan))


def foresee(future: dict, fwd: int, step: list[Request], num_layers: int) -> None:
    """(engine lock held) The oracle's knowledge: each layer's union over the step's
    recorded routings, for this call and (if they go on) the next."""
    if any(r.routing is None for r in step):
        raise OffloadError("the oracle serves recorded routings only (force_routing)")
    for key in [k for k in future if k[0] < fwd]:
        del future[key]
    for ahead in (0, 1):
        for layer in range(num_layers):
            ids: set[int] = set()
            for r in step:
                call = r.calls + ahead
                if call <= r.max_new_tokens - 1:
                    n = int(r.ids.shape[1]) if call == 0 else 1
                    span = r.routing.positions(call, n)  # type: ignore[union-attr]
                    ids.update(int(e) for e in
                               r.routing.plan.experts[span, layer].reshape(-1))  # type: ignore[union-attr]
            future[(fwd + ahead, layer)] = tuple(sorted(ids))
