"""``torch.save`` files: SGLang's recorder dumps and transformers' router logits.

This is the one place stmoe imports torch, and only when such a file is read
(``import stmoe`` stays torch-free). The file is loaded with ``weights_only=True``
(no code in it runs), tensors become numpy arrays, and the content says what it is:

- a dict with ``records`` and ``last_physical_to_logical_map``: SGLang's per-token
  recorder (``sglang.read_recorder``);
- a dict with ``logical_count``: SGLang's ``stat`` recorder, counts only (refused);
- a tuple/list of 2-D float tensors, or a dict with ``router_logits``: transformers'
  ``output_router_logits=True`` (one ``[batch * seq, E]`` tensor per MoE layer,
  batch-major, padding rows included, no dense layers); the top-k of the router's
  softmax gives ids and weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.assemble import agreed_num_experts
from stmoe.trace.engines import sglang
from stmoe.trace.engines.common import EngineOptions, SequenceRouting, assemble, refuse_counts
from stmoe.trace.schema import RoutingTrace


def load(path: Path) -> Any:
    """The file's objects, tensors as numpy arrays."""
    try:
        import torch
    except ImportError:
        raise TraceError("reading a torch.save file needs torch",
                         hint="pip install 'stmoe[hf]' (or torch)") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a bad archive
        raise TraceError(f"not a readable torch.save file ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})",
                         expected="a torch.save file of tensors, lists and dicts",
                         hint="the file may be truncated") from None
    return _plain(obj, torch)


def _plain(obj: Any, torch: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return (t.float() if t.is_floating_point() and t.dtype != torch.float64 else t).numpy()
    if isinstance(obj, dict):
        return {k: _plain(v, torch) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v, torch) for v in obj)
    return obj


def kind_of(obj: Any) -> str:
    if isinstance(obj, dict) and "records" in obj:
        return "sglang-recorder"
    if isinstance(obj, dict) and "logical_count" in obj:
        return "sglang-stat"
    if isinstance(obj, dict) and "router_logits" in obj:
        return "router-logits"
    if (
        isinstance(obj, list | tuple)
        and obj
        and all(
            isinstance(x, np.ndarray) and x.ndim in (2, 3) and np.issubdtype(x.dtype, np.floating)
            for x in obj
        )
    ):
        return "router-logits"
    return "unknown"


def read_many(paths: Sequence[Path], opts: EngineOptions, num_experts: int | None
              ) -> RoutingTrace | None:
    """All of ``paths`` as one trace when every one is an SGLang recorder dump (the ranks
    of one run), else None (each file is imported on its own)."""
    dumps = []
    for p in paths:
        try:
            obj = load(p)
        except TraceError as exc:
            raise exc.in_file(p) from None
        if kind_of(obj) != "sglang-recorder":
            return None
        dumps.append((p, obj))
    return sglang.read_recorder(dumps, opts, num_experts)


def read(path: Path, opts: EngineOptions, num_experts: int | None) -> RoutingTrace:
    obj = load(path)
    kind = kind_of(obj)
    if kind == "sglang-recorder":
        return sglang.read_recorder([(path, obj)], opts, num_experts)
    if kind == "sglang-stat":
        raise refuse_counts("SGLang's expert-distribution recorder in stat mode")
    if kind == "router-logits":
        logits = obj["router_logits"] if isinstance(obj, dict) else obj
        return _router_logits(list(logits), path, opts, num_experts)
    raise TraceError(f"a torch.save file holding {type(obj).__name__}",
                     expected="an SGLang recorder dump or transformers' router logits")


def _router_logits(logits: list, path: Path, opts: EngineOptions,
                   num_experts: int | None) -> RoutingTrace:
    """One ``[batch * seq, E]`` (or ``[batch, seq, E]``) array per MoE layer -> top-k
    routing per token."""
    dims = {x.ndim if isinstance(x, np.ndarray) else 0 for x in logits}
    if len(dims) != 1 or not dims <= {2, 3}:
        raise TraceError("router_logits is not a list of 2-D or 3-D tensors",
                         expected="one [batch * seq, E] tensor per MoE layer")
    shapes = {x.shape for x in logits}
    if len(shapes) != 1:
        raise TraceError(f"the layers' router logits have shapes {sorted(shapes)}",
                         expected="one [batch * seq, E] shape for every layer")
    if dims == {3}:  # [batch, seq, E]: batch-major rows, one sequence per batch row
        batch, seq, _ = logits[0].shape
        logits = [x.reshape(batch * seq, -1) for x in logits]
        if not opts.prompt_lengths:
            opts = dataclasses.replace(opts, prompt_lengths=(seq,) * batch)
        elif len(opts.prompt_lengths) != batch:
            raise TraceError(f"{len(opts.prompt_lengths)} --prompt-lengths for router logits "
                             f"of {batch} sequences ([batch, seq, E] = {tuple(shapes.pop())})",
                             expected="one true length per sequence of the batch")
    rows, n_exp = logits[0].shape
    k = opts.top_k
    if k is None or k > n_exp:
        raise TraceError("the router's top-k is not in the file" if k is None
                         else f"--top-k {k} exceeds the {n_exp} experts",
                         expected="--top-k K (the model config's num_experts_per_tok)")
    # Batch-major rows: sequence b is rows [b * seq, (b + 1) * seq); with --prompt-lengths
    # each keeps its first P rows (the tokenizer pads on the right by default).
    lengths = opts.prompt_lengths or (rows,)
    seq = rows // len(lengths)
    if seq * len(lengths) != rows or max(lengths) > seq:
        raise TraceError(f"{rows} rows do not split into {len(lengths)} sequences of at most "
                         f"{seq} tokens", expected="--prompt-lengths with one true length per "
                         "sequence of the batch")
    kept = np.concatenate([np.arange(b * seq, b * seq + p) for b, p in enumerate(lengths)])
    _check_finite(logits, kept)  # (padding rows are dropped: whatever they hold)
    stacked = np.stack(logits, axis=1).astype(np.float64)  # [rows, L, E]
    with np.errstate(invalid="ignore", over="ignore"):  # (a padding row's: never kept)
        probs = np.exp(stacked - stacked.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    weights = np.take_along_axis(probs, top, axis=-1).astype(np.float32)
    requests = [
        SequenceRouting(top[b * seq : b * seq + p].astype(np.int32), None,
                weights=weights[b * seq : b * seq + p], where=f"sequence {b}")
        for b, p in enumerate(lengths)
    ]
    no_prompt = EngineOptions(moe_layers=opts.moe_layers)  # the lengths cut padding here
    meta = {"source": f"imported from {path.name} (transformers router logits)",
            "file": str(path)}
    return assemble(requests, no_prompt, agreed_num_experts(num_experts, n_exp), meta)


def _check_finite(logits: list[np.ndarray], kept: np.ndarray) -> None:
    """Refuse a kept row whose softmax has no meaning: a NaN or +inf logit, or every logit
    -inf (some -inf are masked experts, fine)."""
    for layer, x in enumerate(logits):
        wrong = np.isnan(x) | np.isposinf(x)
        bad = np.zeros(len(x), dtype=bool)
        bad[kept] = (wrong.any(-1) | np.isneginf(x).all(-1))[kept]
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            shown = f"{x[row][wrong[row]][0]} among them" if wrong[row].any() else "all -inf"
            raise TraceError(f"router logits of MoE layer {layer}, row {row} are {shown}",
                             expected="finite logits (-inf for masked experts, not all)")
