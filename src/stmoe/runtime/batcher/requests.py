"""A request to the step batcher, as its client sees it: its prompt and limits, the tokens
it streams out, what it met (``Usage``), and how it ends (done, cancelled, failed). The
batcher's own books of it while it runs are its ``Member`` (``batcher.member``)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.runtime.batcher.sampling import Sampling, TokenLogprob
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
    requests: int = 1  # the requests it covers (``joint``), each one's first step its prompt

    @staticmethod
    def joint(usages: list[Usage]) -> Usage:
        """Several requests' usage as one (a request's ``n`` choices): experts, hits,
        bytes and steps summed; the stall the most any of them met (they share most steps:
        a sum would count a step's stall once per choice)."""
        return Usage(sum(u.needed for u in usages), sum(u.hits for u in usages),
                     max(u.stall_s for u in usages), sum(u.bytes_read for u in usages),
                     sum(u.steps for u in usages), sum(u.batch_sum for u in usages),
                     sum(u.requests for u in usages))

    def to_dict(self) -> dict[str, Any]:
        decode_steps = self.steps - self.requests  # a request's first step: its prompt, alone
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
    sampling: Sampling = field(default_factory=Sampling)  # greedy unless told otherwise
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, where asked for
    tokens: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    usage: Usage = field(default_factory=Usage)
    output: list[int] = field(default_factory=list)
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # perf_counter at each token
    listener: Callable[[int | None], None] | None = None  # told each token, then None
    thread_name: str = ""  # the thread that runs it, once started (names its logs)

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

    def wait(self, timeout: float | None = None) -> list[int]:
        """The generated ids, once done (the request's error raised)."""
        if not self.done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self.error is not None:
            raise self.error
        return self.output


class QueueFull(OffloadError):
    """More requests than the batch and its queue hold."""


def replay_request(plan: RoutingPlan, max_new_tokens: int | None = None) -> Request:
    """A request that replays ``plan``'s recorded routing (its tokens, its experts)."""
    steps = plan.new_tokens if max_new_tokens is None else min(max_new_tokens, plan.new_tokens)
    return Request(torch.tensor([plan.token_ids]), steps, ignore_eos=True,
                   routing=RoutingSource(plan))
