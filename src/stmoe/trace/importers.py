"""Foreign routing formats in, one ``RoutingTrace`` out.

Supported, and recognised by content when the format is ``auto``:

- ``native``: stmoe's own ``.npz`` (see ``io``);
- ``npz``: a header-less ``.npz`` with the native array names (``experts``,
  ``seq_starts``, ``is_decode``, optional ``weights`` and a ``meta`` JSON string);
- ``npy``: a raw integer array ``[T, L, K]`` (what vLLM returns for routed experts);
- ``jsonl``: one record per (token, layer), in any order;
- ``routes``: nested per-token JSON with a ``routes`` list;
- ``vllm``: a vLLM completions response (``choices[].routed_experts``);
- ``vllm-profile``: vLLM routing-profile JSON Lines (``problem_id``, ``token_pos``);
- ``sglang``: an SGLang ``/generate`` response or a batch's list (``meta_info.routed_experts``);
- ``torch``: a ``torch.save`` file (SGLang's recorder dump, transformers' router logits);
- ``expert-drop``: MoE-Infinity's expert-drop trace (``MOEDROPT`` binary or its ``.npz``).

The serving engines' layouts are read in ``stmoe.trace.engines``.

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
from stmoe.trace.assemble import agreed_num_experts
from stmoe.trace.engines import moe_infinity, sglang, torchfile, vllm, vllm_profile
from stmoe.trace.engines.common import EngineOptions
from stmoe.trace.engines.jsonio import load_json
from stmoe.trace.io import checked_input, read_native
from stmoe.trace.npfiles import ZIP_ERRORS, read_npz_arrays, short
from stmoe.trace.schema import UNLABELLED, RoutingTrace
from stmoe.trace.select import concat

FORMATS = ("auto", "native", "npz", "npy", "jsonl", "routes", "vllm", "vllm-profile", "sglang",
           "torch", "expert-drop")
# The engine options each format reads; any other given is refused, not silently ignored.
_USES = {"npy": {"--prompt-lengths", "--layout", "--moe-layers"},
         "vllm": {"--prompt-lengths", "--moe-layers"},
         "vllm-profile": {"--prompt-lengths", "--moe-layers"},
         "sglang": {"--prompt-lengths", "--moe-layers", "--layers", "--top-k"},
         "torch": {"--prompt-lengths", "--moe-layers", "--top-k"},
         "expert-drop": {"--moe-layers"}}
_FIRST_LINE_MAX = 1 << 26  # a JSON Lines metadata line may be long; a routes file is one line


def sniff_format(path: str | Path) -> str:
    """The format of ``path`` judged by its content, never by its name."""
    path = _readable(Path(path))
    with open(path, "rb") as f:
        head = f.read(8)
        if not head:
            raise TraceError("the file is empty", file=path, expected="a routing trace")
        if head.startswith(b"PK\x03\x04"):
            return _zip_kind(path)
        if head.startswith(b"\x93NUMPY"):
            return "npy"
        if head == moe_infinity.MAGIC:
            return "expert-drop"
        if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
            return "torch"  # torch.save's legacy (pickle) format
        f.seek(0)
        first_line = f.readline(_FIRST_LINE_MAX).removeprefix(b"\xef\xbb\xbf").strip()
    if first_line.startswith(b"{"):
        try:
            record = json.loads(first_line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            record = _whole_json(path)  # a pretty-printed object spans many lines
            return _json_kind(record) or "routes"
        if not isinstance(record, dict):
            return "jsonl"
        if "problem_id" in record and "layer" in record:
            return "vllm-profile"
        return _json_kind(record) or ("routes" if "routes" in record else "jsonl")
    if first_line.startswith(b"["):
        doc = _whole_json(path)
        if isinstance(doc, list) and doc and all(_json_kind(d) == "sglang" for d in doc):
            return "sglang"
        raise TraceError(
            "a top-level JSON array is not a supported trace",
            file=path,
            expected="JSON Lines records, an object with a 'routes' list or a batch of "
            "SGLang responses",
        )
    raise TraceError(
        "the content is not a recognised trace format",
        file=path,
        expected="a .npz, a .npy array, JSON Lines records or a routes JSON object",
    )


def _json_kind(doc: object) -> str | None:
    """An engine's JSON response, told by the field that holds its routing."""
    if isinstance(doc, dict) and isinstance(doc.get("choices"), list):
        return "vllm"
    if isinstance(doc, dict) and isinstance(doc.get("meta_info"), dict):
        return "sglang"
    return None


def _whole_json(path: Path) -> object:
    try:
        return load_json(path)
    except TraceError:
        return None  # the reader reports it with its position


def _zip_kind(path: Path) -> str:
    names = _npz_member_names(path)
    if names is None:
        return "torch"  # torch.save writes a zip whose members are not .npy
    if "header" in names:
        return "native"
    return "expert-drop" if names >= moe_infinity.NPZ_KEYS else "npz"


