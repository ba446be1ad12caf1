"""Greedy generation with routing capture: what ``stmoe capture`` runs.

Prompts go through ``model.generate`` in left-padded batches while a
``RoutingRecorder`` listens. Every generated token's routing is recorded, the
last one included: after ``generate`` one more decode step runs the final tokens
through the model (on the returned KV cache), so a sequence's decode count is
exactly the number of tokens it generated; a sequence that emits EOS stops there.
"""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stmoe.errors import TraceError
from stmoe.hf.capture import CaptureError, RoutingRecorder
from stmoe.hf.loading import load_causal_lm, load_model
from stmoe.trace.schema import UNLABELLED, RoutingTrace
from stmoe.trace.select import concat
from stmoe.util.progress import progress


@dataclass(frozen=True)
class Prompt:
    text: str
    domain: str = UNLABELLED


def read_prompts(path: str | Path) -> list[Prompt]:
    """Plain text (one prompt per non-blank line) or JSON Lines ``{"prompt", "domain"?}``."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TraceError("no such prompts file", file=path) from None
    except (UnicodeDecodeError, IsADirectoryError) as exc:
        raise TraceError(f"cannot read prompts ({exc})", file=path, expected="UTF-8 text") from None
    first = next((ln for ln in lines if ln.strip()), "")
    is_jsonl = first.lstrip().startswith("{")
    prompts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not is_jsonl:
            prompts.append(Prompt(line))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"not valid JSON ({exc.msg})", file=path, position=f"line {lineno}",
                             expected='{"prompt": "...", "domain": "..."}') from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise TraceError("no non-empty string 'prompt'", file=path, position=f"line {lineno}",
                             expected='{"prompt": "...", "domain": "..."}')
        prompts.append(Prompt(obj["prompt"], str(obj.get("domain", UNLABELLED))))
    if not prompts:
        raise TraceError("the prompts file has no prompt", file=path, expected="at least one line")
    return prompts


def capture_generation(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 1,
    domains: Sequence[str] | None = None,
    pad_token_id: int | None = None,
    eos_token_ids: Sequence[int] = (),
    model_name: str | None = None,
) -> RoutingTrace:
    """Generate greedily from token-id ``prompts`` and return their routing, one
    sequence per prompt (prompt tokens prefill, generated tokens decode)."""
    if max_new_tokens < 1 or batch_size < 1:
        raise CaptureError("max_new_tokens and batch_size must be at least 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise CaptureError("every prompt needs at least one token")
    domains = list(domains) if domains is not None else [UNLABELLED] * len(prompts)
    pad = pad_token_id if pad_token_id is not None else (eos_token_ids[0] if eos_token_ids else 0)
    parts = []
    batches = range(0, len(prompts), batch_size)
    for start in progress(batches, len(batches), "capturing"):
        chunk = [list(map(int, p)) for p in prompts[start : start + batch_size]]
        parts.append(_capture_batch(model, chunk, max_new_tokens, pad, set(eos_token_ids),
                                    domains[start : start + batch_size], model_name))
    return concat(parts)


def _capture_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    pad: int,
    eos: set[int],
    domains: Sequence[str],
    model_name: str | None,
) -> RoutingTrace:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad(), warnings.catch_warnings(), RoutingRecorder(model) as rec:
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notices
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=pad, eos_token_id=sorted(eos) or None, return_dict_in_generate=True,
            use_cache=True, cache_implementation="dynamic",
        )
        generated = out.sequences[:, width:]
        full_mask = torch.cat([mask, torch.ones_like(generated)], dim=1)
        # One more decode step, so the last generated tokens are routed too.
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
        model(input_ids=generated[:, -1:], attention_mask=full_mask, position_ids=positions,
              use_cache=True, **_cache_kwarg(model, out))
    lengths = [_generated_length(row.tolist(), eos) for row in generated]
    return rec.trace(
        decode_lengths=[lengths],
        domains=domains,
        token_ids=[
            np.asarray(p + row[:n].tolist())
            for p, row, n in zip(prompts, generated, lengths, strict=True)
        ],
        model_name=model_name,
    )


def _cache_kwarg(model: torch.nn.Module, out: Any) -> dict[str, Any]:
    """The KV cache ``generate`` returned, under the name this transformers uses."""
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise CaptureError("generate returned no KV cache; cannot route the last tokens")
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def _generated_length(row: list[int], eos: set[int]) -> int:
    """Tokens a row really generated: up to and including its first EOS."""
    for i, token in enumerate(row):
        if token in eos:
            return i + 1
    return len(row)


# A few built-in prompts per domain, used when no prompts file is given.
DEFAULT_PROMPTS = (
    Prompt('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "code"),
    Prompt("import os\n\nfor name in sorted(os.listdir('.')):\n", "code"),
    Prompt("The old lighthouse keeper climbed the stairs one last time, and", "prose"),
    Prompt("It was the best of times, it was the worst of times,", "prose"),
    Prompt("Problem: If 3x + 7 = 22, what is x?\nSolution:", "math"),
    Prompt("Problem: A rectangle has perimeter 30 and width 5. Find its area.\nSolution:", "math"),
)


def capture_prompts(
    model_dir: str | Path,
    prompts: Sequence[Prompt] = DEFAULT_PROMPTS,
    *,
    max_new_tokens: int = 32,
    batch_size: int = 1,
) -> RoutingTrace:
    """Load a local checkpoint, generate greedily from text prompts, return the trace."""
    model, tokenizer = load_model(model_dir)
    name = Path(model_dir).resolve().name
    return capture_text(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                        batch_size=batch_size, model_name=name)


def capture_text(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 1,
    model_name: str | None = None,
) -> RoutingTrace:
    """Generate greedily from text prompts with a loaded model and tokenizer."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0]
    ids = [tokenizer(p.text)["input_ids"] for p in prompts]
    vocab = model.get_input_embeddings().num_embeddings
    for i, p in enumerate(ids):
        if not p:
            raise CaptureError(f"prompt {i} tokenizes to nothing")
        if max(p) >= vocab:
            raise CaptureError(f"prompt {i} has token id {max(p)} but the model's vocabulary has "
                               f"{vocab}: the tokenizer does not belong to this model")
    return capture_generation(
        model, ids, max_new_tokens=max_new_tokens, batch_size=batch_size,
        domains=[p.domain for p in prompts], pad_token_id=pad, eos_token_ids=eos_ids,
        model_name=model_name,
    )


__all__ = ["DEFAULT_PROMPTS", "Prompt", "capture_generation", "capture_prompts", "capture_text",
           "load_causal_lm", "load_model", "read_prompts"]  # the loaders: 0.1's path
