"""The OpenAI API's request bodies as stmoe serves them, checked before anything runs.

Every field is typed strictly: a wrong type is refused naming the field, never
reinterpreted (``"prompt": ["1", 2]`` is not the token ids [1, 2], ``true`` is not 1).
Every string must be valid Unicode (a lone surrogate cannot be tokenized). Unknown
fields are refused (a typo must not pass as a default); OpenAI's standard fields that
this server cannot honour are taken at their default and refused by name at any other
value (``fields.only``). Sampling follows OpenAI's defaults (``temperature`` 1, ``top_p``
1) and vLLM's ``top_k``; each request draws from its own generator (``Sampling``), so a
request with a ``seed`` gets its solo output whatever else runs; ``temperature`` 0 is
greedy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationInfo, field_validator

from stmoe.runtime.batcher import Sampling
from stmoe.serve.fields import Content, Prompt, Stops, Text, only, unicode_text

STRICT = ConfigDict(extra="forbid", strict=True)
MAX_LOGPROBS = 20  # top log-probabilities per token, at most (OpenAI's chat limit)
SEEDS = (-(2**63), 2**64 - 1)  # a seed's range: int64 or uint64 (torch takes it modulo 2^64)
NO_TOOLS = "this server does not call tools: its output is not parsed for tool calls"
TEXT_ONLY = "this server's models read and write text only"

class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status``, a message, the offending ``param``;
    ``close``: answered with ``Connection: close`` (the body was not read whole)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, _encodable(message), None if param is None else _encodable(param), kind,
            code)
        self.close = close

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (an unknown field's name may
    hold one, and the answer must still encode as UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted either way: no obfuscation field is sent


class _Common(BaseModel):
    """Fields both endpoints take. ``max_tokens`` absent or null: the service's one
    default (as far as the model's positions go). ``seed`` (any int64 or uint64) seeds the
    request's generator; choice i of ``n`` uses ``seed + i``."""

    model_config = STRICT
    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)  # null: 1
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # vLLM's: -1, 0 or absent keep every token
    seed: int | None = Field(None, ge=SEEDS[0], le=SEEDS[1])
    stop: Stops = None
    max_tokens: int | None = None
    user: Text | None = None
    presence_penalty: Annotated[float | None, only(0, why="this server applies no penalties")
                                ] = None
    frequency_penalty: Annotated[float | None, only(0, why="this server applies no penalties")
                                 ] = None
    logit_bias: Annotated[dict[str, JsonValue] | None,
                          only({}, why="this server does not bias logits")] = None

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # what it asks for has no effect on a whole answer: refused, not ignored (at its
        # default, as clients send it with stream false, taken)
        if v is not None and v.include_usage and not info.data.get("stream"):
            raise ValueError("include_usage is for a streamed answer (a whole one always "
                             "has its usage): send it with stream: true, or leave it out")
        return v

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def sampling(self, logprobs: int | None) -> Sampling:
        """The request's decoding, OpenAI's defaults filled in; ``logprobs``: how many top
        log-probabilities each token reports (None: none)."""
        return Sampling(temperature=1.0 if self.temperature is None else self.temperature,
                        top_p=1.0 if self.top_p is None else self.top_p,
                        top_k=max(self.top_k or 0, 0), seed=self.seed, logprobs=logprobs)


