"""One forward call per decode step: the step's requests' tokens through the model together.

Why: with the step's quantized linears gathered (``step_rows``) and every expert cached, a
step of 4 requests still took 3.2x one request's step (docs/serve.md): each request ran its
own forward, its norms, routers, attention and transformers' per-layer Python one request
at a time under the GIL. Here a decode step is ONE forward of the model over a batch of
the requests' tokens, run by the batcher's thread, and each request keeps its solo bits:

- the quantized linears (attention projections, shared experts, lm_head) take all rows in
  one kernel call: torch's int8/int4 weight-only kernels give each row its one-row bits
  (``step_rows``; wide products split by columns over the compute threads);
- what is not row for row the same at any batch size is computed row by row, each row as
  its solo run computes it: a native (bf16) linear and every router or gate (their blocking
  depends on the row count), the attention itself (each request's own KV cache and length:
  ``cache.update`` and sdpa on that row alone, as a solo decode step calls them; where the
  cache holds something else than the attention's keys, DeepSeek's compressed latents, the
  whole attention module row by row), and the routed experts (the engine's ``serve_layer``:
  the union of the requests' experts loaded once, a part per request);
- norms, activations, rotary embeddings and residual sums are row-wise, so batched.

Each request's thread still runs transformers' ``generate`` (its logits processors,
stopping, streaming); its decode forward calls wait here and get their row's output and
their own cache back. A prompt is a step alone, on the request's thread, as before.

Where it does not hold it is not used (``why_not``): bf16 lm_head (then nothing is shared
but I/O), an attention other than sdpa, sliding-window or linear-attention layers (their
masks and caches are not one row's), a late gate lookahead. The step batcher then keeps
its per-request forwards. ``tests/serve/test_step_forward.py`` checks every family's
logits bit for bit against its solo run on the resident model in the same format.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.quant.linears import QuantizedLinear, is_gate
from stmoe.runtime.batcher.step_rows import split_rows

# the batcher's thread, during a batched forward: the step's requests' KV caches, in row order
# (``caches``), and whether sdpa appends each row's keys to them (``in_sdpa``; else the
# attention modules run row by row)
_STEP = threading.local()
_SDPA: list[Callable[..., Any]] = []  # transformers' sdpa, once the row-wise one stands in


def step_caches() -> list[Any] | None:
    """The batched forward's per-row KV caches on this thread (None: not in one)."""
    return getattr(_STEP, "caches", None)


def why_not(model: torch.nn.Module) -> str | None:
    """Why ``model``'s decode steps cannot be one batched forward (None: they can)."""
    config = model.config
    if not isinstance(model.get_output_embeddings(), QuantizedLinear):
        return "its lm_head is not quantized (bf16 products are not row for row the same)"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"its attention is {config._attn_implementation!r}, not sdpa"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        return f"its layers are {sorted(kinds)} (only full attention is computed row by row)"
    return None


def _rows_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa, or in a batched forward each row on its own cache: the row's
    new key and value appended as its solo step does, then sdpa over that row alone, with
    no mask (a solo decode step of full attention has none: one query, no padding)."""
    caches = step_caches()
    if caches is None or not _STEP.in_sdpa:
        return _SDPA[0](module, query, key, value, attention_mask, **kwargs)
    position_ids = kwargs.pop("position_ids", None)
    outs = []
    for b, cache in enumerate(caches):
        k, v = cache.update(key[b:b + 1], value[b:b + 1], module.layer_idx)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids[b:b + 1]
        outs.append(_SDPA[0](module, query[b:b + 1], k, v, None, **kwargs)[0])
    return torch.cat(outs), None


def _install_rows_sdpa() -> None:
    """Put ``_rows_sdpa`` in transformers' place for "sdpa" (once per process: outside a
    batched forward it is transformers' own)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if not _SDPA:
        _SDPA.append(ALL_ATTENTION_FUNCTIONS["sdpa"])
        AttentionInterface.register("sdpa", _rows_sdpa)


def _cat(outs: list[Any]) -> Any:
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    if isinstance(outs[0], tuple):
        return tuple(_cat([o[i] for o in outs]) if isinstance(outs[0][i], torch.Tensor)
                     else outs[0][i] for i in range(len(outs[0])))
    raise OffloadError(f"a row-by-row module returned {type(outs[0]).__name__}")


