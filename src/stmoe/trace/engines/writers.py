"""A trace written back in vLLM's and SGLang's response layouts.

So tests can round-trip the readers, and users can feed tools built for those
engines. Each sequence becomes one request of prompt ``P`` (its prefill tokens)
and ``G = T - P + 1`` generated tokens, since engines route every token but the
last sampled one. Only the layout's fields are written: vLLM's choice carries
``prompt_token_ids`` (and the known generated ``token_ids``) when the trace has
token ids, else ``usage.prompt_tokens`` says the prompt length of a one-sequence
trace; SGLang's ``meta_info`` always says ``prompt_tokens`` and ``completion_tokens``
but not L and K, which an SGLang response needs said at import (``--layers L --top-k
K``) unless it is such an export. Both carry one field of stmoe's own,
``stmoe_moe_layers`` (the model layers that route), which the readers take in place of
guessing dense layers (and, for SGLang's, L) from their fill: a layer whose every token chose
expert 0, or none, is routing, not a dense layer. SGLang's also says
``stmoe_rank_order: false`` where the trace's rows are sets (a vLLM import always
reads so).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.checks import model_layer_ids
from stmoe.trace.ranks import is_ranked
from stmoe.trace.schema import RoutingTrace
from stmoe.util.fileio import atomic_write_text


def _requests(trace: RoutingTrace) -> list[dict[str, Any]]:
    """Per sequence: the routing over the model's layers (dense ones, known from
    ``model_layer_ids``, hold -1 as an engine's buffer does), prompt length, token ids."""
    layer_ids = model_layer_ids(trace)
    out = []
    for s, sl in trace.sequences():
        experts = np.full((sl.stop - sl.start, max(layer_ids) + 1, trace.top_k), -1, np.int32)
        experts[:, layer_ids] = np.asarray(trace.experts[sl])
        decode = np.asarray(trace.is_decode[sl])
        prompt = int(np.argmax(decode)) if decode.any() else len(decode)
        if decode[prompt:].size and not decode[prompt:].all():
            raise TraceError(f"sequence {s} has prefill tokens after decode ones",
                             expected="prompt tokens, then generated ones "
                             "(an engine's order)")
        ids = None if trace.token_ids is None else np.asarray(trace.token_ids[sl]).tolist()
        out.append({"experts": experts, "prompt": prompt, "ids": ids})
    return out


def _npy_b64(experts: np.ndarray) -> str:
    """vLLM's encoding: the ``.npy`` bytes of the smallest dtype that holds the ids."""
    lo, hi = int(experts.min()), int(experts.max())
    dtype = np.uint8 if lo >= 0 and hi < 256 else np.uint16 if lo >= 0 and hi < 65536 \
        else np.int32
    buf = io.BytesIO()
    np.save(buf, experts.astype(dtype))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def export_vllm(trace: RoutingTrace, path: str | Path) -> Path:
    """A ``/v1/completions`` response: one choice per sequence."""
    choices, prompt_total, gen_total = [], 0, 0
    for i, req in enumerate(_requests(trace)):
        gen = len(req["experts"]) - req["prompt"] + 1
        choice: dict[str, Any] = {"index": i, "text": "", "finish_reason": "length",
                                  "routed_experts": _npy_b64(req["experts"])}
        if req["ids"] is not None:
            choice["prompt_token_ids"] = req["ids"][: req["prompt"]]
            choice["token_ids"] = req["ids"][req["prompt"] :]  # all but the last sampled one
        choices.append(choice)
        prompt_total += req["prompt"]
        gen_total += gen
    doc = {"id": "cmpl-stmoe-export", "object": "text_completion", "model": trace.meta.model,
           "choices": choices, "stmoe_moe_layers": model_layer_ids(trace),
           "usage": {"prompt_tokens": prompt_total, "completion_tokens": gen_total,
                     "total_tokens": prompt_total + gen_total}}
    return _write(doc, path)


def export_sglang(trace: RoutingTrace, path: str | Path) -> Path:
    """A ``/generate`` response (one sequence) or a batch's list of them."""
    docs = []
    for i, req in enumerate(_requests(trace)):
        gen = len(req["experts"]) - req["prompt"] + 1
        raw = np.ascontiguousarray(req["experts"], dtype="<i4").tobytes()
        docs.append({"text": "", "meta_info": {
            "id": f"stmoe-export-{i}", "prompt_tokens": req["prompt"], "completion_tokens": gen,
            "finish_reason": {"type": "length", "length": gen},
            "routed_experts": base64.b64encode(raw).decode("ascii"),
            "routed_experts_dtype": "int32", "stmoe_moe_layers": model_layer_ids(trace),
            **({} if is_ranked(trace) else {"stmoe_rank_order": False})}})
    return _write(docs[0] if len(docs) == 1 else docs, path)


def _write(doc: Any, path: str | Path) -> Path:
    """The response as one JSON document, written atomically (a killed export leaves the
    old file whole)."""
    return atomic_write_text(path, json.dumps(doc) + "\n")
