"""Reading JSON: engines' responses (the document, base64 fields and integer fields) and
JSON Lines files, one checked object per line.

Serving engines answer HTTP requests with JSON whose routing is base64 (vLLM: the
bytes of a ``.npy`` file; SGLang: raw little-endian ids). These helpers turn each
into checked values with errors that name the response and field.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stmoe.errors import TraceError
from stmoe.util.progress import progress_bytes


def load_json(path: Path, what: str = "an engine's response") -> Any:
    """The whole JSON document, or one clear error (truncation named as such);
    ``what`` names the document expected."""
    text = path.read_bytes()
    try:
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise TraceError(f"not UTF-8 text ({exc})", expected="a JSON document") from None
    except RecursionError:
        raise TraceError("JSON nested too deeply", expected=what) from None
    except json.JSONDecodeError as exc:
        truncated = exc.pos >= len(text.rstrip()) - 1
        raise TraceError(f"not valid JSON: {exc.msg}",
                         position=f"line {exc.lineno}, column {exc.colno}",
                         expected=f"{what}, complete",
                         hint="the file looks truncated" if truncated else None
                         ) from None


def json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """A JSON Lines file's objects with their line numbers (blank lines skipped); one
    clear error for a line that is not a JSON object."""
    with open(path, "rb") as f:
        lines = progress_bytes(f, path, "reading JSON Lines")
        for lineno, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except RecursionError:
                raise TraceError("JSON nested too deeply", position=f"line {lineno}",
                                 expected="one flat record per line") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                truncated = not raw.endswith(b"\n")
                raise TraceError(
                    f"not valid JSON ({exc})",
                    position=f"line {lineno}",
                    expected="one JSON object per line",
                    hint="the file looks truncated" if truncated else None,
                ) from None
            if not isinstance(obj, dict):
                raise TraceError(
                    f"a JSON {type(obj).__name__} instead of an object",
                    position=f"line {lineno}",
                    expected="one JSON object per line",
                )
            yield lineno, obj


def b64_bytes(value: Any, where: str) -> bytes:
    """Decode a base64 string field strictly (a cut-off string is an error, not less data)."""
    if not isinstance(value, str) or not value:
        raise TraceError(f"'routed_experts' is {_kind(value)}", position=where,
                         expected="a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TraceError(f"'routed_experts' is not valid base64 ({exc})", position=where,
                         expected="complete base64 text",
                         hint="the response looks truncated") from None


def opt_int(obj: Any, key: str, where: str) -> int | None:
    """An optional non-negative integer field of a JSON object."""
    value = obj.get(key) if isinstance(obj, dict) else None
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
        raise TraceError(f"{key!r} is {value!r}", position=where, expected="an integer >= 0")
    return value


def id_list(value: Any, key: str, where: str) -> list[int] | None:
    """An optional list of token ids."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in value
    ):
        raise TraceError(f"{key!r} is not a list of token ids", position=where,
                         expected="integers >= 0")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "missing"
    text = repr(value)
    return f"a JSON {type(value).__name__} {text[:30]}" + ("..." if len(text) > 30 else "")
