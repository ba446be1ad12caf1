"""The OpenAI API's request bodies as stmoe serves them, checked before anything runs.

Unknown fields are refused (a typo must not pass as a default). Decoding is greedy:
``temperature`` 0 (or absent) and ``top_p`` 1 only, ``n`` 1 only; sampling would
make the output depend on more than the prompt, and the server's promise is that a
request's tokens are the resident model's greedy tokens, whatever else runs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status``, a message, the offending ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="forbid")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None  # accepted: greedy decoding draws nothing
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("n must be 1: this server returns one greedy completion per request")
        return v

    @field_validator("temperature")
    @classmethod
    def _greedy(cls, v: float | None) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError("temperature must be 0 (or left out): this server decodes greedily, "
                             "so a request's output is the resident model's, whatever else runs")
        return v

    @field_validator("top_p")
    @classmethod
    def _no_nucleus(cls, v: float | None) -> float | None:
        if v not in (None, 1, 1.0):
            raise ValueError("top_p must be 1 (or left out): this server decodes greedily")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError("penalties must be 0 (or left out): this server decodes greedily")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


class CompletionRequest(_Common):
    """``POST /v1/completions``: a prompt (text, or token ids)."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of several prompts is n > 1)")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


class TextPart(BaseModel):
    """A message's content part; text only (this server's models read text)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``: messages, rendered by the tokenizer's chat template
    (or, without one, as ``role: content`` lines ending with ``assistant:``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's first error as one line, and the field it names."""
    if not errors:
        return "the request is invalid", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind, msg = e.get("type", ""), str(e.get("msg", "invalid"))
    if kind == "json_invalid":
        ctx = e.get("ctx") or {}
        return f"the body is not valid JSON ({ctx.get('error', msg)})", None
    if kind == "extra_forbidden":
        return f"unknown field {param!r}", param
    if kind == "missing":
        return f"missing field {param!r}", param
    msg = msg.removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param
