"""What the HTTP layer serves: an offloaded model, its step batcher, and the counters.

``Service`` turns a checked API request into a batcher ``Request`` (the prompt's ids,
its limits checked against the model's positions), its tokens back into text (stop
strings cut there), and keeps what ``/metrics`` reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from stmoe.hf.growing_text import GrowingText
from stmoe.runtime.api import OffloadedModel
from stmoe.runtime.batcher import Request, Sampling, StepBatcher, choice_seed
from stmoe.serve.logprobs import TokenPieces
from stmoe.serve.protocol import ApiError, ChatRequest, CompletionRequest

# max_tokens absent or null, on both endpoints: up to the model's positions (as vLLM's
# server does: a prompt that fits is never refused for a filled-in default); this many
# where the model states no positions
MAX_TOKENS_DEFAULT = 256
# A long text prompt is tokenized first to this many characters per position (several
# times a token's length in any vocabulary): more tokens there than the positions, by
# more than the few a cut through a word can add, and the whole cannot fit either
PREFIX_CHARS = 32
CUT_TOKENS = 64


@dataclass
class Counters:
    """The server's totals since it started (``/metrics``)."""

    requests: dict[str, int] = field(default_factory=dict)  # by outcome
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_s: float = 0.0  # summed per-request decode time
    started: float = field(default_factory=time.time)


