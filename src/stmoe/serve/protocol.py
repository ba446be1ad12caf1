"""The OpenAI API's request bodies as stmoe serves them, checked before anything runs.

Every field is typed strictly: a wrong type is refused naming the field, never
reinterpreted (``"prompt": ["1", 2]`` is not the token ids [1, 2], ``true`` is not 1).
Every string must be valid Unicode (a lone surrogate cannot be tokenized). Unknown
fields are refused (a typo must not pass as a default). Decoding is greedy:
``temperature`` 0 (or absent) and ``top_p`` 1 only, ``n`` 1 only; sampling would
make the output depend on more than the prompt, and the server's promise is that a
request's tokens are the resident model's greedy tokens, whatever else runs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

STRICT = ConfigDict(extra="forbid", strict=True)
MAX_STOPS = 4


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


def unicode_text(v: str) -> str:
    """``v`` unchanged, or refused if it holds a lone surrogate (not encodable as UTF-8:
    JSON's ``"\\ud800"`` decodes to one, which no tokenizer takes)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode at character {exc.start} (a lone surrogate "
                         f"{v[exc.start]!a})") from None
    return v


def _strict_str(v: object, what: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{what} must be a string, got {_kind(v)}")
    return unicode_text(v)


def _kind(v: object) -> str:
    """The JSON type of ``v``, as a message names it."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _prompt(v: object) -> str | list[int]:
    """Text, a list of token ids, or a list of one text: nothing coerced."""
    if isinstance(v, str):
        return unicode_text(v)
    if not isinstance(v, list):
        raise ValueError(f"expected a string or a list of token ids, got {_kind(v)}")
    if not v:
        raise ValueError("the prompt is empty")
    if all(type(t) is int for t in v):
        return list(v)
    if all(isinstance(t, str) for t in v):
        if len(v) != 1:
            raise ValueError("one prompt per request (a list of several prompts is n > 1)")
        return _strict_str(v[0], "the prompt")
    kinds = sorted({_kind(t) for t in v})
    raise ValueError("a list prompt is token ids (integers) or one string; this one holds "
                     + " and ".join(kinds))


def _stops(v: object) -> list[str] | None:
    """None, a string or a list of at most MAX_STOPS non-empty strings, as a list."""
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list):
        raise ValueError(f"expected a string or a list of strings, got {_kind(v)}")
    out = [_strict_str(s, "each stop") for s in stops]
    if len(out) > MAX_STOPS or any(not s for s in out):
        raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings")
    return out


def _content(v: object) -> str:
    """A message's content: a string, or text parts (joined): this server reads text."""
    if isinstance(v, str):
        return unicode_text(v)
    if not isinstance(v, list):
        raise ValueError(f"expected a string or a list of text parts, got {_kind(v)}")
    texts = []
    for part in v:
        if not (isinstance(part, dict) and set(part) == {"type", "text"}
                and part["type"] == "text"):
            raise ValueError('each content part must be {"type": "text", "text": ...} '
                             "(this server's models read text)")
        texts.append(_strict_str(part["text"], "a part's text"))
    return "".join(texts)


Text = Annotated[str, AfterValidator(unicode_text)]
Prompt = Annotated[str | list[int], BeforeValidator(_prompt)]
Stops = Annotated[list[str] | None, BeforeValidator(_stops)]
Content = Annotated[str, BeforeValidator(_content)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take. ``max_tokens`` absent or null: the service's one
    default (as far as the model's positions go)."""

    model_config = STRICT
    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Stops = None
    seed: int | None = None  # accepted: greedy decoding draws nothing
    user: Text | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None

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

    def stops(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(_Common):
    """``POST /v1/completions``: a prompt (text, or token ids)."""

    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None

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

    def limit(self) -> int | None:
        return self.max_tokens


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: Content
    name: Text | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        return self.content


class ChatRequest(_Common):
    """``POST /v1/chat/completions``: messages, rendered by the tokenizer's chat template
    (or, without one, as ``role: content`` lines ending with ``assistant:``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """pydantic's first error as one line, and the field it names."""
    if not errors:
        return "the request is invalid", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body" and not _union_tag(p)]
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


def _union_tag(part: object) -> bool:
    """A step of pydantic's error location naming a union's member ('str', 'list[int]',
    'ChatMessage'), not a field: left out of ``param``."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or part[:1].isupper())
