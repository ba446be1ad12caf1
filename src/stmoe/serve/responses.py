"""A completion request's answer, whole or streamed: its ``n`` choices (one batcher request
each), their text, finish reasons and log-probabilities, and the usage.

A client that goes away has every choice cancelled (they leave the batch at the next
step) and the request counted ``cancelled``; a choice that fails fails the request (a
500, or an error event in a stream). Each HTTP request is counted once, by outcome.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from stmoe.errors import OffloadError
from stmoe.runtime.batcher import QueueFull, TokenLogprob, Usage
from stmoe.runtime.batcher import Request as Job
from stmoe.serve.logprobs import chat_logprobs, completion_logprobs
from stmoe.serve.protocol import ApiError, ChatRequest, CompletionRequest
from stmoe.serve.service import Service
from stmoe.serve.text import TextStream

Events = asyncio.Queue[tuple[int, int | None]]  # (choice, its next token; None: its end)
POLL_S = 0.25  # how often a whole answer asks whether its client is still there


@dataclass(eq=False)
class Choice:
    """One choice's job, its text so far, and how many of its tokens' log-probabilities
    were sent."""

    index: int
    job: Job
    text: TextStream
    sent: int = 0

    def new_logprobs(self, eos: set[int]) -> list[tuple[int, TokenLogprob]]:
        """(position, entry) of the tokens the text now covers and not yet sent; the
        end-of-sequence token, not in the text, has none."""
        upto, start = self.text.used, self.sent
        self.sent = max(start, upto)
        return [(i, e) for i, e in enumerate(self.job.logprobs[start:upto], start)
                if e.token not in eos]


class Reply:
    """The answer to one checked request whose choices' ``jobs`` are built, not yet queued."""

    def __init__(self, service: Service, http: Request, jobs: list[Job],
                 req: CompletionRequest | ChatRequest) -> None:
        self.service, self.http, self.req = service, http, req
        self.chat = isinstance(req, ChatRequest)
        self.logprobs = req.logprob_count() is not None
        self.choices = [Choice(i, job, TextStream(service.reader(job), job, req.stops()))
                        for i, job in enumerate(jobs)]
        self.jobs = jobs
        self.events: Events = asyncio.Queue()
        self.recorded = False
        self.polled = time.monotonic()  # when ``_next`` last asked if the client is there
        self.meta = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                     "created": int(time.time()), "model": service.name}

    async def respond(self) -> Any:
        loop = asyncio.get_running_loop()
        for i, job in enumerate(self.jobs):
            job.listener = lambda t, i=i: loop.call_soon_threadsafe(self.events.put_nowait,
                                                                     (i, t))
        try:
            self.service.submit(self.jobs)
        except QueueFull as exc:
            self._record("rejected")
            raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full") from None
        except OffloadError as exc:
            self._record("rejected")
            raise ApiError(503, str(exc), kind="server_error") from None
        if self.req.stream:
            return StreamingResponse(self._sse(), media_type="text/event-stream")
        return await self._whole()

    # ---- whole ---------------------------------------------------------------------
    async def _whole(self) -> dict[str, Any]:
        try:
            ended = 0
            while ended < len(self.choices):
                i, token = await self._next()
                if token is None:
                    ended += 1
                else:
                    self.choices[i].text.push()
        except BaseException:
            self._cancel()
            raise
        for c in self.choices:
            c.text.flush()  # the last piece, its stop strings applied
        if any(c.job.error is not None and c.job.cancelled.is_set() and not c.text.stopped
               for c in self.choices):
            self._record("cancelled")  # its client went away (or the server is closing)
            raise ApiError(503, "the request was cancelled before it finished",
                           kind="server_error")
        failed = self._failure()
        if failed is not None:
            raise ApiError(500, failed, kind="server_error")
        self._record("ok", *self.jobs)
        choices = [self._choice(c) for c in self.choices]
        return {**self.meta, "object": "chat.completion" if self.chat else "text_completion",
                "choices": choices, "usage": self._usage()}

    async def _next(self) -> tuple[int, int | None]:
        """The next event, cancelling every choice if the client went away: asked every
        ``POLL_S`` whether tokens come or not (a running choice makes one every few ms,
        so asking only when none came would never ask until its last)."""
        while True:
            now = time.monotonic()
            if now - self.polled >= POLL_S:
                self.polled = now
                if await self.http.is_disconnected():
                    for job in self.jobs:
                        job.cancel()
            try:
                return await asyncio.wait_for(self.events.get(), timeout=POLL_S)
            except TimeoutError:
                pass

    def _choice(self, c: Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": c.index, "finish_reason": self._reason(c),
                               "logprobs": self._logprobs(c)}
        if self.chat:
            out["message"] = {"role": "assistant", "content": c.text.final()}
        else:
            out["text"] = c.text.final()
        return out

    # ---- streamed ------------------------------------------------------------------
    async def _sse(self) -> AsyncIterator[str]:
        try:
            if self.chat:
                for c in self.choices:
                    yield self._chunk(c, None, None, first=True)
            ended = 0
            while ended < len(self.choices):
                i, token = await self.events.get()
                c = self.choices[i]
                if token is not None:
                    delta = c.text.push()
                    if delta:
                        yield self._chunk(c, delta, None)
                    continue
                ended += 1
                if c.job.error is not None and not c.text.stopped:
                    yield _event(ApiError(500, self._failure() or "", kind="server_error")
                                 .body())
                    return
                yield self._chunk(c, c.text.flush(), self._reason(c))
            self._record("ok", *self.jobs)
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield _event({**self.meta, "object": self._kind(), "choices": [],
                              "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): the jobs leave the batch
            if not all(job.done.is_set() for job in self.jobs):
                self._cancel()

    def _chunk(self, c: Choice, delta: str | None, reason: str | None,
               first: bool = False) -> str:
        logprobs = None if first else self._logprobs(c)
        if logprobs is not None and not (logprobs.get("content") or logprobs.get("tokens")):
            logprobs = None  # a chunk without tokens of its own (the last one, say)
        if self.chat:
            d: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta:
                d["content"] = delta
            choice = {"index": c.index, "delta": d, "finish_reason": reason,
                      "logprobs": logprobs}
        else:
            choice = {"index": c.index, "text": delta or "", "finish_reason": reason,
                      "logprobs": logprobs}
        return _event({**self.meta, "object": self._kind(), "choices": [choice]})

    def _kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    # ---- shared --------------------------------------------------------------------
    def _logprobs(self, c: Choice) -> dict[str, Any] | None:
        """The log-probabilities of ``c``'s tokens not sent yet (None where not asked)."""
        if not self.logprobs:
            return None
        entries = c.new_logprobs(self.service.eos)
        pieces = self.service.pieces()
        if self.chat:
            return chat_logprobs([e for _, e in entries], pieces)
        offsets = [c.text.length(i) for i, _ in entries]
        return completion_logprobs([e for _, e in entries], pieces, offsets)

    def _reason(self, c: Choice) -> str:
        return self.service.finish_reason(c.job, c.text.stopped)

    def _failure(self) -> str | None:
        """The first failed choice's error, counted (one that a stop string cancelled is
        done, not failed)."""
        for c in self.choices:
            if c.job.error is not None and not c.text.stopped:
                self._record("error")
                return f"the request failed: {c.job.error}"
        return None

    def _cancel(self) -> None:
        for job in self.jobs:
            job.cancel()
        self._record("cancelled")

    def _record(self, outcome: str, *jobs: Job) -> None:
        """The request's outcome, counted once (the first one told)."""
        if not self.recorded:
            self.recorded = True
            self.service.record(outcome, *jobs)

    def _usage(self) -> dict[str, Any]:
        """The OpenAI usage (the prompt counted once, every choice's tokens), with stmoe's
        extension: what the request met, and the weights' formats it ran in (a quantized
        one is lossy: named in every response)."""
        jobs = self.jobs
        # a choice a stop string ended counts up to the token that completed it (the
        # tokens made before it left the batch are not its completion's)
        completion = sum(c.text.used if c.text.stopped else len(c.job.output)
                         for c in self.choices)
        prompt = int(jobs[0].ids.shape[1])
        decode = max(j.decode_s() for j in jobs)
        extra = Usage.joint([j.usage for j in jobs]).to_dict()
        extra["weights"] = self.service.om.config["weights_label"]
        extra["resident_weights"] = self.service.om.config["resident_weights"]
        extra["decode_tokens_per_s"] = (completion - len(jobs)) / decode if decode > 0 else 0.0
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "stmoe": extra}


def _event(data: dict[str, Any]) -> str:
    return "data: " + json.dumps(data) + "\n\n"