class Service:
    """One offloaded model served to many clients (``stmoe serve``)."""

    def __init__(self, om: OffloadedModel, name: str, max_batch: int = 4,
                 max_queue: int = 16) -> None:
        self.om, self.name, self.tokenizer = om, name, om.tokenizer
        self.batcher = StepBatcher(om, max_batch=max_batch, max_queue=max_queue)
        self.positions = int(getattr(om.model.config, "max_position_embeddings", 0) or 0)
        self.eos = _eos_ids(om.model)
        self.counters = Counters()
        self.lock = threading.Lock()
        self._pieces: TokenPieces | None = None

    def close(self) -> None:
        self.batcher.close()

    # ---- requests ------------------------------------------------------------------
    def completion_ids(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return self._encode(req.prompt)
        vocab = int(self.om.model.config.vocab_size)
        bad = next((i for i, t in enumerate(req.prompt) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt token {bad} is {req.prompt[bad]}, outside the model's "
                           f"vocabulary 0..{vocab - 1}", "prompt")
        return list(req.prompt)  # type: ignore[arg-type]

    def chat_ids(self, req: ChatRequest) -> list[int]:
        # a message's name (OpenAI's participant) reaches the template, as vLLM's server
        # passes it (templates that read it use it; the others leave it)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        tok = self._tok()
        if getattr(tok, "chat_template", None):
            return self._templated(tok, messages)
        text = "".join(f"{m['role']}{' (' + m['name'] + ')' if 'name' in m else ''}: "
                       f"{m['content']}\n" for m in messages) + "assistant:"
        return self._encode(text)

    def _templated(self, tok: Any, messages: list[dict[str, str]]) -> list[int]:
        """The messages through the tokenizer's chat template, as token ids; the template's
        own refusal (Mixtral's, of roles that do not alternate) is the client's error."""
        from jinja2.exceptions import TemplateError  # (transformers' templates need jinja2)

        try:
            if sum(len(m["content"]) for m in messages) > self.positions * PREFIX_CHARS:
                self._refuse_long(tok.apply_chat_template(  # (the template adds none)
                    messages, add_generation_prompt=True, tokenize=False), special=False)
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except TemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc}",
                           "messages") from None
        # transformers 5 answers a BatchEncoding (a Mapping, not a dict: taken whole, it was
        # its keys, so every templated chat failed); older ones the ids
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return [int(t) for t in ids]

    def requests(self, ids: list[int], max_tokens: int | None, sampling: Sampling,
                 n: int = 1, field: str = "max_tokens") -> list[Request]:
        """``n`` batcher requests for ``ids``, one per choice, checked (``request``); choice
        i sampled with seed ``seed + i`` (``choice_seed``), so it is the solo run of that
        seed."""
        if n > self.batcher.capacity:
            raise ApiError(400, f"n is {n}; this server runs and queues at most "
                           f"{self.batcher.capacity} requests at once (--max-batch + "
                           "--max-queue), one per choice", "n")
        first = self.request(ids, max_tokens, field)
        return [Request(first.ids, first.max_new_tokens,
                        sampling=replace(sampling, seed=choice_seed(sampling.seed, i)))
                for i in range(n)]

    def request(self, ids: list[int], max_tokens: int | None,
                field: str = "max_tokens") -> Request:
        """A greedy batcher request for ``ids``, checked against the model's positions;
        ``max_tokens`` None: the default, whatever else was sent (``default_tokens``);
        ``field``: the request's name for it (chat's max_completion_tokens, say)."""
        if not ids:
            raise ApiError(400, "the prompt has no tokens", "prompt")
        limit = self.positions - len(ids) if self.positions else None
        if limit is not None and limit < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model takes at most "
                           f"{self.positions} positions, prompt and completion together",
                           "prompt", code="context_length_exceeded")
        if max_tokens is None:
            return Request(torch.tensor([ids]), self.default_tokens(len(ids)))
        if max_tokens < 1:
            raise ApiError(400, f"{field} must be at least 1, got {max_tokens}", field)
        if limit is not None and max_tokens > limit:
            raise ApiError(400, f"{field} {max_tokens} and the prompt's {len(ids)} tokens "
                           f"exceed the model's {self.positions} positions (at most {limit} "
                           "here)", field, code="context_length_exceeded")
        return Request(torch.tensor([ids]), max_tokens)

    def default_tokens(self, prompt: int) -> int:
        """The one default ``max_tokens`` (absent or null alike): the positions the prompt
        leaves, or MAX_TOKENS_DEFAULT where the model states none."""
        return self.positions - prompt if self.positions else MAX_TOKENS_DEFAULT

    def submit(self, requests: list[Request]) -> None:
        """Queue a request's choices, all or none (``QueueFull``)."""
        self.batcher.submit_all(requests)

    # ---- text ----------------------------------------------------------------------
    def reader(self, request: Request) -> GrowingText:
        """The text of a completion's tokens, as it reads after ``request``'s prompt
        (``AfterPrompt``: a sentencepiece tokenizer's first space kept); special tokens and
        the end-of-sequence token not shown. Read as they come (``GrowingText``: each read
        costs the tokens since a recent point, not all of them)."""
        return GrowingText(self._tok(), request.ids[0].tolist(),
                           skip_special_tokens=True, hidden=self.eos)

    def pieces(self) -> TokenPieces:
        """The tokenizer's tokens as bytes and text (log-probabilities name each token)."""
        if self._pieces is None:
            self._pieces = TokenPieces(self._tok())
        return self._pieces

    def finish_reason(self, request: Request, stopped: bool) -> str:
        if stopped or (request.output and request.output[-1] in self.eos):
            return "stop"
        return "length"

    def record(self, outcome: str, *requests: Request) -> None:
        """One HTTP request's ``outcome``, and the tokens of its choices' ``requests``."""
        with self.lock:
            c = self.counters
            c.requests[outcome] = c.requests.get(outcome, 0) + 1
            for request in requests:
                c.prompt_tokens += int(request.ids.shape[1])
                c.completion_tokens += len(request.output)
                c.decode_s += request.decode_s()

    def _tok(self) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids "
                           "to /v1/completions", "prompt")
        return self.tokenizer

    def _encode(self, text: str) -> list[int]:
        self._refuse_long(text)
        return list(self._tok()(text).input_ids)

    def _refuse_long(self, text: str, special: bool = True) -> None:
        """Refuse a text that cannot fit the positions from its first characters alone: a
        prompt of megabytes would otherwise be tokenized whole (seconds and most of a GiB)
        only to be refused, holding a thread every client's request needs."""
        head = self.positions * PREFIX_CHARS
        if not self.positions or len(text) <= head:
            return
        n = len(self._tok()(text[:head], add_special_tokens=special).input_ids)
        if n > self.positions + CUT_TOKENS:
            raise ApiError(400, f"the prompt has more than {self.positions} tokens (its first "
                           f"{head} characters alone have {n}); this model takes at most "
                           f"{self.positions} positions, prompt and completion together",
                           "prompt", code="context_length_exceeded")


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}
