"""The one reader and the one writer of stmoe's native trace file.

The native file is an *uncompressed* ``.npz`` (a zip of ``.npy`` members, stored
without compression) so that its big arrays can be memory-mapped straight out of
the zip: a trace of tens of millions of token-layers opens in milliseconds and
only the pages a computation touches are read. ``docs/trace-format.md``
describes the layout; ``FORMAT_VERSION`` is checked on every read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import StmoeError, TraceError
from stmoe.trace.npfiles import read_npz_arrays
from stmoe.trace.schema import LOOKAHEAD_FIELDS, RoutingTrace, TraceMeta, validate
from stmoe.util.fileio import atomic_write, check_input_file

FORMAT_NAME = "stmoe-trace"
FORMAT_VERSION = 1
# Files smaller than this are read whole even when mapping is asked for.
_MMAP_MIN_FILE = 64 << 20
# The only members a native file has; anything else (a renamed member) is damage.
MEMBERS = ("header", "experts", "seq_starts", "is_decode", "weights", "token_ids",
           *LOOKAHEAD_FIELDS)


def save_trace(trace: RoutingTrace, path: str | Path, *, compress: bool = False) -> Path:
    """Write ``trace`` in the native format, atomically; returns the path written.

    ``compress=True`` makes a smaller file that can no longer be memory-mapped.
    """
    path = Path(path)
    validate(trace, file=str(path))
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "meta": trace.meta.to_dict(),
        "domains": list(trace.domains),
    }
    arrays: dict[str, np.ndarray] = {
        "header": np.array(json.dumps(header)),
        "experts": np.asarray(trace.experts, dtype=np.int16),
        "seq_starts": np.asarray(trace.seq_starts, dtype=np.int64),
        "is_decode": np.asarray(trace.is_decode, dtype=np.bool_),
    }
    if trace.weights is not None:
        arrays["weights"] = np.asarray(trace.weights, dtype=np.float32)
    if trace.token_ids is not None:
        arrays["token_ids"] = np.asarray(trace.token_ids, dtype=np.int64)
    for name in LOOKAHEAD_FIELDS:
        if getattr(trace, name) is not None:
            arrays[name] = np.asarray(getattr(trace, name), dtype=np.int16)
    atomic_write(path, lambda f: (np.savez_compressed if compress else np.savez)(f, **arrays))
    return path


def read_native(path: str | Path, *, mmap: bool = False) -> RoutingTrace:
    """Read a native trace file; ``mmap=True`` maps the big arrays instead of copying them."""
    path = checked_input(path, "a native stmoe trace (.npz)")
    # Every member's CRC-32 is verified, mapped ones too (npfiles).
    mmap = mmap and path.stat().st_size >= _MMAP_MIN_FILE
    arrays = read_npz_arrays(path, mmap=mmap, known=MEMBERS)
    if "header" not in arrays:
        raise TraceError(
            "not a native stmoe trace (no 'header' member)",
            file=path,
            hint="use stmoe.load_trace or `stmoe import`, which also read foreign .npz files",
        )
    try:
        header = json.loads(str(arrays["header"][()]))
    except RecursionError:
        raise TraceError("the header's JSON is nested too deeply", file=path,
                         expected="a flat JSON object") from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise TraceError(f"the header is not valid JSON ({exc})", file=path) from None
    if not isinstance(header, dict):
        raise TraceError(f"the header is a JSON {type(header).__name__}", file=path,
                         expected="a JSON object")
    if header.get("format") != FORMAT_NAME:
        raise TraceError(
            f"header format is {header.get('format')!r}", file=path, expected=repr(FORMAT_NAME)
        )
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TraceError(f"header version is {version!r}", file=path,
                         expected="a positive integer format version")
    if version > FORMAT_VERSION:
        raise TraceError(
            f"format version {version!r} is not readable by this stmoe",
            file=path,
            expected=f"version <= {FORMAT_VERSION}",
            hint="upgrade stmoe",
        )
    try:
        return trace_from_arrays(arrays, header.get("meta", {}), header.get("domains") or (), path)
    except TraceError as exc:
        raise exc.in_file(path) from None


def trace_from_arrays(
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    domains: Any,
    path: Path,
) -> RoutingTrace:
    """Build and validate a trace from arrays named as in the native file."""
    for name in ("experts", "seq_starts", "is_decode"):
        if name not in arrays:
            raise TraceError(
                f"the file has no {name!r} array",
                file=path,
                expected="experts, seq_starts and is_decode arrays",
            )
    for name in ("seq_starts", "is_decode"):
        if np.asarray(arrays[name]).ndim != 1:
            raise TraceError(f"{name} has shape {np.asarray(arrays[name]).shape}", file=path,
                             expected="a 1-D array")
    experts = arrays["experts"]
    if not np.issubdtype(experts.dtype, np.integer):
        raise TraceError(
            f"experts has dtype {experts.dtype}", file=path, expected="integer expert ids"
        )
    if experts.dtype != np.int16:
        if experts.size and (experts.min() < -1 or experts.max() > np.iinfo(np.int16).max):
            raise TraceError("expert ids do not fit int16", file=path, expected="-1..32767")
        experts = experts.astype(np.int16)
    if not isinstance(domains, list | tuple) or not all(isinstance(d, str) for d in domains):
        raise TraceError("domain labels are not a list of strings", file=path)
    trace = RoutingTrace(
        experts=experts,
        seq_starts=np.asarray(arrays["seq_starts"]),
        is_decode=np.asarray(arrays["is_decode"]),
        weights=arrays.get("weights"),
        token_ids=arrays.get("token_ids"),
        lookahead=arrays.get("lookahead"),
        lookahead_late=arrays.get("lookahead_late"),
        domains=tuple(domains),
        meta=TraceMeta.from_dict(meta) if not isinstance(meta, TraceMeta) else meta,
    )
    validate(trace, file=str(path))  # seq_starts judged at their stored width first
    return dataclasses.replace(trace, seq_starts=trace.seq_starts.astype(np.int64, copy=False))


def checked_input(path: str | Path, what: str) -> Path:
    """``path`` as a regular readable file (``fileio.check_input_file``), refused as a
    ``TraceError``: a FIFO would block the reader forever, a directory fail unclearly."""
    try:
        return check_input_file(path, what)
    except StmoeError as exc:
        text = str(exc).removeprefix(f"{Path(path)}: ")
        raise TraceError(text, file=path) from None
