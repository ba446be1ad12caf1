"""JSON Lines routing: one record per (token, layer), in any order.

    {"seq": 0, "token": 5, "layer": 3, "experts": [12, 7], "weights": [0.6, 0.4]}

An optional first line ``{"meta": {"model": ..., "num_experts": ..., "synthetic": ...}}``
carries the trace's metadata (``stmoe export`` writes it); the ``num_layers`` and
``top_k`` it declares must be what the records hold.

Optional per record: ``weights`` (all records or none), ``phase``
(``"prefill"``/``"decode"``) or ``decode`` (bool), and ``domain`` (one per
sequence). ``seq`` may be an integer or a string; sequences are ordered by it.
Within a sequence, token positions must be consecutive, prefill tokens come before
decode ones, and every token must have every layer that appears anywhere in the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.assemble import (
    agreed_num_experts,
    check_declared,
    check_keys,
    check_phase_order,
    expert_ids,
    gate_weights,
    layer_numbering,
    order_by_weight,
)
from stmoe.trace.engines.jsonio import json_lines
from stmoe.trace.schema import (
    UNLABELLED,
    RoutingTrace,
    TraceMeta,
    inferred_num_experts,
    meta_int,
    validate,
)

_FIELDS = ("seq", "token", "layer", "experts", "weights", "phase", "decode", "domain")


class _Records:
    """Columns of the parsed records, with the line each came from."""

    def __init__(self) -> None:
        self.seq_keys: dict[Any, int] = {}
        self.seq: list[int] = []
        self.token: list[int] = []
        self.layer: list[int] = []
        self.experts: list[list[int]] = []
        self.weights: list[list[float]] = []
        self.decode: list[bool] = []
        self.line: list[int] = []
        self.domain: dict[int, tuple[str, int]] = {}
        self.header: dict[str, Any] = {}
        self.header_line = 0


def read(path: Path, *, num_experts: int | None = None) -> RoutingTrace:
    """Parse a JSON Lines routing file into a validated trace."""
    rec = _Records()
    top_k: int | None = None
    has_weights: bool | None = None
    for lineno, obj in json_lines(path):
        if "meta" in obj and "layer" not in obj:
            rec.header = _header(obj["meta"], lineno, first=not rec.line and not rec.header)
            rec.header_line = lineno
            continue
        check_keys(obj, _FIELDS, f"line {lineno}")
        experts = expert_ids(obj.get("experts"), f"line {lineno}")
        if top_k is None:
            top_k = len(experts)
        if len(experts) != top_k:
            raise TraceError(
                f"{len(experts)} experts in this record but {top_k} in the first one",
                position=f"line {lineno}",
                expected=f"K={top_k} experts in every record",
            )
        weights = obj.get("weights")
        if has_weights is None:
            has_weights = weights is not None
        if (weights is not None) != has_weights:
            raise TraceError(
                "some records have 'weights' and others not",
                position=f"line {lineno}",
                expected="weights in all records or in none",
            )
        if weights is not None:
            rec.weights.append(gate_weights(weights, top_k, f"line {lineno}"))
        seq_key = obj.get("seq", 0)
        if not isinstance(seq_key, int | str) or isinstance(seq_key, bool):
            raise TraceError(
                f"'seq' is {seq_key!r}",
                position=f"line {lineno}",
                expected="an integer or string sequence id",
            )
        sid = rec.seq_keys.setdefault(seq_key, len(rec.seq_keys))
        rec.seq.append(sid)
        rec.token.append(_int_field(obj, "token", lineno))
        rec.layer.append(_int_field(obj, "layer", lineno))
        rec.experts.append(experts)
        rec.decode.append(_is_decode(obj, lineno))
        rec.line.append(lineno)
        if "domain" in obj:
            label = str(obj["domain"])
            seen = rec.domain.setdefault(sid, (label, lineno))
            if seen[0] != label:
                raise TraceError(
                    f"sequence {seq_key!r} has domain {label!r} here "
                    f"but {seen[0]!r} on line {seen[1]}",
                    position=f"line {lineno}",
                    expected="one domain per sequence",
                )
    if not rec.line:
        raise TraceError("the file holds no records", expected="at least one routing record")
    assert top_k is not None
    check_declared(rec.header, rec.layer, top_k, f"line {rec.header_line}", f"line {rec.line[0]}")
    declared = meta_int(rec.header, "num_experts") if "num_experts" in rec.header else None
    return _assemble(rec, path, agreed_num_experts(num_experts, declared))


def _header(meta: Any, lineno: int, first: bool) -> dict[str, Any]:
    if not first:
        raise TraceError("a metadata record after the first line", position=f"line {lineno}",
                         expected='{"meta": ...} only as the first record')
    if not isinstance(meta, dict):
        raise TraceError(f"'meta' is {meta!r}", position=f"line {lineno}", expected="an object")
    try:  # the same checks as a native file's metadata
        TraceMeta.from_dict({"num_experts": 1, "top_k": 1, "num_layers": 1, **meta})
    except TraceError as exc:
        raise TraceError(exc.problem, position=f"line {lineno}", expected=exc.expected) from None
    return meta


def _int_field(obj: dict[str, Any], key: str, lineno: int) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
        said = f"{key!r} missing" if key not in obj else f"{key!r} is {value!r}"
        raise TraceError(said, position=f"line {lineno}", expected=f"an integer {key!r} >= 0")
    return value


def _is_decode(obj: dict[str, Any], lineno: int) -> bool:
    if "decode" in obj and "phase" in obj and obj["decode"] != (obj["phase"] == "decode"):
        raise TraceError(f"'decode' is {obj['decode']!r} but 'phase' is {obj['phase']!r}",
                         position=f"line {lineno}",
                         expected="one of them, or both agreeing")
    if "decode" in obj:
        if not isinstance(obj["decode"], bool):
            raise TraceError(
                f"'decode' is {obj['decode']!r}",
                position=f"line {lineno}",
                expected="true or false",
            )
        return obj["decode"]
    phase = obj.get("phase", "prefill")
    if phase not in ("prefill", "decode"):
        raise TraceError(
            f"'phase' is {phase!r}", position=f"line {lineno}", expected="'prefill' or 'decode'"
        )
    return phase == "decode"


def _assemble(rec: _Records, path: Path, num_experts: int | None) -> RoutingTrace:
    # Sequences are ordered by their id (numeric ids numerically), not file order.
    keys = list(rec.seq_keys)
    by_key = sorted(range(len(keys)), key=lambda i: (isinstance(keys[i], str), keys[i]))
    rank = np.empty(len(keys), dtype=np.int64)
    rank[by_key] = np.arange(len(keys))
    seq = rank[np.asarray(rec.seq)]
    token = np.asarray(rec.token, dtype=np.int64)
    layer_map, layer_extra = layer_numbering(rec.layer)
    layer = np.asarray([layer_map[x] for x in rec.layer], dtype=np.int64)
    line = np.asarray(rec.line)
    n_layers = len(layer_map)

    order = np.lexsort((layer, token, seq))
    seq, token, layer, line = seq[order], token[order], layer[order], line[order]
    same = (seq[1:] == seq[:-1]) & (token[1:] == token[:-1])
    dup = same & (layer[1:] == layer[:-1])
    if dup.any():
        i = int(np.argmax(dup))
        raise TraceError(
            f"a second record for sequence {keys[by_key[seq[i]]]!r}, token {token[i]}, "
            f"layer {rec.layer[order[i]]} (first on line {line[i]})",
            position=f"line {line[i + 1]}",
            expected="one record per (seq, token, layer)",
        )
    # Group records into tokens; every token must carry every layer.
    new_token = np.r_[True, ~same]
    tok_first = np.flatnonzero(new_token)
    tok_count = np.diff(np.r_[tok_first, len(seq)])
    short = np.flatnonzero(tok_count != n_layers)
    if len(short):
        i = tok_first[short[0]]
        have = set(layer[i : i + tok_count[short[0]]].tolist())
        missing = next(lid for lid, m in layer_map.items() if m not in have)
        raise TraceError(
            f"sequence {keys[by_key[seq[i]]]!r}, token {token[i]} "
            f"has no record for layer {missing}",
            position=f"line {line[i]}",
            expected=f"all {n_layers} layers for every token",
        )
    tok_seq, tok_pos = seq[tok_first], token[tok_first]
    new_seq = np.r_[True, tok_seq[1:] != tok_seq[:-1]]
    gap = ~new_seq[1:] & (tok_pos[1:] != tok_pos[:-1] + 1)
    if gap.any():
        i = int(np.argmax(gap)) + 1
        raise TraceError(
            f"sequence {keys[by_key[tok_seq[i]]]!r} jumps from token {tok_pos[i - 1]} to "
            f"{tok_pos[i]}",
            position=f"line {line[tok_first[i]]}",
            expected="consecutive token positions (no missing token)",
        )
    late = new_seq & (tok_pos != 0)
    if late.any():
        i = int(np.argmax(late))
        raise TraceError(
            f"sequence {keys[by_key[tok_seq[i]]]!r} starts at token {tok_pos[i]}",
            position=f"line {line[tok_first[i]]}",
            expected=f"token positions from 0 (tokens 0..{tok_pos[i] - 1} are missing)",
        )
    decode = np.asarray(rec.decode)[order]
    mixed = np.add.reduceat(decode.astype(np.int64), tok_first)
    torn = (mixed != 0) & (mixed != tok_count)
    if torn.any():
        i = tok_first[int(np.argmax(torn))]
        raise TraceError(
            f"the layers of sequence {keys[by_key[seq[i]]]!r}, token {token[i]} disagree on "
            "prefill/decode",
            position=f"line {line[i]}",
            expected="one phase per token",
        )
    check_phase_order(decode[tok_first], np.flatnonzero(new_seq), lambda i: (
        f"line {line[tok_first[i]]}, sequence {keys[by_key[tok_seq[i]]]!r}, token {tok_pos[i]}"))
    experts = np.asarray(rec.experts, dtype=np.int64)[order].reshape(len(tok_first), n_layers, -1)
    weights = None
    extra: dict[str, Any] = dict(layer_extra)
    if rec.weights:
        weights = np.asarray(rec.weights, dtype=np.float32)[order].reshape(experts.shape)
        experts, weights, changed = order_by_weight(experts, weights)
        if changed:
            extra["reordered_by_weight"] = changed
    _check_ids(experts, num_experts, line[tok_first], rec, layer_map)
    n = num_experts
    if n is None:
        token_lines = line[tok_first]
        n = inferred_num_experts(experts, lambda t, layer, _: "line " + str(
            _line_of(rec, int(token_lines[t]), layer, layer_map)))
        extra["num_experts_inferred"] = True
    labels = {rank[sid]: lab for sid, (lab, _) in rec.domain.items()}
    trace = RoutingTrace(
        experts=experts.astype(np.int16),
        seq_starts=np.flatnonzero(new_seq).astype(np.int64),
        is_decode=decode[tok_first],
        weights=weights,
        domains=tuple(labels.get(s, UNLABELLED) for s in range(len(keys))),
        meta=TraceMeta(
            num_experts=n,
            top_k=experts.shape[2],
            num_layers=n_layers,
            model=str(rec.header.get("model", "unknown")),
            source=f"imported from {path.name}",
            synthetic=bool(rec.header.get("synthetic", False)),
            extra={**rec.header.get("extra", {}), **extra},
        ),
    )
    return validate(trace, file=str(path))


def _check_ids(
    experts: np.ndarray,
    num_experts: int | None,
    token_lines: np.ndarray,
    rec: _Records,
    layer_map: dict[int, int],
) -> None:
    """Range and duplicate checks that can name the offending line."""
    hi = num_experts if num_experts is not None else np.iinfo(np.int16).max
    bad = (experts < -1) | (experts >= hi)
    ordered = np.sort(experts, axis=2)
    dup = np.zeros_like(bad)
    dup[:, :, 1:] = (ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, 1:] != -1)
    for mask, what in ((bad, "out of range"), (dup, "duplicate")):
        if mask.any():
            tok, lay, slot = (int(i) for i in np.argwhere(mask)[0])
            first_line = int(token_lines[tok])
            lineno = _line_of(rec, first_line, lay, layer_map)
            if what == "duplicate":
                raise TraceError(
                    f"expert {int(ordered[tok, lay, slot])} appears twice in one routing",
                    position=f"line {lineno}",
                    expected="K distinct experts per token and layer",
                )
            raise TraceError(
                f"expert id {int(experts[tok, lay, slot])} is out of range",
                position=f"line {lineno}",
                expected=f"0..{hi - 1}, or -1 for an empty slot",
            )


def _line_of(rec: _Records, token_line: int, layer: int, layer_map: dict[int, int]) -> int:
    """The line of the record for (the token first seen on ``token_line``, ``layer``)."""
    i = rec.line.index(token_line)
    sid, tok = rec.seq[i], rec.token[i]
    for j in range(len(rec.line)):
        if rec.seq[j] == sid and rec.token[j] == tok and layer_map[rec.layer[j]] == layer:
            return rec.line[j]
    return token_line
