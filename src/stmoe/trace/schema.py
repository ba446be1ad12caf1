"""The routing trace: what every other part of stmoe reads.

Axes, named once for the whole project (docs/architecture.md):

    T  tokens, all sequences laid end to end in trace order
    L  MoE layers, 0..L-1 in model order (dense layers are not counted)
    K  router slots per token and layer (the model's top-k)
    N  routed experts per layer (shared experts are never recorded)
    S  sequences

A trace is arrays, never lists of dicts: ``experts`` is ``[T, L, K] int16`` with
expert ids in router rank order (highest gate weight first) and ``-1`` for an
empty slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.checks import CHUNK_TOKENS as _CHUNK_TOKENS  # noqa: F401 (summary, tables)
from stmoe.trace.checks import (
    EMPTY_SLOT,
    check_labels,
    check_layer_ids,
    check_lookahead,
    check_weights,
)
from stmoe.trace.checks import chunks as _chunks
from stmoe.trace.checks import first as _first

UNLABELLED = "unlabelled"
# N taken as the largest id + 1 (the file does not say N) must stay below this: no
# router has as many experts, and a flipped byte in an unchecked file makes ids huge
# sooner than plausible; an N-sized table per layer would cost gigabytes.
INFERRED_EXPERTS_MAX = 4096


@dataclass(frozen=True)
class TraceMeta:
    """What model and workload a trace describes.

    ``num_layers`` and ``top_k`` repeat the array shape on purpose: a file whose
    arrays disagree with its own header is caught by ``validate``.
    """

    num_experts: int  # N routed experts per MoE layer
    top_k: int  # K router slots per token and layer
    num_layers: int  # L MoE layers
    model: str = "unknown"
    source: str = ""  # where the routing came from (capture, import path, synth)
    synthetic: bool = False  # True for generated data: never report it as real
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_layers": self.num_layers,
            "source": self.source,
            "synthetic": self.synthetic,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Any) -> TraceMeta:
        """Metadata from JSON, every field type-checked (files are untrusted input)."""
        if not isinstance(data, Mapping):
            raise TraceError(f"metadata is {type(data).__name__}", expected="a JSON object")
        extra = data.get("extra", {})
        if not isinstance(extra, Mapping):
            raise TraceError(f"metadata 'extra' is {extra!r}", expected="a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {**extra, **{k: v for k, v in data.items() if k not in known}}
        synthetic = data.get("synthetic", False)
        if not isinstance(synthetic, bool):
            raise TraceError(f"metadata 'synthetic' is {synthetic!r}", expected="true or false")
        return cls(
            num_experts=meta_int(data, "num_experts"),
            top_k=meta_int(data, "top_k"),
            num_layers=meta_int(data, "num_layers"),
            model=str(data.get("model", "unknown")),
            source=str(data.get("source", "")),
            synthetic=synthetic,
            extra=extra,
        )


def meta_int(data: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer field of file metadata, or a clear error."""
    value = data.get(key, default)
    if value is None:
        raise TraceError(f"metadata lacks {key!r}", expected=f"an integer {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise TraceError(f"metadata {key!r} is {value!r}", expected="a positive integer")
    return int(value)


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """Per-token, per-MoE-layer expert routing of one or more sequences."""

    experts: np.ndarray  # [T, L, K] int16, router rank order (or sets: trace.ranks), -1 = empty
    seq_starts: np.ndarray  # [S] int64, first token of each sequence; [0] == 0
    is_decode: np.ndarray  # [T] bool, True for generated (decode) tokens
    meta: TraceMeta
    weights: np.ndarray | None = None  # [T, L, K] float32 gate weights, or None
    domains: tuple[str, ...] = ()  # [S] domain/task label per sequence
    token_ids: np.ndarray | None = None  # [T] int64 vocabulary ids, or None
    # [T, L, J] int16 gate lookahead: layer l's router applied to layer l-1's hidden
    # state, its top-J ids ranked (-1: none, always at layer 0), or None
    lookahead: np.ndarray | None = None
    # [T, L, J] int16 late gate lookahead: layer l's router applied to layer l-1's
    # *output* (the residual stream entering layer l) through layer l's pre-MoE norm;
    # available once layer l-1 is done (later, and closer to the router), or None
    lookahead_late: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.domains:
            object.__setattr__(self, "domains", (UNLABELLED,) * len(self.seq_starts))

    # ---- shape -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def num_experts(self) -> int:
        return self.meta.num_experts

    @property
    def num_sequences(self) -> int:
        return len(self.seq_starts)

    @property
    def seq_ends(self) -> np.ndarray:
        """[S] int64, one past the last token of each sequence."""
        return np.append(np.asarray(self.seq_starts[1:], dtype=np.int64), self.num_tokens)

    @property
    def seq_lengths(self) -> np.ndarray:
        return self.seq_ends - np.asarray(self.seq_starts, dtype=np.int64)

    def sequence_of_token(self) -> np.ndarray:
        """[T] int64, the sequence index of every token."""
        return np.repeat(np.arange(self.num_sequences), self.seq_lengths)

    def sequences(self) -> Iterator[tuple[int, slice]]:
        """(sequence index, token slice) for every sequence, in trace order."""
        for s, (a, b) in enumerate(zip(self.seq_starts, self.seq_ends, strict=True)):
            yield s, slice(int(a), int(b))

    def with_meta(self, **changes: Any) -> RoutingTrace:
        return dataclasses.replace(self, meta=dataclasses.replace(self.meta, **changes))

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(model={self.meta.model!r}, T={self.num_tokens}, "
            f"L={self.num_layers}, K={self.top_k}, N={self.num_experts}, "
            f"S={self.num_sequences}, decode={int(np.count_nonzero(self.is_decode))}"
            f"{', synthetic' if self.meta.synthetic else ''})"
        )


_INT64_MAX = int(np.iinfo(np.int64).max)


def inferred_num_experts(experts: np.ndarray, where: Callable[..., str] | None = None) -> int:
    """N as the largest id + 1 when the file does not say N, refused when absurd before
    anything N-sized is built; ``where(token, layer, slot)`` names the first such id."""
    top = int(experts.max()) if experts.size else 0
    if top < INFERRED_EXPERTS_MAX:
        return max(top + 1, 1)
    t, layer, slot = (int(i) for i in np.argwhere(experts >= INFERRED_EXPERTS_MAX)[0])
    raise TraceError(f"expert id {int(experts[t, layer, slot])} would make N (the largest id "
                     f"+ 1) {top + 1}", position=where(t, layer, slot) if where
                     else f"token {t}, layer {layer}, slot {slot}",
                     expected=f"ids below {INFERRED_EXPERTS_MAX} when N is inferred",
                     hint="the file may be damaged; pass --num-experts N if the model "
                     "really has that many experts")


def validate(trace: RoutingTrace, *, file: str | None = None) -> RoutingTrace:
    """Check every invariant of a trace; raise ``TraceError`` on the first broken one.

    Returns the trace so loaders can write ``return validate(trace)``.
    """
    ex, meta = trace.experts, trace.meta

    def fail(problem: str, position: str | None = None, expected: str | None = None) -> None:
        raise TraceError(problem, file=file, position=position, expected=expected)

    if ex.ndim != 3:
        fail(f"experts has rank {ex.ndim}, shape {tuple(ex.shape)}", expected="rank 3, [T, L, K]")
    if not np.issubdtype(ex.dtype, np.integer):
        fail(f"experts has dtype {ex.dtype}", expected="integer expert ids")
    t, n_layers, k = ex.shape
    if t == 0:
        fail("the trace is empty (0 tokens)", expected="at least one token")
    if n_layers == 0 or k == 0:
        fail(f"experts has shape {tuple(ex.shape)}", expected="at least one layer and one slot")
    if (
        isinstance(meta.num_experts, bool)
        or meta.num_experts <= 0
        or meta.num_experts > np.iinfo(np.int16).max
    ):
        fail(f"num_experts is {meta.num_experts}", expected="1..32767 (ids are int16)")
    if k != meta.top_k:
        fail(
            f"tokens have {k} expert slots but top_k is {meta.top_k}", expected=f"K == {meta.top_k}"
        )
    if n_layers != meta.num_layers:
        fail(
            f"tokens have {n_layers} MoE layers but num_layers is {meta.num_layers}",
            expected=f"every one of the {meta.num_layers} layers",
        )
    _validate_sequences(trace, fail)
    _validate_ids(trace, fail)
    if not any(np.asarray(trace.experts[sl]).max() >= 0 for sl in _chunks(t)):
        fail("every expert slot is empty (-1)", expected="at least one routed expert")
    if trace.weights is not None:
        check_weights(trace, fail)
    for name in LOOKAHEAD_FIELDS:
        if getattr(trace, name) is not None:
            check_lookahead(trace, name, fail)
    check_layer_ids(trace, fail)
    check_labels(trace, fail)
    return trace


LOOKAHEAD_FIELDS = ("lookahead", "lookahead_late")


def _validate_sequences(trace: RoutingTrace, fail: Any) -> None:
    t = trace.num_tokens
    starts = np.asarray(trace.seq_starts)
    if starts.ndim != 1 or len(starts) == 0:
        fail(f"seq_starts has shape {starts.shape}", expected="a 1-D array with at least one entry")
    if not np.issubdtype(starts.dtype, np.integer):
        fail(f"seq_starts has dtype {starts.dtype}", expected="integer token positions")
    starts = starts_as_int64(starts, fail)
    if starts[0] != 0:
        fail(f"the first sequence starts at token {int(starts[0])}", expected="0")
    steps = np.diff(starts)
    if np.any(steps <= 0):
        i = int(np.argmax(steps <= 0)) + 1
        fail(
            f"sequence {i} starts at token {int(starts[i])}, not after {int(starts[i - 1])}",
            position=f"sequence {i}",
            expected="strictly increasing sequence starts",
        )
    if starts[-1] >= t:
        fail(
            f"sequence {len(starts) - 1} starts at token {int(starts[-1])} of {t}",
            expected=f"starts below T={t} (no empty sequence)",
        )
    if trace.is_decode.shape != (t,) or trace.is_decode.dtype != np.bool_:
        fail(
            f"is_decode has shape {trace.is_decode.shape} dtype {trace.is_decode.dtype}",
            expected=f"bool [{t}]",
        )
    if len(trace.domains) != len(starts):
        fail(
            f"{len(trace.domains)} domain labels for {len(starts)} sequences",
            expected="one label per sequence",
        )
    if trace.token_ids is not None and (
        trace.token_ids.shape != (t,) or not np.issubdtype(trace.token_ids.dtype, np.integer)
    ):
        fail(f"token_ids has shape {trace.token_ids.shape}, dtype {trace.token_ids.dtype}",
             expected=f"integer [{t}]")
    if trace.token_ids is not None and t and int(np.max(trace.token_ids)) > _INT64_MAX:
        fail(f"token id {int(np.max(trace.token_ids))} does not fit int64",
             expected="ids as stored, int64")
    if trace.token_ids is not None and t and int(np.min(trace.token_ids)) < 0:
        tok = int(np.argmax(np.asarray(trace.token_ids) < 0))
        fail(f"token id {int(trace.token_ids[tok])} is negative", position=f"token {tok}",
             expected="vocabulary ids >= 0")


def starts_as_int64(starts: np.ndarray, fail: Any) -> np.ndarray:
    """Integer ``seq_starts`` as int64 once every value is a token position that fits
    it, judged at the stored width: a uint64 ``2**64 - 3`` or an int8 ``-100`` cast or
    subtracted first would wrap into plausible positions."""
    bad = starts < 0
    if np.issubdtype(starts.dtype, np.unsignedinteger):
        bad = starts > _INT64_MAX
    if bad.any():
        i = int(np.argmax(bad))
        fail(f"sequence {i} starts at token {int(starts[i])}", position=f"sequence {i}",
             expected="token positions >= 0 that fit int64")
    return starts.astype(np.int64)


def _validate_ids(trace: RoutingTrace, fail: Any) -> None:
    n = trace.num_experts
    for sl in _chunks(trace.num_tokens):
        block = np.asarray(trace.experts[sl])
        bad = (block < EMPTY_SLOT) | (block >= n)
        if bad.any():
            tok, layer, slot = _first(bad)
            fail(
                f"expert id {int(block[tok, layer, slot])} is out of range",
                position=f"token {tok + sl.start}, layer {layer}, slot {slot}",
                expected=f"0..{n - 1}, or -1 for an empty slot",
            )
        ordered = np.sort(block, axis=2)
        dup = (ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, 1:] != EMPTY_SLOT)
        if dup.any():
            tok, layer, slot = _first(dup)
            fail(
                f"expert {int(ordered[tok, layer, slot])} appears twice in one routing",
                position=f"token {tok + sl.start}, layer {layer}",
                expected="K distinct experts per token and layer",
            )

