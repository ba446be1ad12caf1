"""Foreign routing formats in, one ``RoutingTrace`` out.

Supported, and recognised by content when the format is ``auto``:

- ``native``: stmoe's own ``.npz`` (see ``io``);
- ``npz``: a header-less ``.npz`` with the native array names (``experts``,
  ``seq_starts``, ``is_decode``, optional ``weights`` and a ``meta`` JSON string);
- ``npy``: a raw integer array ``[T, L, K]`` (what vLLM returns for routed experts);
- ``jsonl``: one record per (token, layer), in any order;
- ``routes``: nested per-token JSON with a ``routes`` list.

Every importer validates what it builds, and every error names the file and the
position (line, record, token, layer) of the first problem.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stmoe.errors import TraceError
from stmoe.trace import jsonl, routes
from stmoe.trace.arrays import read_headerless_npz, read_npy
from stmoe.trace.io import read_native
from stmoe.trace.schema import UNLABELLED, RoutingTrace
from stmoe.trace.select import concat

FORMATS = ("auto", "native", "npz", "npy", "jsonl", "routes")
_FIRST_LINE_MAX = 1 << 26  # a JSON Lines metadata line may be long; a routes file is one line


def sniff_format(path: str | Path) -> str:
    """The format of ``path`` judged by its content, never by its name."""
    path = _readable(Path(path))
    with open(path, "rb") as f:
        head = f.read(8)
        if not head:
            raise TraceError("the file is empty", file=path, expected="a routing trace")
        if head.startswith(b"PK\x03\x04"):
            return "native" if "header" in _npz_member_names(path) else "npz"
        if head.startswith(b"\x93NUMPY"):
            return "npy"
        f.seek(0)
        first_line = f.readline(_FIRST_LINE_MAX).removeprefix(b"\xef\xbb\xbf").strip()
    if first_line.startswith(b"{"):
        try:
            record = json.loads(first_line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return "routes"  # a pretty-printed object spans many lines
        return "routes" if isinstance(record, dict) and "routes" in record else "jsonl"
    if first_line.startswith(b"["):
        raise TraceError(
            "a top-level JSON array is not a supported trace",
            file=path,
            expected="JSON Lines records or an object with a 'routes' list",
        )
    raise TraceError(
        "the content is not a recognised trace format",
        file=path,
        expected="a .npz, a .npy array, JSON Lines records or a routes JSON object",
    )


def _readable(path: Path) -> Path:
    if not path.exists():
        raise TraceError("no such file", file=path)
    if path.is_dir():
        raise TraceError("is a directory", file=path, expected="a trace file")
    return path


def load_trace(path: str | Path, *, mmap: bool = False, **options: Any) -> RoutingTrace:
    """Open any supported trace file; ``mmap=True`` maps a native file's big arrays.

    ``options`` are those of ``import_file`` (``num_experts``, ``seq_starts``,
    ``domain``, ``model``); a native file needs none and ignores them.
    """
    if sniff_format(path) == "native":
        return read_native(path, mmap=mmap)
    return import_file(path, **options)


def import_files(
    paths: Sequence[str | Path],
    *,
    format: str = "auto",
    domain: str | None = None,
    drop_partial: bool = False,
    **options: Any,
) -> RoutingTrace:
    """Import several files as one trace (a routes file becomes one sequence).

    ``domain`` labels the sequences whose file carries no label of its own;
    ``drop_partial`` see ``concat``.
    """
    if not paths:
        raise TraceError("no input file given", expected="at least one trace file")
    parts = [import_file(p, format=format, domain=domain, **options) for p in paths]
    try:
        return concat(parts, drop_partial=drop_partial)
    except TraceError as exc:
        inferred = any(t.meta.extra.get("num_experts_inferred") for t in parts)
        raise TraceError(
            f"{', '.join(str(p) for p in paths)} cannot be joined: {exc.problem}"
            + (f" (expected {exc.expected})" if exc.expected else ""),
            hint="pass --num-experts N: some inputs had to infer it"
            if inferred
            else (exc.hint or "import traces of different models separately"),
        ) from None


def import_file(
    path: str | Path,
    *,
    format: str = "auto",
    domain: str | None = None,
    num_experts: int | None = None,
    seq_starts: str | Sequence[int] | None = None,
    model: str | None = None,
) -> RoutingTrace:
    """Import one file of any supported format into a validated trace."""
    path = _readable(Path(path))
    if format not in FORMATS:
        raise TraceError(f"unknown format {format!r}", expected=f"one of {', '.join(FORMATS)}")
    kind = sniff_format(path) if format == "auto" else format
    if seq_starts is not None and kind != "npy":
        raise TraceError(f"--seq-starts applies to .npy input, but this is {kind}", file=path,
                         hint="sequence starts come from the file itself")  # fmt: skip
    try:
        if kind == "native":
            trace = read_native(path)
            if num_experts is not None and num_experts != trace.num_experts:
                raise TraceError(f"--num-experts {num_experts} contradicts the file's "
                                 f"{trace.num_experts}")  # fmt: skip
        elif kind == "npz":
            trace = read_headerless_npz(path, num_experts)
        elif kind == "npy":
            trace = read_npy(path, num_experts, seq_starts)
        elif kind == "jsonl":
            trace = jsonl.read(path, num_experts=num_experts)
        else:
            trace = routes.read(path, num_experts=num_experts)
    except TraceError as exc:
        raise exc.in_file(path) from None
    if model is not None:
        trace = trace.with_meta(model=model)
    if domain is not None:
        trace = _label_unlabelled(trace, domain)
    return trace


def _label_unlabelled(trace: RoutingTrace, domain: str) -> RoutingTrace:
    labels = tuple(domain if d == UNLABELLED else d for d in trace.domains)
    return dataclasses.replace(trace, domains=labels)


def _npz_member_names(path: Path) -> set[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return {n[: -len(".npy")] for n in zf.namelist() if n.endswith(".npy")}
    except zipfile.BadZipFile as exc:
        raise TraceError(
            f"not a readable .npz file ({exc})", file=path, hint="the file may be truncated"
        ) from None
