"""The value checks the request bodies share (``protocol``): strict text, prompts, stop
strings, message content, and the standard OpenAI fields this server takes only at their
default value.

Why the last: clients and frameworks send OpenAI's fields with their defaults (``logprobs:
false``, ``logit_bias: {}``, ``tools: []``, ...). Such a field is accepted at its default,
and refused by name at any other value with the reason this server cannot honour it,
never as an unknown field (which a typo still is).
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, JsonValue

MAX_STOPS = 4


def unicode_text(v: str) -> str:
    """``v`` unchanged, or refused if it holds a lone surrogate (not encodable as UTF-8:
    JSON's ``"\\ud800"`` decodes to one, which no tokenizer takes)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode at character {exc.start} (a lone surrogate "
                         f"{v[exc.start]!a})") from None
    return v


def strict_str(v: object, what: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{what} must be a string, got {kind(v)}")
    return unicode_text(v)


def kind(v: object) -> str:
    """The JSON type of ``v``, as a message names it."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _prompt(v: object) -> str | list[int]:
    """Text, a list of token ids, or a list of one text: nothing coerced."""
    if isinstance(v, str):
        return unicode_text(v)
    if not isinstance(v, list):
        raise ValueError(f"expected a string or a list of token ids, got {kind(v)}")
    if not v:
        raise ValueError("the prompt is empty")
    if all(type(t) is int for t in v):
        return list(v)
    if all(isinstance(t, str) for t in v):
        if len(v) != 1:
            raise ValueError("one prompt per request (a list of several prompts is not "
                             "supported; n asks for several completions of one)")
        return strict_str(v[0], "the prompt")
    kinds = sorted({kind(t) for t in v})
    raise ValueError("a list prompt is token ids (integers) or one string; this one holds "
                     + " and ".join(kinds))


def _stops(v: object) -> list[str] | None:
    """None, a string or a list of at most MAX_STOPS non-empty strings, as a list."""
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list):
        raise ValueError(f"expected a string or a list of strings, got {kind(v)}")
    out = [strict_str(s, "each stop") for s in stops]
    if any(not s for s in out):
        raise ValueError("an empty string is no stop string (it would end every completion "
                         "at once)")
    if len(out) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(out)}")
    return out


def _content(v: object) -> str:
    """A message's content: a string, or text parts (joined): this server reads text."""
    if isinstance(v, str):
        return unicode_text(v)
    if not isinstance(v, list):
        raise ValueError(f"expected a string or a list of text parts, got {kind(v)}")
    texts = []
    for part in v:
        if not (isinstance(part, dict) and set(part) == {"type", "text"}
                and part["type"] == "text"):
            raise ValueError('each content part must be {"type": "text", "text": ...} '
                             "(this server's models read text)")
        texts.append(strict_str(part["text"], "a part's text"))
    return "".join(texts)


Text = Annotated[str, AfterValidator(unicode_text)]
Prompt = Annotated[str | list[int], BeforeValidator(_prompt)]
Stops = Annotated[list[str] | None, BeforeValidator(_stops)]
Content = Annotated[str, BeforeValidator(_content)]


def only(*defaults: JsonValue, why: str) -> AfterValidator:
    """A field taken only at one of ``defaults`` (or null): any other value refused, saying
    ``why`` this server cannot honour it. Values compare as JSON (``0`` and ``0.0`` alike,
    ``false`` never ``0``)."""
    shown = " or ".join(json.dumps(d) for d in defaults) + ", or leave it out" if defaults \
        else "null, or leave it out"

    def check(v: JsonValue) -> JsonValue:
        if v is None or any(_same(v, d) for d in defaults):
            return v
        raise ValueError(f"{_short(v)} is not supported: {why} (send {shown})")

    return AfterValidator(check)


def _same(v: JsonValue, default: JsonValue) -> bool:
    if isinstance(v, bool) or isinstance(default, bool):
        return v is default
    if isinstance(v, int | float) and isinstance(default, int | float):
        return v == default
    return type(v) is type(default) and v == default


def _short(v: JsonValue) -> str:
    # (a lone surrogate escaped: the refusal must encode; app.py refuses one first anyway)
    text = json.dumps(v, ensure_ascii=False).encode("utf-8", "backslashreplace").decode()
    return text if len(text) <= 60 else text[:57] + "..."
