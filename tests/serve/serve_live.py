"""Helpers for tests of a live `stmoe serve`: the openai client, raw requests, the resident
model's solo output, and a gate on the batcher's steps, so that what runs together is
decided by the test, not by how busy the machine is."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
from transformers import AutoTokenizer

from stmoe.models import SHIPPED_MODEL
from stmoe.runtime.batcher import Sampling, TokenLogprob

NAME = "tiny-moe"
PROMPTS = ["def fib(n):", "The capital of France is", "import numpy as np\n", "Once upon a"]
CEILING = 120.0  # seconds: how long a test waits for what must happen (a hang, not a margin)


def client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(url: str, body: str | bytes, raw: bool = False) -> tuple[int, Any]:
    """POST ``body`` as JSON: (status, the answer's JSON, or its bytes where ``raw``)."""
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=CEILING) as f:
            code, answer = f.status, f.read()
    except urllib.error.HTTPError as e:
        code, answer = e.code, e.read()
    return code, answer if raw else json.loads(answer)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=CEILING) as f:
        return f.read().decode()


def until(done: Callable[[], bool], what: str) -> None:
    """Wait for ``done()`` (polled), failing after CEILING seconds."""
    deadline = time.monotonic() + CEILING
    while not done():
        assert time.monotonic() < deadline, f"still not {what} after {CEILING:g} s"
        time.sleep(0.02)


class Solo:
    """The resident model's greedy output, run alone (cached per prompt and length)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
        eos = model.generation_config.eos_token_id
        self.eos = set(eos) if isinstance(eos, list) else {eos}
        self._tokens = lru_cache(maxsize=None)(self._generate)

    def _generate(self, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                      do_sample=False, pad_token_id=min(self.eos))
        return tuple(out[0, len(ids):].tolist())

    def sampled(self, ids: list[int], n: int, sampling: Sampling) -> tuple[list[int],
                                                                        list[TokenLogprob]]:
        """Its tokens (up to its end-of-sequence token) drawn alone with ``sampling``'s own
        generator, and their log-probabilities where ``sampling`` asks for them."""
        record: list[TokenLogprob] = []
        x = torch.tensor([ids])
        processor = sampling.processor(record)
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                      do_sample=False, pad_token_id=min(self.eos),
                                      logits_processor=[processor] if processor else None)
        tokens = out[0, len(ids):].tolist()
        end = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        return (tokens if end is None else tokens[: end + 1]), record

    def text(self, tokens: list[int]) -> str:
        """The text the server makes of ``tokens``."""
        return self.tok.decode([t for t in tokens if t not in self.eos],
                               skip_special_tokens=True)

    def ids(self, prompt: str) -> list[int]:
        return list(self.tok(prompt).input_ids)

    def tokens(self, ids: list[int], n: int) -> list[int]:
        """Its tokens (up to its end-of-sequence token: generate pads after it)."""
        out = list(self._tokens(tuple(ids), n))
        end = next((i for i, t in enumerate(out) if t in self.eos), None)
        return out if end is None else out[: end + 1]

    def text_of(self, ids: list[int], n: int) -> str:
        """The text the server makes of them (the end-of-sequence token not shown)."""
        return self.text(self.tokens(ids, n))

    def __call__(self, prompt: str, n: int) -> str:
        return self.text_of(self.ids(prompt), n)


class StepGate:
    """Holds the batcher's thread before each step while ``hold(step)`` is true (the step:
    its members, each with its ``request``), until ``release()``. ``held`` is set once a
    step has waited: the batcher is then stopped where the test wants it."""

    def __init__(self, batcher: Any, hold: Callable[[list[Any]], bool]) -> None:
        self.batcher, self.hold = batcher, hold
        self.released, self.held = threading.Event(), threading.Event()
        self.real = batcher._run_step

    def _run_step(self, step: list[Any]) -> None:
        deadline = time.monotonic() + CEILING
        while self.hold(step) and not self.released.is_set() and time.monotonic() < deadline:
            self.held.set()
            self.released.wait(0.005)
        self.real(step)

    def release(self) -> None:
        self.released.set()

    def __enter__(self) -> StepGate:
        self.batcher._run_step = self._run_step
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        del self.batcher._run_step


def all_submitted(batcher: Any, n: int) -> Callable[[list[Any]], bool]:
    """A ``StepGate`` hold: until ``n`` requests are in the batch or its queue (then open
    for good), so that they share steps however far apart their clients start."""
    seen = threading.Event()

    def hold(_: list[Any]) -> bool:
        if not seen.is_set() and sum(batcher.queue_depth()) >= n:
            seen.set()
        return not seen.is_set()

    return hold
