"""What every engine reader shares: the assembly of its requests into one trace (the
options a file cannot answer are parsed in ``options``).

Engines hand out routing per request, over the model's *every* layer (dense ones hold a
fill value), with the prompt length somewhere else or nowhere. Each reader turns its
layout into ``SequenceRouting`` objects; ``assemble`` applies the same rules to all of
them: the user's ``--prompt-lengths`` against the file's own, an all-zero routing refused,
dense layers dropped with a note (``--moe-layers`` overrides the guess), empty trailing
slots trimmed, ids range-checked before they are narrowed to int16.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stmoe.errors import StmoeNote, TraceError
from stmoe.trace.assemble import order_by_weight
from stmoe.trace.engines.options import EngineOptions
from stmoe.trace.schema import RoutingTrace, TraceMeta, inferred_num_experts, validate

_ID_MAX = int(np.iinfo(np.int16).max)  # ids are stored as int16


class ImportNote(StmoeNote):
    """Something an importer decided for the user (dense layers dropped, a guessed
    layout): worth one line, not worth refusing the file."""


def note(message: str) -> None:
    warnings.warn(message, ImportNote, stacklevel=3)


@dataclass
class SequenceRouting:
    """One sequence's routing as an engine laid it out: row ``i`` of ``experts`` ([rows,
    model layers, slots], any integer dtype) is the token at position ``start + i``;
    tokens at positions ``>= prompt_len`` are decode."""

    experts: np.ndarray
    prompt_len: int | None = None  # None: the file does not say
    start: int = 0
    token_ids: np.ndarray | None = None
    weights: np.ndarray | None = None
    where: str = ""  # how an error names this request ("choice 2")
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Columns:
    """A whole file's routing as trace columns, before layers are chosen and ids checked."""

    experts: np.ndarray  # [T, model layers, slots], any integer dtype
    seq_starts: np.ndarray
    is_decode: np.ndarray
    weights: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def checked_ids(arr: np.ndarray, num_experts: int | None, where: str) -> np.ndarray:
    """``arr`` as int32 once every id, read at its stored width (uint32, int64, ...), is
    -1 or below N (32768 when N is not given): a cast first would wrap 2**32 + 3 to
    expert 3 and 0xFFFFFFFF to an empty slot."""
    arr = np.asarray(arr)
    hi = (num_experts if num_experts is not None else _ID_MAX + 1) - 1
    bad = arr > hi
    if np.issubdtype(arr.dtype, np.signedinteger):
        bad |= arr < -1
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        pos = f"token {at[0]}, layer {at[1]}, slot {at[2]}" if arr.ndim == 3 else f"index {at}"
        raise TraceError(f"expert id {int(arr[at])} is out of range",
                         position=f"{where}, {pos}" if where else pos,
                         expected=f"0..{hi}, or -1 for an empty slot (read as stored, "
                         f"{arr.dtype})")
    return arr.astype(np.int32)


def note_missing_prompts(requests: Sequence[SequenceRouting], opts: EngineOptions) -> None:
    """One note naming the requests whose prompt length neither the file nor
    ``--prompt-lengths`` gives: all their tokens are read as prefill."""
    missing = [r.where for r in requests if r.prompt_len is None]
    if missing and opts.prompt_lengths is None:
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" * (len(missing) > 3))
        note(f"{named}: the file gives no prompt length, so every token is read as prefill; "
             "pass --prompt-lengths to mark the generated ones decode")


