"""SGLang's routing: the ``/generate`` response and the expert-distribution recorder.

``--enable-return-routed-experts`` plus ``"return_routed_experts": true`` in a request
puts ``meta_info.routed_experts`` in the response: base64 of raw little-endian ids
(dtype in ``meta_info.routed_experts_dtype``, int32 when absent), one row for each of
the positions ``[0, prompt + completion - 1)`` over every model layer and top-k slot
(fewer rows are a cut response, refused). The response does not say L and K
(``--layers``, ``--top-k``); a batch request returns a JSON list of such objects.

The recorder (``--expert-distribution-recorder-mode per_token``, then
``/start_expert_distribution_record`` ... ``/dump_expert_distribution_record``) writes
one ``torch.save`` dict per rank: ``records`` (one per forward pass) and
``last_physical_to_logical_map``. Passes carry no request ids, so requests are rebuilt
here: an extend pass splits by ``extend_seq_lens``; a token at position ``p > 0``
continues the open request whose last position was ``p - 1`` (in batch order, which
SGLang keeps). ``torchfile`` loads the dict (torch stays out of this module).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.engines.common import (
    EngineOptions,
    SequenceRouting,
    assemble,
    checked_ids,
    note_missing_prompts,
)
from stmoe.trace.engines.jsonio import b64_bytes, load_json, opt_int
from stmoe.trace.engines.options import written_moe_layers
from stmoe.util.shown import short_repr

_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64")
EXTEND, DECODE, MIXED, IDLE = 1, 2, 3, 4  # ForwardMode values the recorder stores


def read_generate(path: Path, opts: EngineOptions, num_experts: int | None):
    """A ``/generate`` response (object) or a batch's (list): one sequence per response."""
    doc = load_json(path)
    responses = doc if isinstance(doc, list) else [doc]
    if not responses:
        raise TraceError("the batch is an empty list", expected="a /generate response, or a "
                         "list of one or more")
    opts = _layers_written(opts, responses[0])
    requests = [_response(r, i, opts, num_experts) for i, r in enumerate(responses)]
    note_missing_prompts(requests, opts)
    infos = [r["meta_info"] for r in responses]  # each checked a dict by _response
    opts = written_moe_layers(opts, [(f"response {i}", info.get("stmoe_moe_layers"))
                                     for i, info in enumerate(infos)], requests)
    meta = {"source": f"imported from {path.name} (SGLang response)", "file": str(path)}
    if infos[0].get("stmoe_rank_order") is False:
        meta["rank_order"] = False  # stmoe's export of a trace whose rows are sets
    return assemble(requests, opts, num_experts, meta)


def _response(resp: Any, i: int, opts: EngineOptions, num_experts: int | None) -> SequenceRouting:
    where = f"response {i}"
    info = resp.get("meta_info") if isinstance(resp, dict) else None
    if not isinstance(info, dict) or "routed_experts" not in info:
        raise TraceError("no 'meta_info.routed_experts'", position=where,
                         expected="routing (--enable-return-routed-experts and "
                         '"return_routed_experts": true in the request)')
    raw = b64_bytes(info["routed_experts"], f"{where}, meta_info.routed_experts")
    name = info.get("routed_experts_dtype") or "int32"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise TraceError(f"routed_experts_dtype is {name!r}", position=where,
                         expected=f"one of {', '.join(_DTYPES)}")
    dtype = np.dtype(name).newbyteorder("<")
    if len(raw) % dtype.itemsize:
        raise TraceError(f"{len(raw)} bytes are not a whole number of {name} ids",
                         position=f"{where}, meta_info.routed_experts",
                         expected=f"a multiple of {dtype.itemsize} bytes",
                         hint="check routed_experts_dtype, "
                         "or the response is truncated")
    n = len(raw) // dtype.itemsize
    prompt = opt_int(info, "prompt_tokens", where)
    completion = opt_int(info, "completion_tokens", where)
    end = prompt + completion - 1 if prompt is not None and completion is not None else None
    if end is not None and end < 0:
        raise TraceError("prompt_tokens and completion_tokens are both 0", position=where,
                         expected="a request of at least one token: it routes prompt + "
                         "completion - 1 of them")
    layers, top_k = _shape(n, end, opts, where)
    rows = n // (layers * top_k)
    if rows * layers * top_k != n:
        raise TraceError(f"{n} ids are not a whole number of tokens of {layers} layers x "
                         f"{top_k} slots", position=f"{where}, meta_info.routed_experts",
                         expected="--layers and --top-k of the model that answered")
    if end is not None and rows != end:
        raise TraceError(f"{rows} routed tokens but prompt_tokens + completion_tokens - 1 is "
                         f"{end}", position=f"{where}, meta_info.routed_experts",
                         expected=f"{end} rows of {layers} x {top_k} ids (one per routed "
                         "token)", hint="the response looks truncated; else check --layers "
                         "and --top-k")
    stored = np.frombuffer(raw, dtype=dtype).reshape(rows, layers, top_k)
    return SequenceRouting(checked_ids(stored, num_experts, f"{where}, meta_info.routed_experts"),
                   prompt, where=where)


