"""The checks of ``schema.validate`` beyond the arrays' shapes: gate weights, gate
lookahead, the model's layer numbers and the labels a report prints.

Apart from ``schema`` so that module stays one sitting long; each check takes the
trace and ``fail(problem, position, expected)``, which raises the ``TraceError``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

EMPTY_SLOT = -1
# Validation walks big traces in chunks of this many tokens so a memory-mapped
# trace of tens of millions of token-layers is checked without loading it whole.
CHUNK_TOKENS = 1 << 16
WEIGHT_MAX = float(np.finfo(np.float32).max)  # weights are stored as float32
# A model layer number at or above this is damage: no model has 4096 layers, and an
# export rebuilds every model layer up to the largest (``engines.writers``).
LAYER_ID_MAX = 4096

Fail = Callable[..., None]


def chunks(n: int) -> Iterator[slice]:
    for a in range(0, n, CHUNK_TOKENS):
        yield slice(a, min(a + CHUNK_TOKENS, n))


def first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def check_weights(trace: Any, fail: Fail) -> None:
    """Gate weights: the experts' shape, floating point, finite and within float32."""
    w = trace.weights
    if w.shape != trace.experts.shape:
        fail(f"weights has shape {w.shape}", expected=f"the experts shape {trace.experts.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        fail(f"weights has dtype {w.dtype}", expected="floating-point gate weights")
    for sl in chunks(trace.num_tokens):
        # Checked as written: a float64 1e300 is finite here but inf once stored as float32.
        block = np.asarray(w[sl])
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(block) | (np.abs(block) > WEIGHT_MAX)
        if bad.any():
            tok, layer, slot = first(bad)
            fail(
                f"gate weight is {float(block[tok, layer, slot])}",
                position=f"token {tok + sl.start}, layer {layer}, slot {slot}",
                expected=f"a finite number (|w| <= {WEIGHT_MAX:.3g}: weights are stored "
                "as float32)",
            )


def check_lookahead(trace: Any, name: str, fail: Fail) -> None:
    """Gate lookahead ``[T, L, J]``: J >= 1 ranked ids in -1..N-1, none twice in a row."""
    look = np.asarray(getattr(trace, name))
    if (
        look.ndim != 3
        or look.shape[:2] != trace.experts.shape[:2]
        or look.shape[2] == 0
        or not np.issubdtype(look.dtype, np.integer)
    ):
        fail(f"{name} has shape {look.shape}, dtype {look.dtype}",
             expected=f"integer [T, L, J] with T, L = {trace.experts.shape[:2]} and J >= 1")
    bad = (look < EMPTY_SLOT) | (look >= trace.num_experts)
    if bad.any():
        tok, layer, slot = first(bad)
        fail(f"a {name} expert id is out of range: {int(look[tok, layer, slot])}",
             position=f"token {tok}, layer {layer}, slot {slot}",
             expected=f"-1..{trace.num_experts - 1}")
    ordered = np.sort(look, axis=2)
    dup = (ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, 1:] != EMPTY_SLOT)
    if dup.any():
        tok, layer, slot = first(dup)
        fail(f"{name} names expert {int(ordered[tok, layer, slot])} twice",
             position=f"token {tok}, layer {layer}",
             expected="J distinct ranked experts (or -1)")


def check_layer_ids(trace: Any, fail: Fail) -> None:
    """``meta.extra.model_layer_ids``: the model's number of each MoE layer, L of them,
    increasing, in 0..LAYER_ID_MAX-1 (an export puts layer l's routing there)."""
    ids = trace.meta.extra.get("model_layer_ids")
    if ids is None:
        return
    ints = isinstance(ids, list | tuple) and all(
        isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids)
    ok = ints and len(ids) == trace.num_layers and all(0 <= i < LAYER_ID_MAX for i in ids) \
        and all(a < b for a, b in itertools.pairwise(ids))
    if not ok:
        text = repr(ids)
        fail(f"meta.extra.model_layer_ids is {text if len(text) <= 60 else text[:57] + '...'}",
             expected=f"{trace.num_layers} increasing model layer numbers in "
             f"0..{LAYER_ID_MAX - 1}, one per MoE layer")


def model_layer_ids(trace: Any) -> list[int]:
    """The model's number of each MoE layer: ``meta.extra.model_layer_ids`` (validated:
    increasing, one per layer), or ``0..L-1`` when the trace names none."""
    return [int(i) for i in trace.meta.extra.get("model_layer_ids") or range(trace.num_layers)]


def check_labels(trace: Any, fail: Fail) -> None:
    """Domain labels and the model name are text a terminal, JSON and a figure can show:
    a lone surrogate ("\\ud800", which JSON can spell) encodes in none of them."""
    for what, text in [("the model name", trace.meta.model),
                       *((f"the domain label of sequence {s}", d)
                         for s, d in enumerate(trace.domains))]:
        try:
            str(text).encode("utf-8")
        except UnicodeEncodeError as exc:
            fail(f"{what} holds {exc.object[exc.start:exc.end]!r}, a lone surrogate",
                 expected="text of Unicode characters (valid UTF-8)")
