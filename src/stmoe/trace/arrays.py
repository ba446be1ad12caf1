"""Array formats in: a raw ``[T, L, K]`` ``.npy`` (vLLM's offline routed experts, either
axis order) and a header-less ``.npz``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.assemble import agreed_num_experts, order_by_weight
from stmoe.trace.engines.common import (
    Columns,
    EngineOptions,
    check_prompt,
    finish,
    note,
    refuse_counts,
)
from stmoe.trace.export import manifest_path
from stmoe.trace.io import MEMBERS, checked_input, trace_from_arrays
from stmoe.trace.npfiles import load_npy, read_npz_arrays
from stmoe.trace.ranks import RANK_ORDER
from stmoe.trace.schema import RoutingTrace, meta_int
from stmoe.util.fileio import manifest_mismatch


def read_npy(
    path: Path,
    num_experts: int | None,
    seq_starts: str | Sequence[int] | None,
    opts: EngineOptions | None = None,
) -> RoutingTrace:
    """A raw integer array [T, L, K] (vLLM's ``CompletionOutput.routed_experts``, saved
    with ``np.save``); sequence starts from the option, a side file
    ``NAME.seq_starts.npy``/``.txt``, or one sequence; ``--prompt-lengths`` marks decode."""
    opts = opts or EngineOptions()
    listing = check_export_pair(path) if seq_starts is None else None
    exported = listing is not None
    # stmoe's own export keeps rank order, unless its manifest says the rows were sets
    ranked = exported and listing.get(RANK_ORDER) is not False
    starts = resolve_seq_starts(path, seq_starts)
    ex = load_npy(path, mmap=True)
    if ex.ndim != 3:
        raise TraceError(f"the array has rank {ex.ndim}, shape {tuple(ex.shape)}",
                         expected="rank 3, [T tokens, L MoE layers, K experts]")
    if np.issubdtype(ex.dtype, np.floating) and looks_like_counts(ex):
        raise refuse_counts(f"a {ex.dtype} array of shape {tuple(ex.shape)}")
    if not np.issubdtype(ex.dtype, np.integer):
        raise TraceError(f"the array has dtype {ex.dtype}", expected="integer expert ids")
    ex = oriented(ex, opts.layout)
    if exported and opts.moe_layers is None:  # stmoe's own export holds MoE layers only
        opts = dataclasses.replace(opts, moe_layers=tuple(range(ex.shape[1])))
    return finish(
        Columns(experts=np.asarray(ex), seq_starts=starts,
                is_decode=decode_by_prompt(starts, ex.shape[0], opts.prompt_lengths)),
        opts, num_experts, {"source": f"imported from {path.name}", "file": str(path),
                            # a bare array (vLLM's) does not say it keeps rank order
                            "rank_order": bool(ranked)},
    )


def check_export_pair(path: Path) -> dict[str, Any] | None:
    """An npy export's main file and side file are the pair its manifest lists (a kill
    between their renames would otherwise pair new ids with old sequence starts): the
    manifest for such a pair, None for a file without one (``np.save`` by hand). The
    manifest must list ``path`` and its side file, not other files beside them."""
    manifest = manifest_path(path)
    if not manifest.exists():
        return None
    expected = f"{path.name} and its side file from one `stmoe export`"
    bad = manifest_mismatch(manifest)
    if bad is not None:
        raise TraceError(f"{bad} is not the file {manifest.name} lists", expected=expected,
                         hint="an export was interrupted: export again (or delete the "
                         "manifest if you replaced the files yourself)")
    listing = json.loads(manifest.read_text(encoding="utf-8"))
    pair = (path.name, path.with_suffix(".seq_starts.npy").name)
    unlisted = [name for name in pair if name not in listing["files"]]
    if unlisted:
        raise TraceError(f"{manifest.name} lists {', '.join(sorted(listing['files']))}, not "
                         f"{unlisted[0]}", expected=expected,
                         hint="the manifest is another export's: delete it if these files "
                         "are not from that export")
    return listing


def oriented(ex: np.ndarray, layout: str) -> np.ndarray:
    """A bare array as [T, L, K]: transposed for ``ltk``; a note when ``tlk`` looks wrong."""
    if layout == "ltk":
        return ex.transpose(1, 0, 2)
    if 0 < ex.shape[0] < ex.shape[1]:
        note(f"the array's first axis ({ex.shape[0]}) is smaller than its second "
             f"({ex.shape[1]}): read as [T tokens, L layers, K]; pass --layout ltk "
             "if it is [L, T, K]")
    return ex


def looks_like_counts(arr: np.ndarray) -> bool:
    """A float array of counts (``[.., L, E]``): fractional values, or one column per
    expert (wider than any router's top-k)."""
    sample = np.asarray(arr[: 1 << 12])
    return sample.shape[-1] >= 32 or bool(np.any(sample != np.round(sample)))


def decode_by_prompt(
    starts: np.ndarray, n_tokens: int, prompt_lengths: Sequence[int] | None
) -> np.ndarray:
    """[T] bool: token ``i`` of sequence ``s`` is decode when ``i >= prompt_lengths[s]``."""
    decode = np.zeros(n_tokens, dtype=bool)
    if prompt_lengths is None:
        return decode
    if len(prompt_lengths) != len(starts):
        raise TraceError(f"{len(prompt_lengths)} prompt lengths for {len(starts)} sequences",
                         expected="--prompt-lengths with one length per sequence, "
                         "in file order")
    ends = np.append(starts[1:], n_tokens)
    if np.any(ends <= starts):
        return decode  # bad starts: validation names them
    for s, (a, b, p) in enumerate(zip(starts, ends, prompt_lengths, strict=True)):
        check_prompt(int(p), int(b - a), f"sequence {s}")
        decode[a + int(p) : b] = True
    return decode


# A header-less .npz: the native file's arrays and a ``meta`` JSON string, nothing else.
NPZ_MEMBERS = ("meta", *(name for name in MEMBERS if name != "header"))


def read_headerless_npz(path: Path, num_experts: int | None) -> RoutingTrace:
    """An ``.npz`` with the native array names and an optional ``meta`` JSON string."""
    arrays = dict(read_npz_arrays(path, mmap=False))
    meta: Any = {}
    if "meta" in arrays:
        try:
            meta = json.loads(str(arrays["meta"][()]))
        except RecursionError:
            raise TraceError("member 'meta' is JSON nested too deeply",
                             expected="a flat JSON object") from None
        except (json.JSONDecodeError, ValueError) as exc:
            raise TraceError(f"member 'meta' is not valid JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise TraceError(f"member 'meta' is {type(meta).__name__}", expected="a JSON object")
    ex = arrays.get("experts")
    if ex is None:
        counts = [
            k for k, a in arrays.items() if a.ndim == 3 and np.issubdtype(a.dtype, np.floating)
        ]
        if counts:
            raise refuse_counts(f"member {counts[0]!r}: a float [.., L, E] array")
    unknown = [name for name in arrays if name not in NPZ_MEMBERS]
    if unknown:  # a misspelt 'weight' would otherwise be read as a trace without weights
        raise TraceError(f"unknown member{'s' * (len(unknown) > 1)} "
                         f"{', '.join(map(repr, unknown))}",
                         expected=f"only members {', '.join(NPZ_MEMBERS)}",
                         hint="a misspelt member's data would be lost: rename it")
    if ex is None or ex.ndim != 3:
        raise TraceError(
            "member 'experts' is missing or not [T, L, K]", expected="experts [T, L, K]"
        )
    weights = arrays.get("weights")
    if weights is not None and weights.shape == ex.shape \
            and np.issubdtype(weights.dtype, np.floating):  # else validation names it
        arrays["experts"], arrays["weights"], changed = order_by_weight(ex, weights)
        if changed:
            meta["reordered_by_weight"] = changed  # kept in meta.extra
    declared = meta_int(meta, "num_experts") if meta.get("num_experts") is not None else None
    meta["num_experts"] = agreed_num_experts(num_experts, declared)
    if meta["num_experts"] is None:
        raise TraceError("the number of experts is unknown", hint="pass --num-experts N")
    meta.setdefault("top_k", ex.shape[2])
    meta.setdefault("num_layers", ex.shape[1])
    meta.setdefault("model", meta.get("model_id", "unknown"))
    meta["source"] = f"imported from {path.name}"
    starts = arrays.setdefault("seq_starts", np.zeros(1, dtype=np.int64))
    arrays.setdefault("is_decode", np.zeros(ex.shape[0], dtype=bool))
    domain = meta.get("domain")
    domains = [str(domain)] * int(np.asarray(starts).size) if domain else []
    return trace_from_arrays(arrays, meta, domains, path)


def resolve_seq_starts(path: Path, value: str | Sequence[int] | None) -> np.ndarray:
    """Sequence starts from the option (a list, "0,120,300" or a file), a side file, or [0]."""
    if value is None:
        for side in (path.with_suffix(".seq_starts.npy"), path.with_suffix(".seq_starts.txt")):
            if side.exists():
                return _read_starts_file(side)
        return np.zeros(1, dtype=np.int64)
    if isinstance(value, str):
        if not value.strip():
            raise TraceError("--seq-starts is empty", expected="e.g. 0,120,300 or a file")
        if Path(value).exists():
            return _read_starts_file(Path(value))
        return _parse_ints(value.replace(",", " ").split(), "--seq-starts")
    return _parse_ints(value, "seq_starts")


def _read_starts_file(path: Path) -> np.ndarray:
    checked_input(path, "a file of sequence starts")
    if path.suffix == ".npy":
        arr = load_npy(path)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise TraceError("sequence starts are not a 1-D integer array", file=path,
                             expected="int [S], the first token of each sequence")
        return _parse_ints(arr.tolist(), str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TraceError("not UTF-8 text", file=path, expected="integers, one per line") from None
    return _parse_ints(text.replace(",", " ").split(), str(path))


def _parse_ints(items: Iterable[Any], where: str) -> np.ndarray:
    out = []
    for i, item in enumerate(items):
        try:
            value = int(item)
        except (TypeError, ValueError):
            raise TraceError(f"sequence start {i} is {item!r}", file=where,
                             expected="integer token positions") from None
        if not 0 <= value < 2**62:
            raise TraceError(f"sequence start {i} is {value}", file=where,
                             expected="a token position >= 0")
        out.append(value)
    if not out:
        raise TraceError("no sequence start given", file=where, expected="e.g. 0,120,300")
    return np.asarray(out, dtype=np.int64)