def _layers_written(opts: EngineOptions, first: Any) -> EngineOptions:
    """SGLang's bytes do not say L; a ``stmoe export`` of them does (its ``stmoe_moe_layers``
    ends at the last model layer that routes): L is that + 1 where no --layers is given
    (``written_moe_layers`` then checks the field against the routing)."""
    info = first.get("meta_info") if isinstance(first, dict) else None
    named = info.get("stmoe_moe_layers") if isinstance(info, dict) else None
    if opts.layers is not None or not isinstance(named, list) or not named:
        return opts
    last = named[-1]
    if isinstance(last, bool) or not isinstance(last, int) or not 0 <= last < 1 << 16:
        return opts  # (refused, named, by written_moe_layers)
    return replace(opts, layers=last + 1)


def _shape(n: int, end: int | None, opts: EngineOptions, where: str) -> tuple[int, int]:
    """L and K: the options, or one derived from the other and the token count."""
    layers, top_k = opts.layers, opts.top_k
    per_token = n // end if end and n % end == 0 else None
    if layers is None and top_k is not None and per_token and per_token % top_k == 0:
        layers = per_token // top_k
    if top_k is None and layers is not None and per_token and per_token % layers == 0:
        top_k = per_token // layers
    elif top_k is None and layers is not None and per_token:
        raise TraceError(f"{per_token} ids per token are not a multiple of {layers} layers",
                         position=where, expected="--layers of the model that answered (its "
                         "config's num_hidden_layers), or --top-k too")
    if layers is None or top_k is None:
        held = f"; it holds {per_token} ids per token (L x K)" if per_token else ""
        raise TraceError("the response does not say its layers and top-k" + held,
                         position=where, expected="--layers L --top-k K",
                         hint="L is the model config's num_hidden_layers, K its "
                         "num_experts_per_tok")
    return layers, top_k


@dataclass
class _Open:
    """A request being rebuilt from forward passes."""

    start: int
    last: int
    rows: list[np.ndarray] = field(default_factory=list)  # [n, L, K] blocks
    ids: list[int] = field(default_factory=list)
    first_decode: int | None = None  # position of the first decode token


def read_recorder(dumps: list[tuple[Path, dict]], opts: EngineOptions,
                  num_experts: int | None):
    """Per-token recorder dumps (one per rank) -> one trace; a rank whose passes repeat
    another's exactly (tensor parallelism) is read once."""
    requests: list[SequenceRouting] = []
    seen: set[int] = set()
    for path, dump in dumps:
        try:
            records, mapping = _checked(dump)
            fingerprint = hash(tuple(
                (r["forward_pass_id"], tuple(r["positions"]), tuple(r["input_ids"]))
                for r in records
            ))
            if fingerprint in seen:
                continue
            seen.add(fingerprint)
            requests += _rebuild(records, mapping)
        except TraceError as exc:
            raise exc.in_file(path) from None
    names = ", ".join(p.name for p, _ in dumps)
    meta = {"source": f"imported from {names} (SGLang expert-distribution recorder)"}
    return assemble(requests, opts, num_experts, meta)


def _checked(dump: dict) -> tuple[list[dict], np.ndarray]:
    records = dump.get("records")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise TraceError("'records' is not a list of forward passes",
                         expected="the per_token recorder's dump")
    records = [_record(r, i) for i, r in enumerate(records)]
    mapping = dump.get("last_physical_to_logical_map")
    if mapping is None:
        raise TraceError("the dump has no 'last_physical_to_logical_map'",
                         expected="the recorder's [layers, physical experts] map",
                         hint="recorded ids are physical; without the map they cannot be "
                         "read as experts")
    mapping = np.asarray(mapping)
    if mapping.ndim != 2 or not np.issubdtype(mapping.dtype, np.integer):
        raise TraceError(f"last_physical_to_logical_map has shape {mapping.shape}",
                         expected="integer [layers, physical experts]")
    return records, checked_ids(mapping, None, "last_physical_to_logical_map")


def _record(rec: dict, i: int) -> dict:
    """One forward pass with its id, tokens, positions and lengths checked and made plain
    (ints; lists of ints >= 0) before anything sorts, iterates or adds them."""
    where = f"record {i}"
    fid = rec.get("forward_pass_id")
    if isinstance(fid, np.ndarray) and fid.ndim == 0:
        fid = fid.item()
    if fid is not None and (not isinstance(fid, int | np.integer) or isinstance(fid, bool)):
        raise TraceError(f"'forward_pass_id' is {short_repr(fid)}", position=where,
                         expected="an integer, the pass's number")
    out = dict(rec, forward_pass_id=int(fid or 0))
    for key in ("input_ids", "positions", "extend_seq_lens"):
        out[key] = _ints(rec.get(key), key, f"{where} (forward pass {out['forward_pass_id']})")
    return out


