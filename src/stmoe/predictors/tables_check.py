"""Checking a tables file's header and arrays before anything trusts them.

The compiled kernels index by the tables' ids and size their loops by the
tables' shapes, so one wrong length is memory corruption, not an error. Every
field a predictor reads is checked here, against the header's sizes (L layers,
N experts, top-K, CCT row width R), and a failure is one line naming the file,
the field, what was found and what was expected. It imports nothing of the
predictors that read the tables (``tables`` -> this; stmoe-plus -> ``tables``),
so stmoe-plus's fit is checked here only for what any fit holds (finite numbers
and flags, never text); ``plus.fitted`` checks the rest where it reads the fit.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stmoe.predictors.base import ModelShape, PredictorError
from stmoe.predictors.counting import D_MAX
from stmoe.trace.checks import LAYER_ID_MAX

TABLES_FORMAT = "stmoe-tables"
TABLES_VERSION = 1
MAX_EXPERTS = int(np.iinfo(np.int16).max)  # ids are kept as int16
MAX_COUNT = 2**53  # counts above this are not whole numbers in float64 (the kernels' type)
MAX_DEPTH = 16  # JSON nesting in a header (the writer nests 4 deep)
REQUIRED = ("cct_ids", "cct_conf", "cooccurrence", "layer_counts")
OPTIONAL = ("pair_counts", "temporal", "recent")


@dataclass(frozen=True)
class Dims:
    """The sizes a tables header declares, checked."""

    shape: ModelShape
    row_width: int  # R, the CCT's candidates per expert


def fail(where: str, field: str, found: str, expected: str) -> PredictorError:
    """The one-line error: ``FILE: FIELD: found ..., expected ...``."""
    return PredictorError(f"{where}: {field}: found {found}, expected {expected}")


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_header(raw: np.ndarray | None, where: str) -> dict[str, Any]:
    """The header's JSON object, its format and version checked."""
    if raw is None:
        raise PredictorError(f"{where}: not an stmoe tables file (no header)")
    if raw.ndim != 0 or raw.dtype.kind != "U":
        raise fail(where, "header", f"a {raw.dtype} array of shape {raw.shape}", "a JSON string")
    try:
        header = json.loads(str(raw[()]))
    except RecursionError:
        raise fail(where, "header", "JSON nested too deep", f"at most {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to read
        raise PredictorError(f"{where}: not an stmoe tables file (header: {exc})") from None
    if _depth(header) > MAX_DEPTH:
        raise fail(where, "header", "JSON nested too deep", f"at most {MAX_DEPTH} levels")
    if not isinstance(header, dict):
        raise fail(where, "header", f"a JSON {type(header).__name__}", "a JSON object")
    if header.get("format") != TABLES_FORMAT:
        raise PredictorError(f"{where}: not an stmoe tables file (format "
                             f"{_show(header.get('format'))}, expected {TABLES_FORMAT!r}); "
                             "write tables with `stmoe profile`")
    version = header.get("version")
    if not _is_int(version):
        raise PredictorError(f"{where}: version must be an integer, got {_show(version)}")
    if version > TABLES_VERSION:
        raise PredictorError(f"{where}: tables version {version} is newer than this stmoe "
                             f"reads ({TABLES_VERSION}); upgrade stmoe")
    if version < 1:
        raise fail(where, "version", str(version), f"1..{TABLES_VERSION}")
    return header


def _depth(value: Any) -> int:
    """How deep JSON containers nest (iteratively: a deep header must not recurse)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                       else item))
    return deepest


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite JSON number (not a flag: ``true`` is an int to Python)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:  # (a JSON integer has no bound; the kernels take float64)
        return math.isfinite(float(value))
    except OverflowError:
        return False


def header_dims(header: dict[str, Any], where: str) -> Dims:
    """L, N, K and R from the header, each an integer in its range."""

    def size(key: str, low: int, high: int, what: str) -> int:
        v = header.get(key)
        if not _is_int(v) or not low <= v <= high:
            raise fail(where, key, _show(v), f"an integer {low}..{high} ({what})")
        return v

    layers = size("num_layers", 1, 2**31 - 1, "MoE layers")
    experts = size("num_experts", 1, MAX_EXPERTS, "experts per layer; ids are int16")
    top_k = size("top_k", 1, experts, "at most num_experts")
    row_width = size("row_width", 1, experts, "CCT candidates, at most num_experts")
    return Dims(ModelShape(layers, experts, top_k), row_width)


def check_info(info: Any, layers: int, where: str, field: str = "info") -> dict[str, Any]:
    """What the predictors read of ``info``: layer_tokens [L], tokens, the fit's values."""
    if not isinstance(info, dict):
        raise fail(where, field, f"a JSON {type(info).__name__}", "a JSON object")
    if "layer_tokens" in info:
        v = info["layer_tokens"]
        if not (isinstance(v, list) and len(v) == layers
                and all(_is_number(x) and 0 <= x <= MAX_COUNT for x in v)):
            raise fail(where, f"{field}['layer_tokens']", _show(v),
                       f"{layers} token counts 0..2^53 (one per layer)")
    if "tokens" in info and not (_is_int(info["tokens"]) and info["tokens"] >= 0):
        raise fail(where, f"{field}['tokens']", _show(info["tokens"]), "a token count >= 0")
    if info.get("plus") is not None:
        _check_fit(info["plus"], where, f"{field}['plus']", nested=True)
    ids = info.get("model_layer_ids")
    if ids is not None and not (
            isinstance(ids, list) and len(ids) == layers
            and all(_is_int(i) and 0 <= i < LAYER_ID_MAX for i in ids)
            and all(a < b for a, b in itertools.pairwise(ids))):
        raise fail(where, f"{field}['model_layer_ids']", _show(ids),
                   f"{layers} increasing MoE layer numbers in 0..{LAYER_ID_MAX - 1}")
    bits = info.get("token_sample_bits", 0)
    if not (_is_int(bits) and 0 <= bits < 64):
        raise fail(where, f"{field}['token_sample_bits']", _show(bits),
                   "the profiled tokens' sample, as a number of bits 0..63")
    seqs = info.get("sequences", [])
    if not (isinstance(seqs, list) and all(isinstance(d, str) and len(d) <= 64 for d in seqs)):
        raise fail(where, f"{field}['sequences']", _show(seqs),
                   "a list of the profiled sequences' digests (short strings)")
    return info


def _check_fit(fit: Any, where: str, field: str, nested: bool) -> None:
    """Any stmoe-plus fit holds finite numbers, flags, lists of numbers and (once) an
    object of those; text or NaN would reach the kernels (plus.fitted checks the rest)."""
    if not isinstance(fit, dict):
        raise fail(where, field, f"a JSON {type(fit).__name__}", "a JSON object (the fit)")
    for key, v in fit.items():
        name = f"{field}[{key!r}]"
        if isinstance(v, dict) and nested:
            _check_fit(v, where, name, nested=False)
        elif not (v is None or isinstance(v, bool) or _is_number(v)
                  or (isinstance(v, list) and all(_is_number(x) for x in v))):
            raise fail(where, name, _show(v), "a finite number, true/false or a list of numbers")


def check_domains(entries: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """The header's per-domain list: (domain name, info) for each, names unique."""
    if not isinstance(entries, list):
        raise fail(where, "per_domain", f"a JSON {type(entries).__name__}", "a JSON list")
    out: list[tuple[str, dict[str, Any]]] = []
    for i, entry in enumerate(entries):
        name = entry.get("domain") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name in (d for d, _ in out):
            raise fail(where, f"per_domain[{i}]", _show(entry),
                       "an object with a domain name (unique) and its info")
        out.append((name, entry.get("info", {})))
    return out


def max_bytes(dims: Dims, domains: int, recent_tokens: int) -> int:
    """The most a tables file of ``dims`` (and ``domains`` per-domain sets, each with up to
    ``recent_tokens`` of token memory) holds uncompressed, every array at 8 bytes an item:
    a bound for its reader, since counts profiled on few tokens are mostly zeros and
    compress far beyond a trace's ratio."""
    n, layers, k = dims.shape.num_experts, dims.shape.num_layers, dims.shape.top_k
    pairs = max(layers - 1, 0)
    items = (2 * pairs * n * dims.row_width + pairs * n * n + layers * n
             + D_MAX * max(pairs, 1) * n * n + layers * n * n + recent_tokens * layers * k)
    return (1 + domains) * 8 * items + (1 << 20)  # (and the header)


def check_arrays(arrays: Mapping[str, np.ndarray], dims: Dims, where: str,
                 prefix: str = "") -> dict[str, np.ndarray | None]:
    """Every array of one set of tables (``prefix``: a domain's ``domain<i>/``), by shape,
    dtype and values; the ids as int16/int8 and every array in native byte order."""
    n, layers, k = dims.shape.num_experts, dims.shape.num_layers, dims.shape.top_k
    pairs = max(layers - 1, 0)
    want = {"cct_ids": ((pairs, n, dims.row_width), "[L-1, N, R]"),
            "cct_conf": ((pairs, n, dims.row_width), "[L-1, N, R]"),
            "cooccurrence": ((pairs, n, n), "[L-1, N, N]"),
            "layer_counts": ((layers, n), "[L, N]"),
            "pair_counts": ((D_MAX, max(pairs, 1), n, n), f"[D={D_MAX}, L-1, N, N]"),
            "temporal": ((layers, n, n), "[L, N, N]")}
    out: dict[str, np.ndarray | None] = {}
    for key in (*REQUIRED, *OPTIONAL):
        a = arrays.get(prefix + key)
        if a is None:
            if key in REQUIRED:
                raise fail(where, prefix + key, "no such array", f"the {key} array")
            out[key] = None
            continue
        a = a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))
        if key == "recent":
            _check_shape(a, (None, layers, k), "[M, L, K]", where, prefix + key)
            _check_ids(a, n, where, prefix + key)
            a = a.astype(np.int16)
        else:
            _check_shape(a, *want[key], where, prefix + key)
            if not key.startswith("cct_"):  # (the CCT is checked as a whole below)
                _check_counts(a, where, prefix + key)
        out[key] = a
    check_cct(out["cct_ids"], out["cct_conf"], n, where, prefix)  # type: ignore[arg-type]
    out["cct_ids"] = out["cct_ids"].astype(np.int16)  # type: ignore[union-attr]
    out["cct_conf"] = out["cct_conf"].astype(np.int8)  # type: ignore[union-attr]
    return out