def assemble(
    requests: Sequence[SequenceRouting],
    opts: EngineOptions,
    num_experts: int | None,
    meta: dict[str, Any],
) -> RoutingTrace:
    """Requests -> one validated trace; ``meta`` gives ``source`` and optionally ``model``."""
    if not requests:
        raise TraceError("the file holds no routing", expected="at least one request")
    prompts = _prompt_lengths(requests, opts.prompt_lengths)
    lengths = [len(r.experts) for r in requests]
    if 0 in lengths:
        i = lengths.index(0)
        raise TraceError("a request has no routed token", position=requests[i].where or None,
                         expected="at least one row per request")
    _same_shape(requests)
    weights = None
    if all(r.weights is not None for r in requests):
        weights = np.concatenate([np.asarray(r.weights, np.float32) for r in requests])
    ids = [r.token_ids for r in requests]
    if any(t is None for t in ids) and not all(t is None for t in ids):
        lacking = next(r.where or f"sequence {i}" for i, r in enumerate(requests)
                       if r.token_ids is None)
        note(f"token ids dropped from every sequence: {lacking} has none")
    extra: dict[str, Any] = {}
    for r in requests:
        extra.update(r.extra)
    cols = Columns(
        experts=np.concatenate([np.asarray(r.experts) for r in requests]),
        seq_starts=np.cumsum([0, *lengths[:-1]]).astype(np.int64),
        is_decode=np.concatenate([
            np.zeros(n, bool) if p is None else r.start + np.arange(n) >= p
            for r, n, p in zip(requests, lengths, prompts, strict=True)
        ]),
        weights=weights,
        token_ids=None if any(t is None for t in ids) else np.concatenate(ids).astype(np.int64),
        extra=extra,
    )
    return finish(cols, opts, num_experts, meta)


def finish(
    cols: Columns, opts: EngineOptions, num_experts: int | None, meta: dict[str, Any]
) -> RoutingTrace:
    """Drop dense layers and unused slots, check ids, narrow to int16, validate."""
    if np.size(cols.experts) > np.shape(cols.experts)[-1] and not np.any(cols.experts):
        raise TraceError("every routed expert id is 0", expected="the router's choices", hint=(
            "one fused-kernel path of vLLM returns all zeros; record with enforce_eager=True"))
    keep, extra = _moe_layers(cols.experts, opts.moe_layers)
    extra.update(cols.extra)
    experts = np.asarray(cols.experts)[:, keep]
    weights = None if cols.weights is None else np.asarray(cols.weights)[:, keep]
    filled = np.flatnonzero((experts >= 0).any(axis=(0, 1)))
    width = int(filled[-1]) + 1 if len(filled) else experts.shape[2]
    experts = experts[:, :, :width]  # slots beyond top-k that no token ever filled
    if weights is not None:
        experts, weights, changed = order_by_weight(experts, weights[:, :, :width])
        if changed:
            extra["reordered_by_weight"] = changed
    extra.update({} if weights is not None or meta.get("rank_order") is not False else
                 {"rank_order": False})  # each row a set: the order is the file's
    if num_experts is None:
        num_experts = inferred_num_experts(experts)
        extra["num_experts_inferred"] = True
    trace_meta = TraceMeta(num_experts=int(num_experts), top_k=experts.shape[2],
                           num_layers=experts.shape[1], model=str(meta.get("model", "unknown")),
                           source=str(meta["source"]), extra=extra)
    trace = RoutingTrace(experts=experts, seq_starts=cols.seq_starts, is_decode=cols.is_decode,
                         weights=weights, token_ids=cols.token_ids, meta=trace_meta)
    validate(trace, file=meta.get("file"))  # range-checks ids before they are narrowed
    return RoutingTrace(experts=experts.astype(np.int16), seq_starts=trace.seq_starts,
                        is_decode=trace.is_decode, weights=weights, token_ids=cols.token_ids,
                        meta=trace_meta)


def _same_shape(requests: Sequence[SequenceRouting]) -> None:
    """Every request over the same model layers and slots (one model answered them all)."""
    first = requests[0]
    for r in requests[1:]:
        if r.experts.shape[1:] != first.experts.shape[1:]:
            (la, ka), (lb, kb) = first.experts.shape[1:], r.experts.shape[1:]
            raise TraceError(f"{lb} layers x {kb} slots here but {la} x {ka} in "
                             f"{first.where or 'the first request'}",
                             position=r.where or None,
                             expected="every request routed over the same model layers and "
                             "top-k (responses of one model)")


