"""The HTTP side of ``stmoe serve``: FastAPI routes speaking the OpenAI API.

Every body is parsed and checked here (``protocol``) before it reaches the model; a
bad one gets the OpenAI error object with its status (400, 404, 408, 413, 429, 500) and
the server goes on serving. The body is read within its limits, not checked after:
a ``Content-Length`` over ``MAX_BODY`` is refused before a byte of it is read, a
chunked body is cut off at the limit, and one that does not arrive within
``body_timeout`` seconds is answered 408. A streaming client that goes away has its
request cancelled (it leaves the batch at the next step); so does one whose
non-streaming request is still running when it disconnects (counted ``cancelled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from stmoe.errors import OffloadError
from stmoe.runtime.batcher import QueueFull
from stmoe.runtime.batcher import Request as Job
from stmoe.serve.metrics import metrics_text
from stmoe.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    validation_message,
)
from stmoe.serve.service import Service
from stmoe.serve.text import TextStream

MAX_BODY = 4 * 2**20
BODY_TIMEOUT = 30.0  # seconds for a request's body to arrive whole
log = logging.getLogger("stmoe.serve")


def create_app(service: Service, body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """The routes over ``service`` (which the caller closes)."""
    app = FastAPI(title="stmoe serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        """A failure no check foresaw: the OpenAI error object, one log line, no traceback."""
        log.error("a request failed: %s: %s", type(exc).__name__, exc)
        return error_response(ApiError(500, f"the server failed: {type(exc).__name__}",
                                       kind="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return JSONResponse(ApiError(400, message, param).body(), status_code=400)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, queued = service.batcher.queue_depth()
        return {"status": "ok", "model": service.name, "running": running, "queued": queued}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.name, "object": "model",
                                            "created": int(service.counters.started),
                                            "owned_by": "stmoe"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics_text(service),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(http: Request) -> Any:
        req = _parse(CompletionRequest, await _body(http, body_timeout))
        _check_model(service, req.model)
        job = service.request(service.completion_ids(req), req.limit())
        return await _respond(service, http, job, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: Request) -> Any:
        req = _parse(ChatRequest, await _body(http, body_timeout))
        _check_model(service, req.model)
        job = service.request(service.chat_ids(req), req.limit())
        return await _respond(service, http, job, req, chat=True)

    return app


class QuietErrors:
    """``app`` without the traceback uvicorn would log for an exception Starlette re-raises
    after its handler (``_unexpected``) answered it and logged one line."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(Exception):  # answered and logged by ``_unexpected``
            await self.app(scope, receive, send)


def error_response(exc: ApiError) -> JSONResponse:
    """``exc`` as the OpenAI error object (``Connection: close`` where the body was not read
    whole: the connection cannot carry another request)."""
    headers = {"Connection": "close"} if exc.close else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _body(http: Request, timeout: float) -> Any:
    """The body as JSON, read within MAX_BODY bytes and ``timeout`` seconds."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(413, f"the body is {declared} bytes, over the {MAX_BODY} this server "
                       "takes", close=True)
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in http.stream():
                raw += chunk
                if len(raw) > MAX_BODY:
                    raise ApiError(413, f"the body is over the {MAX_BODY} bytes this server "
                                   "takes", close=True)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {timeout:g} s", close=True) from None
    except ClientDisconnect:  # nobody left to read the answer
        raise ApiError(400, "the client went away while sending its body", close=True) from None
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None


def _parse(model: Any, body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise ApiError(400, message, param) from None


def _check_model(service: Service, name: str) -> None:
    if name != service.name:
        raise ApiError(404, f"model {name!r} is not served here; this server serves "
                       f"{service.name!r} (GET /v1/models)", "model", kind="not_found_error",
                       code="model_not_found")


async def _respond(service: Service, http: Request, job: Job, req: Any, chat: bool) -> Any:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[int | None] = asyncio.Queue()
    job.listener = lambda t: loop.call_soon_threadsafe(events.put_nowait, t)
    try:
        service.submit(job)
    except QueueFull as exc:
        service.record("rejected")
        raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full") from None
    except OffloadError as exc:
        service.record("rejected")
        raise ApiError(503, str(exc), kind="server_error") from None
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()), "model": service.name}
    text = TextStream(service, job, req.stops())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_sse(service, job, events, text, meta, chat, include_usage),
                                 media_type="text/event-stream")
    try:
        while True:
            if await _next(events, http, job) is None:
                break
            text.push()
    except BaseException:
        job.cancel()
        service.record("cancelled")
        raise
    text.flush()  # the last piece, its stop strings applied
    if job.error is not None and job.cancelled.is_set() and not text.stopped:
        service.record("cancelled")  # its client went away (or the server is closing)
        raise ApiError(503, "the request was cancelled before it finished", kind="server_error")
    _raise_failed(service, job, text.stopped)
    service.record("ok", job)
    reason = service.finish_reason(job, text.stopped)
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text.final()}
    else:
        choice["text"] = text.final()
    return {**meta, "object": "chat.completion" if chat else "text_completion",
            "choices": [choice], "usage": _usage(job, service)}


async def _next(events: asyncio.Queue[int | None], http: Request, job: Job) -> int | None:
    """The next token (None: the end), cancelling the job if the client went away."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.25)
        except TimeoutError:
            if await http.is_disconnected():
                job.cancel()


async def _sse(service: Service, job: Job, events: asyncio.Queue[int | None], text: TextStream,
               meta: dict[str, Any], chat: bool, include_usage: bool) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            d: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta:
                d["content"] = delta
            choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
        return "data: " + json.dumps({**meta, "object": kind, "choices": [choice]}) + "\n\n"

    try:
        if chat:
            yield chunk(None, None, first=True)
        while await events.get() is not None:
            delta = text.push()
            if delta:
                yield chunk(delta, None)
        if job.error is not None and not text.stopped:
            message = _failure(service, job)
            yield "data: " + json.dumps(ApiError(500, message, kind="server_error").body()) + \
                "\n\n"
            return
        rest = text.flush()
        service.record("ok", job)
        yield chunk(rest, service.finish_reason(job, text.stopped))
        if include_usage:
            yield "data: " + json.dumps({**meta, "object": kind, "choices": [],
                                         "usage": _usage(job, service)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): the job leaves the batch
        if not job.done.is_set():
            job.cancel()
            service.record("cancelled")


def _raise_failed(service: Service, job: Job, stopped: bool) -> None:
    """A failed job as a 500 (one cancelled by its stop string is done, not failed)."""
    if job.error is None or stopped:
        return
    raise ApiError(500, _failure(service, job), kind="server_error")


def _failure(service: Service, job: Job) -> str:
    service.record("error")
    return f"the request failed: {job.error}"


def _usage(job: Job, service: Service) -> dict[str, Any]:
    """The OpenAI usage, with stmoe's extension: what the request met, and the weights'
    formats it ran in (a quantized one is lossy: named in every response)."""
    prompt, completion = int(job.ids.shape[1]), len(job.output)
    decode = job.decode_s()
    extra = job.usage.to_dict()
    extra["weights"] = service.om.config["weights_label"]
    extra["resident_weights"] = service.om.config["resident_weights"]
    extra["decode_tokens_per_s"] = (completion - 1) / decode if decode > 0 else 0.0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "stmoe": extra}