def _ints(value: Any, key: str, where: str) -> list[int]:
    """A record's list (or 1-D tensor) of integers >= 0; None is an empty list."""
    if value is None:
        return []
    items = value.tolist() if isinstance(value, np.ndarray) and value.ndim == 1 else value
    if not isinstance(items, list | tuple) or not all(
            isinstance(v, int | np.integer) and not isinstance(v, bool) and 0 <= v < 2**62
            for v in items):
        raise TraceError(f"{key!r} is {short_repr(value)}", position=where,
                         expected="a list of integers >= 0")
    return [int(v) for v in items]


def _rebuild(records: list[dict], mapping: np.ndarray) -> list[SequenceRouting]:
    order = sorted(range(len(records)), key=lambda i: (records[i]["forward_pass_id"], i))
    reqs: list[_Open] = []
    for i in order:
        rec = records[i]
        where = f"record {i} (forward pass {rec.get('forward_pass_id')})"
        mode = rec.get("forward_mode")
        if mode == IDLE or not rec.get("input_ids"):
            continue
        if mode not in (EXTEND, DECODE, MIXED):
            raise TraceError(f"forward_mode is {mode!r}", position=where,
                             expected="1 extend, 2 decode, 3 mixed or 4 idle")
        ids, pos = rec["input_ids"], rec["positions"]
        tokens = _logical(rec.get("topk_ids_of_layer"), mapping, len(ids), where)
        if len(pos) != len(ids):
            raise TraceError(f"{len(pos)} positions for {len(ids)} tokens", position=where,
                             expected="one position per token")
        lens = [1] * len(ids) if mode == DECODE else rec["extend_seq_lens"]
        if sum(lens) != len(ids) or 0 in lens:
            raise TraceError(f"extend_seq_lens {short_repr(lens)} sum to {sum(lens)} for "
                             f"{len(ids)} tokens", position=where,
                             expected="one length >= 1 per request in the pass")
        used: set[int] = set()
        a = 0
        for n in lens:
            p0 = pos[a]
            if pos[a : a + n] != list(range(p0, p0 + n)):
                raise TraceError(f"positions {pos[a:a + n]} of one request are not consecutive",
                                 position=where, expected="positions p, p+1, ...")
            j = next((j for j, r in enumerate(reqs) if r.last == p0 - 1 and j not in used), None)
            if p0 == 0 or j is None:
                reqs.append(_Open(start=p0, last=p0 - 1))
                j = len(reqs) - 1
            r = reqs[j]
            decode = mode == DECODE or (mode == MIXED and n == 1 and p0 > 0 and r.rows != [])
            if decode and r.first_decode is None:
                r.first_decode = p0
            r.rows.append(tokens[a : a + n])
            r.ids += ids[a : a + n]
            r.last = p0 + n - 1
            used.add(j)
            a += n
    return [
        SequenceRouting(np.concatenate(r.rows), r.first_decode, r.start,
                token_ids=np.asarray(r.ids, dtype=np.int64), where=f"request {k}")
        for k, r in enumerate(reqs)
    ]


def _logical(topk: Any, mapping: np.ndarray, n: int, where: str) -> np.ndarray:
    """``topk_ids_of_layer`` [L, tokens, slots] physical ids -> [tokens, L, slots] logical."""
    arr = np.asarray(topk) if topk is not None else np.zeros(0)
    if arr.ndim != 3 or arr.shape[1] != n or not np.issubdtype(arr.dtype, np.integer):
        raise TraceError(f"topk_ids_of_layer has shape {arr.shape}", position=where,
                         expected=f"integer [layers, {n} tokens, slots]")
    if arr.shape[0] != mapping.shape[0]:
        raise TraceError(f"{arr.shape[0]} layers but the map has {mapping.shape[0]}",
                         position=where, expected="the map of the same model")
    bad = (arr < -1) | (arr >= mapping.shape[1])
    if bad.any():
        layer, t, slot = (int(x) for x in np.argwhere(bad)[0])
        raise TraceError(f"physical expert {int(arr[layer, t, slot])} is outside the map",
                         position=f"{where}, token {t}, layer {layer}",
                         expected=f"-1..{mapping.shape[1] - 1}")
    layer_of = np.arange(arr.shape[0])[:, None, None]
    logical = np.where(arr >= 0, mapping[layer_of, np.maximum(arr, 0)], -1)
    return logical.transpose(1, 0, 2).astype(np.int32)