def _prompt_lengths(requests: Sequence[SequenceRouting],
                    given: tuple[int, ...] | None) -> list[int | None]:
    """Each request's prompt length: the file's, else the option's; both must agree, and
    a prompt never holds more tokens than the request routed (prompt + generated - 1)."""
    if given is not None and len(given) != len(requests):
        raise TraceError(f"{len(given)} prompt lengths for {len(requests)} sequences",
                         expected="--prompt-lengths with one length per sequence, "
                         "in file order")
    out: list[int | None] = []
    for i, r in enumerate(requests):
        opt = None if given is None else given[i]
        if opt is not None and r.prompt_len is not None and opt != r.prompt_len:
            raise TraceError(f"--prompt-lengths gives {opt} but the file says {r.prompt_len}",
                             position=r.where or f"sequence {i}",
                             expected="the file's own prompt length")
        prompt = r.prompt_len if opt is None else opt
        if prompt is not None:
            check_prompt(prompt, r.start + len(r.experts), r.where or f"sequence {i}")
        out.append(prompt)
    return out


def check_prompt(prompt: int, routed: int, where: str) -> None:
    """A prompt never holds more tokens than its request routed (prompt + generated - 1):
    a longer one is another request's, or the routing was cut."""
    if prompt > routed:
        raise TraceError(f"a prompt of {prompt} tokens but only {routed} routed tokens",
                         position=where, expected="a prompt length of at most the routed "
                         "tokens (an engine routes prompt + generated - 1)",
                         hint="the routing looks truncated, or the prompt length is "
                         "another request's")


def _moe_layers(experts: np.ndarray, chosen: tuple[int, ...] | None) -> tuple[list[int], dict]:
    """The model layers that route, and the metadata that keeps their numbers.

    A dense layer never routes, so an engine's buffer keeps its fill there (0 in older
    vLLM, -1 in newer vLLM and SGLang) for every token. When every layer looks like
    that the file is simply empty, which validation reports.
    """
    n_layers = experts.shape[1]
    if chosen is not None:
        if chosen[-1] >= n_layers:
            raise TraceError(f"--moe-layers names layer {chosen[-1]}",
                             expected=f"layers 0..{n_layers - 1} "
                             f"(the file has {n_layers})")
        keep = list(chosen)
    else:
        dense = [
            layer for layer in range(n_layers)
            if len(experts) and (np.all(experts[:, layer] == -1) or np.all(experts[:, layer] == 0))
        ]
        keep = [layer for layer in range(n_layers) if layer not in dense]
        if not keep:
            return list(range(n_layers)), {}
        if dense:
            note(f"dropped dense layer{'s' if len(dense) > 1 else ''} {_ranges(dense)} "
                 "(only the fill value for every token); --moe-layers overrides")
    extra = {} if keep == list(range(len(keep))) else {"model_layer_ids": keep}
    return keep, extra


def _ranges(ids: Sequence[int]) -> str:
    parts, start = [], ids[0]
    for a, b in zip(ids, [*ids[1:], None], strict=True):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


def check_size(needed: int, available: int, what: str, position: str | None = None) -> None:
    """Refuse a declared size the file cannot hold, before anything is allocated."""
    if needed > available:
        raise TraceError(f"{what} needs {needed} bytes but only {available} remain",
                         position=position, expected="a complete file",
                         hint="the file looks truncated")


def refuse_counts(what: str) -> TraceError:
    """The one message for files that count experts instead of routing tokens."""
    return TraceError(
        f"this is an expert-count summary, not per-token routing ({what})",
        expected="per-token routing",
        hint="record per-token routing instead: vLLM enable_return_routed_experts, SGLang "
        "--enable-return-routed-experts or --expert-distribution-recorder-mode per_token",
    )
