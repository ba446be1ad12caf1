"""What the step-batching tests share: requests of different lengths joining a running
batch, and every lm_head output logged per thread (a solo run's on the test's thread, a
request's on its own), so each request's logits can be compared with its solo run's."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24], [30, 31, 32, 33]]
LENGTHS = [9, 4, 7, 5]  # different lengths: requests leave at different steps


class LogitLog:
    """Every lm_head output, per thread."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.by_thread: dict[str, list[torch.Tensor]] = {}
        head = model.get_output_embeddings()
        self.handle = head.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.by_thread.setdefault(threading.current_thread().name, []).append(
            output[:, -1].detach().clone())

    def take(self, name: str | None = None) -> list[torch.Tensor]:
        return self.by_thread.pop(name or threading.current_thread().name)


class ForwardLog(LogitLog):
    """Every forward call's last-position logits, per thread: a request's own forward or,
    in a batched step, its row handed back to its thread."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.by_thread = {}
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.by_thread.setdefault(threading.current_thread().name, []).append(
            output.logits[:, -1].detach().clone())


class OnCuda:
    """A model whose ``generate`` (``solo``'s, a test's) takes CPU inputs and runs them on
    CUDA."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def generate(self, ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any) -> Any:
        return self.model.generate(ids.cuda(), attention_mask=attention_mask.cuda(), **kw)


def solo(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy ``n`` tokens of ``prompt`` on ``model`` alone."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def submit_staggered(batcher: Any) -> tuple[list[Any], list[list[int]]]:
    """PROMPTS submitted with LENGTHS, the third joining a running batch; (the requests,
    their tokens), after checking they shared steps."""
    from stmoe.runtime.batcher import Request

    reqs = []
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        reqs.append(batcher.submit(Request(torch.tensor([p]), n)))
        if i == 1:
            time.sleep(0.05)  # the third joins a running batch
    got = [r.wait(120) for r in reqs]
    sizes = batcher.decode_sizes()
    assert max(sizes) >= 2, sizes  # they did share steps
    return reqs, got


class Stop(BaseException):
    """Not an Exception: it stops the batcher's thread itself, not just the step."""


def errors_when_the_batcher_stops(batcher: Any) -> list[str]:
    """Two requests submitted to ``batcher`` (patched to raise ``Stop`` on its thread):
    each must end with an error, none hang; their messages."""
    import pytest

    from stmoe.errors import OffloadError
    from stmoe.runtime.batcher import Cancelled, Request

    reqs = [batcher.submit(Request(torch.tensor([p]), 6)) for p in PROMPTS[:2]]
    errors = []
    for r in reqs:
        with pytest.raises((OffloadError, Cancelled)) as caught:
            r.wait(60)
        errors.append(str(caught.value))
    return errors
