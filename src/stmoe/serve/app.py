"""The HTTP side of ``stmoe serve``: FastAPI routes speaking the OpenAI API.

Every body is parsed and checked here (``protocol``) before it reaches the model; a
bad one gets the OpenAI error object with its status (400, 404, 408, 413, 429, 500) and
the server goes on serving. The body is read within its limits, not checked after:
a ``Content-Length`` over ``MAX_BODY`` is refused before a byte of it is read, a
chunked body is cut off at the limit, and one that does not arrive within
``body_timeout`` seconds is answered 408. A checked request becomes one batcher request
per choice, and ``responses.Reply`` answers it (a client that goes away has its choices
cancelled: they leave the batch at the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from stmoe.serve.metrics import metrics_text
from stmoe.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    lone_surrogate,
    validation_message,
)
from stmoe.serve.responses import Reply
from stmoe.serve.service import Service

MAX_BODY = 4 * 2**20
BODY_TIMEOUT = 30.0  # seconds for a request's body to arrive whole
log = logging.getLogger("stmoe.serve")


def create_app(service: Service, body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """The routes over ``service`` (which the caller closes)."""
    app = FastAPI(title="stmoe serve", docs_url=None, redoc_url=None, openapi_url=None)

    def refused(status: int) -> None:
        """A client's request refused before any work (a 4xx: bad JSON or fields, an
        unknown model or path, a body too big or too slow), counted as ``invalid``; a full
        queue's 429 is counted where it is raised (``rejected``)."""
        if 400 <= status < 500 and status != 429:
            service.record("invalid")

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        refused(exc.status)
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        """A failure no check foresaw: the OpenAI error object, one log line, no traceback."""
        log.error("a request failed: %s: %s", type(exc).__name__, exc)
        return error_response(ApiError(500, f"the server failed: {type(exc).__name__}",
                                       kind="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        refused(exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind=kind).body(),
                            status_code=exc.status_code, headers=exc.headers)  # (405: Allow)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        refused(400)
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

    # the body is decoded, validated and its prompt tokenized on a thread (json and the
    # tokenizer let go of the GIL in parts): a body of megabytes takes seconds, which on
    # the event loop would stall every other client
    @app.post("/v1/completions")
    async def completions(http: Request) -> Any:
        raw = await _body(http, body_timeout)
        req, ids = await asyncio.to_thread(_prepare, service, CompletionRequest, raw)
        return await _reply(service, http, req, ids)

    @app.post("/v1/chat/completions")
    async def chat(http: Request) -> Any:
        raw = await _body(http, body_timeout)
        req, ids = await asyncio.to_thread(_prepare, service, ChatRequest, raw)
        return await _reply(service, http, req, ids)

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


async def _body(http: Request, timeout: float) -> bytearray:
    """The body's bytes, read within MAX_BODY bytes and ``timeout`` seconds."""
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
    return raw


def _json(raw: bytes | bytearray) -> Any:
    """The body's JSON: UTF-8 only (RFC 8259; ``json.loads`` of bytes would guess UTF-16 or
    skip a byte-order mark), a lone surrogate let through to be named by ``_parse``."""
    try:
        return json.loads(bytes(raw).decode("utf-8", "surrogatepass"))
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: not UTF-8 ({exc})") from None
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None


def _parse(model: Any, raw: bytes | bytearray) -> Any:
    """The body as a ``model`` request, checked; run on a thread (``_prepare``): a body of
    megabytes takes seconds to decode and validate."""
    body = _json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    bad = lone_surrogate(body)
    if bad is not None:
        raise ApiError(400, *bad)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise ApiError(400, message, param) from None


def _prepare(service: Service, model: Any, raw: bytes | bytearray) -> tuple[Any, list[int]]:
    """A request's body as (the request, its prompt's token ids), each step checked."""
    req = _parse(model, raw)
    _check_model(service, req.model)
    ids = service.chat_ids(req) if isinstance(req, ChatRequest) else service.completion_ids(req)
    return req, ids


def _check_model(service: Service, name: str) -> None:
    if name != service.name:
        raise ApiError(404, f"model {name!r} is not served here; this server serves "
                       f"{service.name!r} (GET /v1/models)", "model", kind="not_found_error",
                       code="model_not_found")


async def _reply(service: Service, http: Request, req: CompletionRequest | ChatRequest,
                 ids: list[int]) -> Any:
    """``req``'s choices run (one batcher request each) and answered, whole or streamed."""
    jobs = service.requests(ids, req.limit(), req.sampling(req.logprob_count()),
                            req.choices(), req.limit_name())
    return await Reply(service, http, jobs, req).respond()
