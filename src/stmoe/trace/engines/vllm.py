"""vLLM's routing: the OpenAI server's completions response, and published routing profiles.

With ``enable_return_routed_experts`` vLLM returns, per request, an int array
``[prompt + generated - 1, num_hidden_layers, top_k]`` (rows are token positions;
the last sampled token never ran through the model). Offline,
``CompletionOutput.routed_experts`` is that array (``np.save`` it and it is a bare
``.npy``, read by ``arrays.read_npy``); the OpenAI server puts it in
``choices[].routed_experts`` as base64 of ``.npy`` bytes. Dense layers hold the
buffer's fill (0, or -1 in newer versions); ``common`` drops them.

Routing profiles published from vLLM runs are JSON Lines, one record per token and
layer: ``problem_id``, ``layer``, ``token_pos`` (or ``token_idx``: the index inside
the forward batch, 0..P-1 in prefill and 0 for every decode step), ``experts`` and
``gating_probs``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.assemble import expert_ids, gate_weights, layer_numbering
from stmoe.trace.engines.common import (
    EngineOptions,
    SequenceRouting,
    assemble,
    checked_ids,
    note,
    note_missing_prompts,
    written_moe_layers,
)
from stmoe.trace.engines.jsonio import b64_bytes, id_list, load_json, opt_int
from stmoe.trace.npfiles import load_npy_bytes, short
from stmoe.trace.schema import RoutingTrace
from stmoe.util.progress import progress_bytes


def read_response(path: Path, opts: EngineOptions, num_experts: int | None) -> RoutingTrace:
    """A ``/v1/completions`` response: one sequence per choice, in index order."""
    doc = load_json(path)
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        raise TraceError("the response has no 'choices' list",
                         expected="a vLLM completions response")
    if all(isinstance(c, dict) and isinstance(c.get("index"), int) for c in choices):
        choices = sorted(choices, key=lambda c: c["index"])
    usage = doc.get("usage")  # counts over all choices: only one choice's own lengths
    counts = (opt_int(usage, "prompt_tokens", "usage"),
              opt_int(usage, "completion_tokens", "usage")) if len(choices) == 1 \
        else (None, None)
    top_ids = id_list(doc.get("prompt_token_ids"), "prompt_token_ids", "response")
    requests = []
    for i, choice in enumerate(choices):
        where = f"choices[{i}]"
        if not isinstance(choice, dict):
            raise TraceError(f"a JSON {type(choice).__name__}", position=where,
                             expected="a choice object")
        experts = _routed(choice.get("routed_experts"), where, num_experts)
        prompt_ids = id_list(choice.get("prompt_token_ids"), "prompt_token_ids", where)
        if prompt_ids is None and len(choices) == 1:
            prompt_ids = top_ids
        gen_ids = id_list(choice.get("token_ids"), "token_ids", where)
        prompt = len(prompt_ids) if prompt_ids is not None else counts[0]
        _check_rows(len(experts), prompt_ids, gen_ids, counts, where)
        known = (prompt_ids or []) + (gen_ids or [])
        tokens = np.asarray(known[: len(experts)], dtype=np.int64) \
            if prompt_ids is not None and len(known) >= len(experts) else None
        if prompt_ids is not None and tokens is None:
            note(f"{where}: token ids dropped (the response has prompt_token_ids but not "
                 "the generated token_ids)")
        requests.append(SequenceRouting(experts, prompt, token_ids=tokens, where=where))
    note_missing_prompts(requests, opts)
    opts = written_moe_layers(opts, doc.get("stmoe_moe_layers"), "response")
    meta = {"source": f"imported from {path.name} (vLLM response)", "file": str(path),
            "model": doc.get("model", "unknown"), "rank_order": False}  # CPU: topk unsorted
    return assemble(requests, opts, num_experts, meta)


def _check_rows(rows: int, prompt_ids: list[int] | None, gen_ids: list[int] | None,
                counts: tuple[int | None, int | None], where: str) -> None:
    """The rows against the token counts the response gives: vLLM routes prompt +
    generated - 1 tokens (the last sampled one never runs); ``stmoe export`` lists the
    ids of the routed tokens only, so prompt + generated ids may equal the rows too."""
    if prompt_ids is not None and gen_ids is not None:
        p, g = len(prompt_ids), len(gen_ids)
        if rows not in (p + g - 1, p + g):
            raise TraceError(f"{rows} routed tokens but prompt_token_ids ({p}) and token_ids "
                             f"({g}) make {p + g - 1}", position=f"{where}.routed_experts",
                             expected="prompt + generated - 1 rows",
                             hint="the response looks truncated or edited")
    prompt, completion = counts
    if prompt is not None and completion is not None and completion > 0 \
            and rows != prompt + completion - 1:
        raise TraceError(f"{rows} routed tokens but usage says {prompt} prompt + "
                         f"{completion} completion tokens", position=f"{where}.routed_experts",
                         expected=f"{prompt + completion - 1} rows (prompt + completion - 1)",
                         hint="the response looks truncated or edited")


def _routed(value: Any, where: str, num_experts: int | None) -> np.ndarray:
    """``routed_experts``: base64 of ``.npy`` bytes (the server) or nested lists; ids
    checked at the width they were stored in (``common.checked_ids``)."""
    if value is None:
        raise TraceError("the choice has no 'routed_experts'", position=where,
                         expected="routing (start vLLM with "
                         "enable_return_routed_experts)")
    if isinstance(value, list):
        try:
            arr = np.asarray(value)
        except (ValueError, OverflowError):
            arr = np.zeros(0)
    else:
        raw = b64_bytes(value, f"{where}.routed_experts")
        try:
            arr = load_npy_bytes(raw)
        except (ValueError, OSError, EOFError) as exc:
            raise TraceError(f"'routed_experts' is not a readable .npy array ({short(exc)})",
                             position=f"{where}.routed_experts",
                             expected="base64 of .npy bytes",
                             hint="the response looks truncated") from None
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
        raise TraceError(f"'routed_experts' has shape {arr.shape}, dtype {arr.dtype}",
                         position=f"{where}.routed_experts",
                         expected="integer [tokens - 1, layers, top_k]")
    return checked_ids(arr, num_experts, f"{where}.routed_experts")


_PROFILE_FIELDS = ("problem_id", "layer", "experts")


def read_profile(path: Path, opts: EngineOptions, num_experts: int | None) -> RoutingTrace:
    """Routing-profile JSON Lines: tokens rebuilt per (problem, layer) in file order."""
    rows: dict[Any, dict[int, list[tuple[int, list[int], list[float] | None, int]]]] = {}
    for lineno, rec in _lines(path):
        where = f"line {lineno}"
        missing = [k for k in _PROFILE_FIELDS if k not in rec]
        pos = rec.get("token_pos", rec.get("token_idx"))
        if missing or pos is None:
            raise TraceError(f"the record lacks {', '.join(missing) or 'token_pos'}",
                             position=where,
                             expected="problem_id, layer, token_pos (or token_idx), "
                             "experts")
        layer, pos = opt_int(rec, "layer", where), opt_int({"p": pos}, "p", where)
        ids = expert_ids(rec["experts"], where)
        probs = rec.get("gating_probs")
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
    requests = [_profile_request(key, per, mapping, layer_extra) for key, per in rows.items()]
    meta = {"source": f"imported from {path.name} (vLLM routing profile)", "file": str(path)}
    return assemble(requests, opts, num_experts, meta)


def _profile_request(key: Any, per: dict, mapping: dict[int, int], extra: dict) -> SequenceRouting:
    counts = {layer: len(recs) for layer, recs in per.items()}
    first = min(per)
    bad = next((layer for layer in mapping if counts.get(layer, 0) != counts[first]), None)
    if bad is not None:
        raise TraceError(f"problem {key!r} has {counts.get(bad, 0)} records for layer {bad} "
                         f"but {counts[first]} for layer {first}",
                         position=f"line {per[first][0][3]}",
                         expected="one record per token for every layer")
    n, k = counts[first], len(per[first][0][1])
    experts = np.full((n, len(mapping), k), -1, dtype=np.int32)
    has_w = all(r[2] is not None for recs in per.values() for r in recs)
    weights = np.zeros(experts.shape, np.float32) if has_w else None
    for layer, recs in per.items():
        for t, (_, ids, w, lineno) in enumerate(recs):
            if len(ids) != k:
                raise TraceError(f"{len(ids)} experts here but {k} elsewhere",
                                 position=f"line {lineno}", expected=f"K={k} experts")
            experts[t, mapping[layer]] = ids
            if weights is not None:
                weights[t, mapping[layer]] = w
    # The prefill pass numbers its tokens 0..P-1; every decode step restarts at 0.
    positions = [r[0] for r in per[first]]
    prompt = next((i for i, p in enumerate(positions) if p != i), len(positions))
    return SequenceRouting(experts, prompt, weights=weights, where=f"problem {key!r}",
                           extra=dict(extra))


def _lines(path: Path):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(progress_bytes(f, path, "reading JSON Lines"), start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise TraceError(f"not valid JSON ({exc})", position=f"line {lineno}",
                                 expected="one JSON object per line",
                                 hint=None if raw.endswith(b"\n")
                                 else "the file looks truncated") from None
            if not isinstance(obj, dict):
                raise TraceError(f"a JSON {type(obj).__name__}", position=f"line {lineno}",
                                 expected="one JSON object per line")
            yield lineno, obj