def _row(value: Any, b: int, n: int) -> Any:
    """Row ``b`` of a batch-first tensor of ``n`` rows (or of a tuple of them), else as is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
        return value[b:b + 1]
    if isinstance(value, tuple):
        return tuple(_row(v, b, n) for v in value)
    return value


def cache_keyword(forward: Callable[..., Any]) -> str:
    """The name an attention forward takes its KV cache by: ``cache`` in newer transformers
    5 releases, ``past_key_values`` before (5.17, the GPU machines'). Why it is asked:
    either forward swallows the other name in ``**kwargs`` and attends without the cache,
    a wrong result with no error."""
    params = inspect.signature(forward).parameters
    for key in ("cache", "past_key_values"):
        if key in params:
            return key
    raise OffloadError(f"an attention forward {getattr(forward, '__qualname__', forward)} "
                       "takes no KV cache by a name stmoe knows (cache, past_key_values)")


def _attention_row_by_row(forward: Callable[..., Any]) -> Callable[..., Any]:
    """An attention module for each row alone on its own cache in a batched forward (its
    solo call: the row's position embeddings, no mask), else as is."""
    key = cache_keyword(forward)

    def call(*args: Any, **kwargs: Any) -> Any:
        caches = step_caches()
        if caches is None:
            return forward(*args, **kwargs)
        hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        rest, n = args[1:] if args and hidden is args[0] else args, len(caches)
        outs = []
        for b, cache in enumerate(caches):
            kw = {k: _row(v, b, n) for k, v in kwargs.items()}
            kw.update({key: cache, "attention_mask": None})
            outs.append(forward(hidden[b:b + 1], *rest, **kw))
        return _cat(outs)

    return call


def _row_by_row(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` for each row alone in a batched forward (its solo shape), else as is."""
    def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        caches = step_caches()
        if caches is None or x.shape[0] != len(caches) or len(caches) == 1:
            return forward(x, *args, **kwargs)
        return _cat([forward(x[b:b + 1], *args, **kwargs) for b in range(len(caches))])

    return call


class StepForward:
    """A model's decode steps as one batched forward (the module docstring)."""

    def __init__(self, model: torch.nn.Module, pool: Executor | None, workers: int) -> None:
        self.model, self.pool, self.workers = model, pool, workers
        self.why_not = why_not(model)
        # the cache holds what the attention's keys are made from (MLA), not the keys
        self.in_sdpa = not hasattr(model.config, "kv_lora_rank")
        self.forward = model.forward  # the class's, bound (called without the model's hooks)
        self.steps = 0  # batched forwards run (for tests and /metrics)
        self._patched: list[torch.nn.Module] = []

    def install(self, member_forward: Callable[..., Any]) -> None:
        """Route the request threads' forward calls to ``member_forward``, and make the
        row-by-row modules and the row-wise sdpa ready."""
        _install_rows_sdpa()
        self.model.forward = member_forward  # type: ignore[method-assign]
        covered: list[str] = []
        for name, m in self.model.named_modules():
            if any(name.startswith(c + ".") for c in covered):
                continue  # inside a module already taken row by row
            native_linear = isinstance(m, torch.nn.Linear) and not isinstance(m, QuantizedLinear)
            attention = not self.in_sdpa and name.rsplit(".", 1)[-1] == "self_attn"
            if name and (is_gate(name) or native_linear or attention):
                m.forward = (_attention_row_by_row if attention else  # type: ignore[method-assign]
                             _row_by_row)(m.forward)
                self._patched.append(m)
                covered.append(name)
            elif isinstance(m, QuantizedLinear):
                m.gather = self._linear
                self._patched.append(m)

    def remove(self) -> None:
        self.model.__dict__.pop("forward", None)
        for m in self._patched:
            if isinstance(m, QuantizedLinear):
                m.gather = None
            else:
                m.__dict__.pop("forward", None)
        self._patched = []

    def _linear(self, module: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        """A quantized linear: in a batched forward all rows at once, a wide one split by
        output columns over the compute threads (each column's bits the same)."""
        if step_caches() is None:
            return module.rows(x)
        return split_rows(module, [x], self.pool, self.workers)[0]

    def run(self, calls: list[dict[str, Any]]) -> list[Any]:
        """One forward over the requests' decode calls (generate's keyword arguments: a
        [1, 1] ``input_ids``, their own ``cache``); each call's output, its row's logits
        and its own cache, as its solo forward would return them."""
        caches = [c["cache"] for c in calls]
        ids = torch.cat([c["input_ids"] for c in calls])
        positions = torch.tensor([[cache.get_seq_length()] for cache in caches])
        _STEP.caches, _STEP.in_sdpa = caches, self.in_sdpa
        try:
            with torch.no_grad():
                out = self.forward(input_ids=ids, position_ids=positions, use_cache=False,
                                   return_dict=True)
        finally:
            _STEP.caches = None
        self.steps += 1
        names = {f.name for f in dataclasses.fields(out)}
        key = "cache" if "cache" in names else "past_key_values"
        return [type(out)(logits=out.logits[b:b + 1], **{key: cache})
                for b, cache in enumerate(caches)]


def decode_call(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A request's decode forward call as ``StepForward.run`` takes it, checked."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if ids is None or tuple(ids.shape) != (1, 1) or cache is None:
        raise OffloadError("a request's decode step must be one token with its KV cache "
                           f"(got input_ids {None if ids is None else tuple(ids.shape)})")
    extra = set(kwargs) - {"input_ids", "cache", "past_key_values", "attention_mask",
                           "use_cache", "return_dict", "logits_to_keep", "position_ids"}
    if extra:
        raise OffloadError(f"a batched decode step does not take {sorted(extra)}")
    return {"input_ids": ids, "cache": cache}