def check_profiled_tokens(a: np.ndarray | None, most: int, where: str) -> np.ndarray | None:
    """The profiled tokens' digests: at most ``most``, uint64, sorted and unique (a replay
    looks its tokens up in them by binary search)."""
    if a is None:
        return None
    field = "profiled_tokens"
    if a.ndim != 1 or len(a) > most:
        raise fail(where, field, f"shape {list(a.shape)}", f"[P] with P <= {most}")
    if a.dtype.kind != "u" or a.dtype.itemsize != 8:
        raise fail(where, field, f"dtype {a.dtype}", "uint64 token digests")
    a = a.astype(np.uint64)
    if len(a) > 1 and not bool((a[1:] > a[:-1]).all()):
        raise fail(where, field, "digests out of order or repeated", "sorted, unique digests")
    return a


def _check_shape(a: np.ndarray, want: tuple[int | None, ...], axes: str, where: str,
                 field: str) -> None:
    if a.ndim != len(want) or any(w not in (None, s) for s, w in zip(a.shape, want, strict=True)):
        shown = ", ".join("M" if w is None else str(w) for w in want)
        raise fail(where, field, f"shape {a.shape}", f"({shown}) {axes}")


def _check_ids(a: np.ndarray, n: int, where: str, field: str) -> None:
    if a.dtype.kind not in "iu":
        raise fail(where, field, f"dtype {a.dtype}", "integer expert ids")
    if a.size and (a.min() < -1 or a.max() >= n):
        raise fail(where, field, f"ids {a.min()}..{a.max()}", f"-1..{n - 1} (-1: none)")


