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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace import jsonl, routes
from stmoe.trace.io import read_native, read_npz_arrays, trace_from_arrays
from stmoe.trace.schema import UNLABELLED, RoutingTrace, TraceMeta, validate
from stmoe.trace.select import concat

FORMATS = ("auto", "native", "npz", "npy", "jsonl", "routes")


def sniff_format(path: str | Path) -> str:
    """The format of ``path`` judged by its first bytes, never by its name."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise TraceError("no such file", file=path) from None
    except IsADirectoryError:
        raise TraceError("is a directory", file=path, expected="a trace file") from None
    if not head:
        raise TraceError("the file is empty", file=path, expected="a routing trace")
    if head.startswith(b"PK\x03\x04"):
        arrays = _npz_member_names(path)
        return "native" if "header" in arrays else "npz"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    text = head.lstrip()
    if text.startswith(b"{"):
        first_line = text.split(b"\n", 1)[0]
        try:
            record = json.loads(first_line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "routes"  # a pretty-printed object spans many lines
        is_record = isinstance(record, dict) and ("layer" in record or set(record) == {"meta"})
        return "jsonl" if is_record else "routes"
    if text.startswith(b"["):
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


def load_trace(path: str | Path, *, mmap: bool = False, **options: Any) -> RoutingTrace:
    """Open any supported trace file; ``mmap=True`` maps a native file's big arrays.

    ``options`` are those of ``import_file`` (``num_experts``, ``seq_starts``,
    ``domain``, ``model``) for formats that need them.
    """
    if sniff_format(path) == "native":
        return read_native(path, mmap=mmap)
    return import_file(path, **options)


def import_files(
    paths: Sequence[str | Path],
    *,
    format: str = "auto",
    domain: str | None = None,
    **options: Any,
) -> RoutingTrace:
    """Import several files as one trace (a routes file becomes one sequence).

    ``domain`` labels the sequences whose file carries no label of its own.
    """
    if not paths:
        raise TraceError("no input file given", expected="at least one trace file")
    parts = [import_file(p, format=format, domain=domain, **options) for p in paths]
    try:
        return concat(parts)
    except TraceError as exc:
        raise TraceError(
            f"the inputs cannot be joined: {exc}",
            hint="import traces of different models separately",
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
    path = Path(path)
    if format not in FORMATS:
        raise TraceError(f"unknown format {format!r}", expected=f"one of {', '.join(FORMATS)}")
    kind = sniff_format(path) if format == "auto" else format
    try:
        if kind == "native":
            trace = read_native(path)
        elif kind == "npz":
            trace = _import_npz(path, num_experts)
        elif kind == "npy":
            trace = _import_npy(path, num_experts, _resolve_seq_starts(path, seq_starts))
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


def _import_npz(path: Path, num_experts: int | None) -> RoutingTrace:
    arrays = read_npz_arrays(path, mmap=False)
    meta: dict[str, Any] = {}
    if "meta" in arrays:
        try:
            meta = json.loads(str(arrays["meta"][()]))
        except json.JSONDecodeError as exc:
            raise TraceError(f"member 'meta' is not valid JSON ({exc})", file=path) from None
    ex = arrays.get("experts")
    if ex is None or ex.ndim != 3:
        raise TraceError(
            "member 'experts' is missing or not [T, L, K]", file=path, expected="experts [T, L, K]"
        )
    if num_experts is not None:
        meta["num_experts"] = num_experts
    if "num_experts" not in meta:
        raise TraceError(
            "the number of experts is unknown",
            file=path,
            hint="pass --num-experts N (num_experts=N)",
        )
    meta.setdefault("top_k", ex.shape[2])
    meta.setdefault("num_layers", ex.shape[1])
    meta.setdefault("model", meta.get("model_id", "unknown"))
    meta["source"] = f"imported from {path.name}"
    domain = meta.get("domain")
    n_seq = len(arrays.get("seq_starts", [0]))
    domains = [str(domain)] * n_seq if domain else []
    arrays = dict(arrays)
    arrays.setdefault("is_decode", np.zeros(ex.shape[0], dtype=bool))
    arrays.setdefault("seq_starts", np.zeros(1, dtype=np.int64))
    return trace_from_arrays(arrays, meta, domains, path)


def _import_npy(path: Path, num_experts: int | None, starts: np.ndarray) -> RoutingTrace:
    try:
        ex = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise TraceError(
            f"not a readable .npy array ({exc})", file=path, hint="the file may be truncated"
        ) from None
    if ex.ndim != 3:
        raise TraceError(
            f"the array has rank {ex.ndim}, shape {tuple(ex.shape)}",
            file=path,
            expected="rank 3, [T tokens, L MoE layers, K experts]",
        )
    if not np.issubdtype(ex.dtype, np.integer):
        raise TraceError(
            f"the array has dtype {ex.dtype}", file=path, expected="integer expert ids"
        )
    inferred = num_experts is None
    if inferred:
        num_experts = int(ex.max()) + 1 if ex.size else 0
    meta = TraceMeta(
        num_experts=int(num_experts),
        top_k=ex.shape[2],
        num_layers=ex.shape[1],
        source=f"imported from {path.name}",
        extra={"num_experts_inferred": True} if inferred else {},
    )
    trace = RoutingTrace(
        experts=np.asarray(ex),
        seq_starts=starts,
        is_decode=np.zeros(ex.shape[0], dtype=bool),
        meta=meta,
    )
    validate(trace, file=str(path))  # range-checks ids before they are narrowed to int16
    return RoutingTrace(
        experts=np.asarray(ex, dtype=np.int16),
        seq_starts=starts,
        is_decode=trace.is_decode,
        meta=meta,
    )


def _resolve_seq_starts(path: Path, value: str | Sequence[int] | None) -> np.ndarray:
    """Sequence starts from the option (a list, "0,120,300" or a file), a side file, or [0]."""
    if value is None:
        for side in (path.with_suffix(".seq_starts.npy"), path.with_suffix(".seq_starts.txt")):
            if side.exists():
                return _read_starts_file(side)
        return np.zeros(1, dtype=np.int64)
    if isinstance(value, str):
        if Path(value).exists():
            return _read_starts_file(Path(value))
        return _parse_ints(value.replace(",", " ").split(), "--seq-starts")
    return _parse_ints(value, "seq_starts")


def _read_starts_file(path: Path) -> np.ndarray:
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise TraceError(f"not a readable .npy array ({exc})", file=path) from None
        return _parse_ints(np.asarray(arr).reshape(-1).tolist(), str(path))
    return _parse_ints(path.read_text().replace(",", " ").split(), str(path))


def _parse_ints(items: Iterable[Any], where: str) -> np.ndarray:
    out = []
    for i, item in enumerate(items):
        try:
            out.append(int(item))
        except (TypeError, ValueError):
            raise TraceError(
                f"sequence start {i} is {item!r}", file=where, expected="integer token positions"
            ) from None
    if not out:
        raise TraceError("no sequence start given", file=where, expected="e.g. 0,120,300")
    return np.asarray(out, dtype=np.int64)