def _readable(path: Path) -> Path:
    return checked_input(path, "a trace file")


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
    ``drop_partial`` see ``concat``. SGLang recorder dumps given together are the
    ranks of one run, read as one (a rank that repeats another is read once).
    """
    if not paths:
        raise TraceError("no input file given", expected="at least one trace file")
    if len(paths) > 1 and all(_kind(Path(p), format) == "torch" for p in paths):
        opts = options.get("engine") or EngineOptions()
        merged = torchfile.read_many([Path(p) for p in paths], opts, options.get("num_experts"))
        if merged is not None:
            return _finish(merged, domain, options.get("model"))
    engine = options.get("engine")
    if len(paths) > 1 and engine is not None and engine.prompt_lengths is not None:
        parts = _with_prompt_lengths(paths, engine.prompt_lengths, format, domain, options)
    else:
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


def _with_prompt_lengths(paths: Sequence[str | Path], lengths: tuple[int, ...], format: str,
                         domain: str | None, options: dict[str, Any]) -> list[RoutingTrace]:
    """Several files and one --prompt-lengths list: one length per sequence across the
    files, in file order (each file read once to count its sequences, then with its share)."""
    import dataclasses
    import warnings

    counts = []
    for p in paths:
        with warnings.catch_warnings():  # the missing-prompt note: the lengths come next
            warnings.simplefilter("ignore")
            plain = dict(options, engine=dataclasses.replace(options["engine"],
                                                             prompt_lengths=None))
            counts.append(import_file(p, format=format, domain=domain, **plain).num_sequences)
    if sum(counts) != len(lengths):
        raise TraceError(f"{len(lengths)} prompt lengths for {sum(counts)} sequences in "
                         f"{len(paths)} files", position="--prompt-lengths",
                         expected="one per sequence, across the files in the order given")
    parts, at = [], 0
    for p, n in zip(paths, counts, strict=True):
        share = dict(options, engine=dataclasses.replace(options["engine"],
                                                         prompt_lengths=lengths[at:at + n]))
        parts.append(import_file(p, format=format, domain=domain, **share))
        at += n
    return parts


def _kind(path: Path, format: str) -> str:
    return sniff_format(path) if format == "auto" else format


def import_file(
    path: str | Path,
    *,
    format: str = "auto",
    domain: str | None = None,
    num_experts: int | None = None,
    seq_starts: str | Sequence[int] | None = None,
    model: str | None = None,
    engine: EngineOptions | None = None,
) -> RoutingTrace:
    """Import one file of any supported format into a validated trace.

    ``engine`` carries what a serving engine's file may not say (prompt lengths,
    layers and top-k, axis order, which layers route).
    """
    path = _readable(Path(path))
    if format not in FORMATS:
        raise TraceError(f"unknown format {format!r}", expected=f"one of {', '.join(FORMATS)}")
    kind = _kind(path, format)
    opts = engine or EngineOptions()
    if seq_starts is not None and kind != "npy":
        raise TraceError(f"--seq-starts applies to .npy input, but this is {kind}", file=path,
                         hint="sequence starts come from the file itself")
    unused = sorted(opts.given() - _USES.get(kind, set()))
    if unused:
        raise TraceError(f"{', '.join(unused)} do{'es' if len(unused) == 1 else ''} not apply "
                         f"to {kind} input", file=path,
                         hint="the file itself says this")
    try:
        trace = _read(path, kind, num_experts, seq_starts, opts)
    except TraceError as exc:
        raise exc.in_file(path) from None
    return _finish(trace, domain, model)


def _read(path: Path, kind: str, num_experts: int | None,
          seq_starts: str | Sequence[int] | None, opts: EngineOptions) -> RoutingTrace:
    if kind == "native":
        trace = read_native(path)
        agreed_num_experts(num_experts, trace.num_experts)
        return trace
    if kind == "npz":
        return read_headerless_npz(path, num_experts)
    if kind == "npy":
        return read_npy(path, num_experts, seq_starts, opts)
    if kind == "jsonl":
        return jsonl.read(path, num_experts=num_experts)
    if kind == "routes":
        return routes.read(path, num_experts=num_experts)
    if kind == "vllm":
        return vllm.read_response(path, opts, num_experts)
    if kind == "vllm-profile":
        return vllm_profile.read_profile(path, opts, num_experts)
    if kind == "sglang":
        return sglang.read_generate(path, opts, num_experts)
    if kind == "torch":
        return torchfile.read(path, opts, num_experts)
    with open(path, "rb") as f:
        binary = f.read(8) == moe_infinity.MAGIC
    if binary:
        return moe_infinity.read_binary(path, opts, num_experts)
    arrays = dict(read_npz_arrays(path, mmap=False))
    if not set(arrays) >= moe_infinity.NPZ_KEYS:
        raise TraceError("neither a MOEDROPT binary nor its .npz",
                         expected="members seq, layer, weights, mask")
    return moe_infinity.read_npz(arrays, path, opts, num_experts)


def _finish(trace: RoutingTrace, domain: str | None, model: str | None) -> RoutingTrace:
    if model is not None:
        trace = trace.with_meta(model=model)
    if domain is not None:
        trace = _label_unlabelled(trace, domain)
    return trace


def _label_unlabelled(trace: RoutingTrace, domain: str) -> RoutingTrace:
    labels = tuple(domain if d == UNLABELLED else d for d in trace.domains)
    return dataclasses.replace(trace, domains=labels)


def _npz_member_names(path: Path) -> set[str] | None:
    """The arrays of an .npz; None for a torch.save zip (``*/data.pkl``)."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if any(n.endswith("data.pkl") for n in names):
                return None
            return {n[: -len(".npy")] for n in names if n.endswith(".npy")}
    except ZIP_ERRORS as exc:
        raise TraceError(
            f"not a readable .npz file ({short(exc)})", file=path, hint="the file may be truncated"
        ) from None
