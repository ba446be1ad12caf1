"""Published vLLM routing profiles: JSON Lines, one record per token and layer.

Each record holds ``problem_id``, ``layer``, ``token_pos`` (or ``token_idx``: the index
inside the forward batch), ``experts`` and ``gating_probs``. Per problem and layer, the
prefill pass numbers its tokens ``0..P-1`` (each once, in any file order) and every
decode step after it is ``0`` again, in generation order. So the prefill pass of a
layer ends where ``0`` comes a second time, and each record is placed by its own
position: prompt token ``p`` at row ``p``, the ``j``-th decode step at row ``P + j``.
Every layer of a problem must give the same prompt and the same number of tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.assemble import check_keys, expert_ids, gate_weights, layer_numbering
from stmoe.trace.engines.common import EngineOptions, SequenceRouting, assemble
from stmoe.trace.engines.jsonio import json_lines, opt_int
from stmoe.trace.schema import RoutingTrace

_REQUIRED = ("problem_id", "layer", "experts")
# ``dataset`` and a vocabulary ``token_id`` are read by nothing here, but known: a field
# that looks like a misspelt known one (``gating_prob``) is refused, its data not dropped.
_KNOWN = (*_REQUIRED, "token_pos", "token_idx", "gating_probs", "dataset", "token_id")
Record = tuple[int, list[int], list[float] | None, int]  # position, ids, weights, line


def read_profile(path: Path, opts: EngineOptions, num_experts: int | None) -> RoutingTrace:
    """Routing-profile JSON Lines: one sequence per ``problem_id``, in file order."""
    rows: dict[Any, dict[int, list[Record]]] = {}
    weighted: tuple[bool, int] | None = None  # (gating_probs present, on which line)
    for lineno, rec in json_lines(path):
        where = f"line {lineno}"
        check_keys(rec, _KNOWN, where)
        missing = [k for k in _REQUIRED if k not in rec]
        pos = rec.get("token_pos", rec.get("token_idx"))
        if missing or pos is None:
            raise TraceError(f"the record lacks {', '.join(missing) or 'token_pos'}",
                             position=where,
                             expected="problem_id, layer, token_pos (or token_idx), "
                             "experts")
        layer, pos = opt_int(rec, "layer", where), opt_int({"token_pos": pos}, "token_pos", where)
        ids = expert_ids(rec["experts"], where)
        probs = rec.get("gating_probs")
        if weighted is None:
            weighted = (probs is not None, lineno)
        if (probs is not None) != weighted[0]:
            raise TraceError(f"'gating_probs' is {'missing' if probs is None else 'given'} "
                             f"here but {'given' if weighted[0] else 'missing'} on line "
                             f"{weighted[1]}", position=where,
                             expected="gating_probs in all records or in none")
        w = None if probs is None else gate_weights(probs, len(ids), where)
        key = rec["problem_id"]
        if not isinstance(key, int | str) or isinstance(key, bool):
            raise TraceError(f"'problem_id' is {key!r}", position=where,
                             expected="an integer or string id")
        rows.setdefault(key, {}).setdefault(int(layer or 0), []).append((pos, ids, w, lineno))
    if not rows:
        raise TraceError("the file holds no records", expected="routing-profile records")
    all_layers = sorted({layer for per in rows.values() for layer in per})
    mapping, layer_extra = layer_numbering(all_layers)
    requests = [_request(key, per, mapping, layer_extra) for key, per in rows.items()]
    meta = {"source": f"imported from {path.name} (vLLM routing profile)", "file": str(path)}
    return assemble(requests, opts, num_experts, meta)


def _request(key: Any, per: dict[int, list[Record]], mapping: dict[int, int],
             extra: dict) -> SequenceRouting:
    first = min(per)
    placed = {layer: _rows(key, layer, recs) for layer, recs in per.items()}
    prompt = placed[first][0]
    for layer in mapping:
        if layer not in per or len(per[layer]) != len(per[first]):
            raise TraceError(f"problem {key!r} has {len(per.get(layer, []))} records for "
                             f"layer {layer} but {len(per[first])} for layer {first}",
                             position=f"line {per[first][0][3]}",
                             expected="one record per token for every layer")
        if placed[layer][0] != prompt:
            raise TraceError(f"problem {key!r} has a prefill pass of {placed[layer][0]} "
                             f"tokens at layer {layer} but {prompt} at layer {first}",
                             position=f"line {per[layer][0][3]}",
                             expected="the same prompt at every layer")
    n, k = len(per[first]), len(per[first][0][1])
    experts = np.full((n, len(mapping), k), -1, dtype=np.int32)
    has_w = per[first][0][2] is not None
    weights = np.zeros(experts.shape, np.float32) if has_w else None
    for layer, recs in per.items():
        for row, (_, ids, w, lineno) in zip(placed[layer][1], recs, strict=True):
            if len(ids) != k:
                raise TraceError(f"{len(ids)} experts here but {k} elsewhere",
                                 position=f"line {lineno}", expected=f"K={k} experts")
            experts[row, mapping[layer]] = ids
            if weights is not None:
                weights[row, mapping[layer]] = w
    return SequenceRouting(experts, prompt, weights=weights, where=f"problem {key!r}",
                           extra=dict(extra))


def _rows(key: Any, layer: int, recs: list[Record]) -> tuple[int, list[int]]:
    """One layer's prompt length and the row of each of its records (file order): the
    prefill pass ends where position 0 comes a second time; its records are placed by
    position, each of ``0..P-1`` once; every record after it is a decode step at 0."""
    zeros = [i for i, r in enumerate(recs) if r[0] == 0]
    if not zeros:
        pos, _, _, lineno = min(recs, key=lambda r: r[0])
        raise TraceError(f"problem {key!r}, layer {layer} starts at token_pos {pos}",
                         position=f"line {lineno}",
                         expected=f"positions from 0 (tokens 0..{pos - 1} are missing)")
    prompt = zeros[1] if len(zeros) > 1 else len(recs)
    rows, seen = [], set()
    for i, (pos, _, _, lineno) in enumerate(recs):
        bad = (pos in seen or pos >= prompt) if i < prompt else pos != 0
        if bad:
            raise TraceError(
                f"problem {key!r}, layer {layer}: token_pos {pos} "
                + (f"in a prefill pass of {prompt} records" if i < prompt
                   else "after the prefill pass"),
                position=f"line {lineno}",
                expected=f"token_pos 0..{prompt - 1}, each once, in the prefill pass, then 0 "
                "for each decode step", hint="a token's record is missing or repeated")
        seen.add(pos)
        rows.append(pos if i < prompt else i)
    return prompt, rows