class CompletionRequest(_Common):
    """``POST /v1/completions``: a prompt (text, or token ids)."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Annotated[bool | None, only(False, why="the prompt is not returned with its "
                                      "log-probabilities")] = None
    suffix: Annotated[Text | None, only("", why="this server does not insert text")] = None
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _every_choice(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if v is not None and v != n:
            raise ValueError(f"{v} is not supported: every choice is returned, none picked "
                             f"(send best_of equal to n, {n}, or leave it out)")
        return v

    def limit(self) -> int | None:
        return self.max_tokens

    def limit_name(self) -> str:
        """The field ``limit`` came from (a refusal names it)."""
        return "max_tokens"

    def logprob_count(self) -> int | None:
        """Top log-probabilities per token (None: no log-probabilities)."""
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: Content
    name: Text | None = None
    refusal: Annotated[Text | None, only(why="a refusal is not read back")] = None
    tool_calls: Annotated[list[JsonValue] | None, only([], why=NO_TOOLS)] = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        return self.content


class ChatRequest(_Common):
    """``POST /v1/chat/completions``: messages, rendered by the tokenizer's chat template
    (or, without one, as ``role: content`` lines ending with ``assistant:``). OpenAI's
    other fields are taken at their defaults (module docstring)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[JsonValue] | None, only([], why=NO_TOOLS)] = None
    tool_choice: Annotated[JsonValue, only("none", "auto", why=NO_TOOLS)] = None
    functions: Annotated[list[JsonValue] | None, only([], why=NO_TOOLS)] = None
    function_call: Annotated[JsonValue, only("none", "auto", why=NO_TOOLS)] = None
    parallel_tool_calls: bool | None = None  # no tool is called, one at a time or not
    response_format: Annotated[dict[str, JsonValue] | None, only(
        {"type": "text"}, why="this server does not constrain its output to a format")] = None
    store: Annotated[bool | None, only(False, why="this server keeps no completions")] = None
    metadata: dict[str, Text] | None = None  # tags; nothing is stored
    service_tier: Annotated[Text | None, only("auto", "default", why="this server has one "
                                              "tier")] = None
    modalities: Annotated[list[Text] | None, only(["text"], why=TEXT_ONLY)] = None
    audio: Annotated[JsonValue, only(why=TEXT_ONLY)] = None
    prediction: Annotated[JsonValue, only(why="predicted outputs are not supported")] = None
    reasoning_effort: Annotated[Text | None, only(why="this server's models have no reasoning "
                                                  "setting")] = None
    verbosity: Annotated[Text | None, only("medium", why="this server's models have no "
                                           "verbosity setting")] = None
    web_search_options: Annotated[JsonValue, only(why="this server does not search the web")
                                  ] = None
    moderation: Annotated[JsonValue, only(why="this server moderates nothing")] = None
    prompt_cache_key: Text | None = None  # hints for a prompt cache: this server keeps none
    prompt_cache_retention: Text | None = None
    prompt_cache_options: dict[str, JsonValue] | None = None
    safety_identifier: Text | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true (top_logprobs are the top log-probabilities "
                             "of each token logprobs returns)")
        return v

    def limit(self) -> int | None:
        if self.max_completion_tokens is None:
            return self.max_tokens
        if self.max_tokens is not None and self.max_tokens < 1:  # (unused, but not ignored)
            raise ApiError(400, f"max_tokens must be at least 1, got {self.max_tokens} "
                           "(beside max_completion_tokens, the one used: leave it out)",
                           "max_tokens")
        return self.max_completion_tokens

    def limit_name(self) -> str:
        """The field ``limit`` came from (a refusal names it)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None \
            else "max_tokens"

    def logprob_count(self) -> int | None:
        """Top log-probabilities per token (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def lone_surrogate(body: Any) -> tuple[str, str] | None:
    """The first string of ``body`` (a parsed JSON value: its objects' keys included) that
    holds a lone surrogate, as (message, the field's path), or None. Why before the fields'
    own checks: a key (an unknown field's, ``metadata``'s) or a value pydantic keeps as
    JSON would pass them, and a refusal quoting it could not be encoded (a 500)."""
    stack: list[tuple[Any, str, str | None]] = [(body, "", None)]  # (value, path, its key)
    while stack:  # depth first in the body's order (not recursive: it may nest deep)
        value, path, key = stack.pop()
        if key is not None:
            try:
                unicode_text(key)
            except ValueError as exc:
                name = _encodable(path)
                return f"{name}: a field's name of {exc}", name
        if isinstance(value, dict):
            stack.extend((item, f"{path}.{k}" if path else str(k), str(k))
                         for k, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}" if path else str(i), None)
                         for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, str):
            try:
                unicode_text(value)
            except ValueError as exc:
                return f"{path}: {exc}", path
    return None


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """pydantic's first error as one line, and the field it names."""
    if not errors:
        return "the request is invalid", None
    e = errors[0]
    kind, msg = e.get("type", ""), str(e.get("msg", "invalid"))
    parts = [p for p in e.get("loc", ()) if p != "body"]
    # an unknown field's last step is the client's own key, whatever it looks like
    # ('Temperature', 'str'): never taken for a union's tag
    own = [str(parts.pop())] if kind == "extra_forbidden" and parts else []
    loc = [str(p) for p in parts if not _union_tag(p)] + own
    param = ".".join(loc) or None
    if kind == "json_invalid":
        ctx = e.get("ctx") or {}
        return f"the body is not valid JSON ({ctx.get('error', msg)})", None
    if kind == "extra_forbidden":
        return f"unknown field {param!r}", param
    if kind == "missing":
        return f"missing field {param!r}", param
    msg = msg.removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def _union_tag(part: object) -> bool:
    """A step of pydantic's error location naming a union's member ('str', 'list[int]',
    'ChatMessage'), not a field: left out of ``param``."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or part[:1].isupper())