def _check_counts(a: np.ndarray, where: str, field: str) -> None:
    if a.dtype.kind not in "iuf":
        raise fail(where, field, f"dtype {a.dtype}", "counts (integers)")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise fail(where, field, "NaN or infinite counts", "finite counts")
    if a.size and (a.min() < 0 or a.max() > MAX_COUNT):
        raise fail(where, field, f"counts {a.min()}..{a.max()}", "counts 0..2^53")


def check_cct(ids: np.ndarray, conf: np.ndarray, num_experts: int, where: str = "tables",
              prefix: str = "") -> None:
    """Refuse a CCT the compiled kernels could not trust (they index by these ids)."""
    for field, a in (("cct_ids", ids), ("cct_conf", conf)):
        if a.dtype.kind not in "iu":
            raise fail(where, prefix + field, f"dtype {a.dtype}", "integers")
    bad = (ids < -1) | (ids >= num_experts)
    if bad.any():
        layer, e, s = (int(i) for i in np.argwhere(bad)[0])
        raise PredictorError(f"{where}: {prefix}cct_ids: CCT[{layer}][{e}] slot {s} holds "
                             f"expert {int(ids[layer, e, s])}, "
                             f"expected -1..{num_experts - 1}")
    if ((conf < 0) | (conf > 3)).any():
        raise PredictorError(f"{where}: {prefix}cct_conf: a confidence lies outside 0..3, "
                             "expected 2-bit counters")
    ordered = np.sort(ids, axis=2)
    if ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any():
        raise PredictorError(f"{where}: {prefix}cct_ids: a row holds the same expert twice, "
                             "expected distinct candidates")
