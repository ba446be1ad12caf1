"""vLLM's routing: the OpenAI server's completions response (published routing profiles
are read in ``vllm_profile``).

With ``enable_return_routed_experts`` vLLM returns, per request, an int array
``[prompt + generated - 1, num_hidden_layers, top_k]`` (rows are token positions;
the last sampled token never ran through the model). Offline,
``CompletionOutput.routed_experts`` is that array (``np.save`` it and it is a bare
``.npy``, read by ``arrays.read_npy``); the OpenAI server puts it in
``choices[].routed_experts`` as base64 of ``.npy`` bytes. Dense layers hold the
buffer's fill (0, or -1 in newer versions); ``common`` drops them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.engines.common import (
    EngineOptions,
    SequenceRouting,
    assemble,
    checked_ids,
    note,
    note_missing_prompts,
)
from stmoe.trace.engines.jsonio import b64_bytes, id_list, load_json, opt_int
from stmoe.trace.engines.options import written_moe_layers
from stmoe.trace.npfiles import load_npy_bytes, short
from stmoe.trace.schema import RoutingTrace


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
    opts = written_moe_layers(opts, [("response", doc.get("stmoe_moe_layers"))], requests)
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
