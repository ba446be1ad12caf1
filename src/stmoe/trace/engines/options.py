"""The options an engine's file cannot answer itself (``stmoe import``'s ``--prompt-lengths``,
``--layers``, ``--top-k``, ``--layout``, ``--moe-layers``), parsed as a user types them, and
the model layers a ``stmoe export`` file names in their place (``stmoe_moe_layers``),
checked against the routing it describes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.util.shown import short_repr

LAYOUTS = ("tlk", "ltk")


@dataclass(frozen=True)
class EngineOptions:
    """What a file may not say itself (``stmoe import`` options)."""

    prompt_lengths: tuple[int, ...] | None = None  # one per sequence, in file order
    layers: int | None = None  # SGLang's flat bytes: model layers per token
    top_k: int | None = None  # SGLang's flat bytes; transformers' router logits
    layout: str = "tlk"  # bare arrays: tokens first (tlk) or layers first (ltk)
    moe_layers: tuple[int, ...] | None = None  # model layers that route; others dropped

    @classmethod
    def parse(
        cls,
        prompt_lengths: str | Sequence[int] | None = None,
        layers: int | None = None,
        top_k: int | None = None,
        layout: str | None = None,
        moe_layers: str | Sequence[int] | None = None,
    ) -> EngineOptions:
        """Options as a user types them: "512,300,77" and "1-23,25"."""
        if layout is not None and layout not in LAYOUTS:
            raise TraceError(f"--layout {layout!r}", expected="tlk or ltk")
        for name, value in (("--layers", layers), ("--top-k", top_k)):
            if value is not None and not 0 < value <= 1 << 16:
                raise TraceError(f"{name} {value}", expected="a positive integer")
        return cls(
            prompt_lengths=None if prompt_lengths is None
            else int_list(prompt_lengths, "--prompt-lengths"),
            layers=layers,
            top_k=top_k,
            layout=layout or "tlk",
            moe_layers=None if moe_layers is None else layer_list(moe_layers),
        )

    def given(self) -> set[str]:
        """The option names a user set, as typed on the command line."""
        names = {"prompt_lengths": "--prompt-lengths", "layers": "--layers",
                 "top_k": "--top-k", "moe_layers": "--moe-layers"}
        out = {flag for key, flag in names.items() if getattr(self, key) is not None}
        return out | ({"--layout"} if self.layout != "tlk" else set())


def int_list(value: str | Sequence[int], what: str) -> tuple[int, ...]:
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    out = []
    for i, item in enumerate(items):
        try:
            n = int(item)
        except (TypeError, ValueError):
            raise TraceError(f"{what} item {i} is {item!r}", expected="integers") from None
        if not 0 <= n < 2**62:
            raise TraceError(f"{what} item {i} is {n}", expected="integers >= 0")
        out.append(n)
    if not out:
        raise TraceError(f"{what} is empty", expected="e.g. 512,300,77")
    return tuple(out)


def layer_list(value: str | Sequence[int]) -> tuple[int, ...]:
    """``"1-23"``, ``"0,2,4-7"`` or a list of ints: sorted, distinct layer numbers."""
    if not isinstance(value, str):
        return tuple(sorted(set(int_list(value, "--moe-layers"))))
    out: set[int] = set()
    for part in value.replace(" ", "").split(","):
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise TraceError(f"--moe-layers part {part!r}",
                             expected="layer numbers and ranges, e.g. 1-23 or 0,2,4-7"
                             ) from None
        if not 0 <= a <= b < 1 << 16:
            raise TraceError(f"--moe-layers part {part!r}", expected="ranges low-high, >= 0")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def written_moe_layers(opts: EngineOptions, written: Sequence[tuple[str, Any]],
                       requests: Sequence[Any]) -> EngineOptions:
    """``opts`` with the MoE layers a ``stmoe export`` file names (``stmoe_moe_layers``)
    when the user gave none: such a file says which layers route, no guess is needed.

    ``written`` holds (position, value) of every copy of the field (one per SGLang
    response): they must agree. The list, increasing and without repeats, must describe
    ``requests`` (``SequenceRouting``s, every model layer): an export writes the model's
    layers up to the last one named, and the others hold only the fill, never routing."""
    (where, value), *others = written
    for at, other in others:
        if other != value:
            raise TraceError(f"'stmoe_moe_layers' is {short_repr(other)} here but "
                             f"{short_repr(value)} in {where}", position=at,
                             expected="the same model layers in every response (one model "
                             "answered them all)")
    if value is None or opts.moe_layers is not None:
        return opts
    if not isinstance(value, list) or not value or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 16 for i in value):
        raise TraceError(f"'stmoe_moe_layers' is {short_repr(value)}", position=where,
                         expected="a list of model layer numbers")
    if any(b <= a for a, b in itertools.pairwise(value)):
        raise TraceError(f"'stmoe_moe_layers' is {short_repr(value)}", position=where,
                         expected="increasing model layer numbers, each once")
    for r in requests:
        n = r.experts.shape[1]
        if value[-1] + 1 != n:
            raise TraceError(f"'stmoe_moe_layers' names model layers up to {value[-1]} but "
                             f"the routing has {n}", position=r.where or where,
                             expected=f"{n} model layers, the last of them named (stmoe "
                             "export writes the layers up to the last MoE layer)")
        named = set(value)
        routed = next((layer for layer in range(n) if layer not in named
                       and np.any(r.experts[:, layer] != -1)
                       and np.any(r.experts[:, layer] != 0)), None)
        if routed is not None:
            raise TraceError(f"model layer {routed} routes but 'stmoe_moe_layers' does not "
                             "name it", position=r.where or where,
                             expected=f"only the fill value at the layers it leaves out "
                             f"({short_repr(value)} named)")
    return replace(opts, moe_layers=tuple(value))
