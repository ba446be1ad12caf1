"""Sizes, durations and cache capacities, parsed (and a capacity bounds-checked) in one place
(no torch).

Why one module: the runtime (``--capacity``, ``--memory``, ``--bandwidth``, ``--latency``),
the CLI's checks before torch loads, calibrate, eval and the simulator read the same texts;
two parsers of "50%", or two checks of its bounds, would drift apart. Each refuses with a
``UnitError`` (or the caller's error type) that says what it expected.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Literal, overload

from stmoe.errors import StmoeError

_BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10,
               "mib": 2**20, "gib": 2**30, "tib": 2**40}

CapacityForm = Literal["count", "share", "bytes"]
CAPACITY_FORMS: tuple[CapacityForm, ...] = ("count", "share", "bytes")


class UnitError(StmoeError, ValueError):
    """A size, duration or capacity that does not parse, or a capacity out of bounds."""


def parse_bytes(text: str) -> float:
    """'200MB' -> 2e8, '1.5GiB' -> 1.5 * 2**30, '1TB' -> 1e12, '5e7' -> 5e7 (bytes, or
    bytes per second): a finite amount above zero."""
    try:
        return _size(text)
    except UnitError as exc:
        raise UnitError(f"{text!r}: {exc}") from None


def format_bytes(nbytes: float) -> str:
    """Bytes for a message, in the binary unit that shows them ("0.0 GiB" says nothing)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} bytes"


def _size(text: str) -> float:
    """``parse_bytes`` refusing with the problem alone (the caller names the text)."""
    s = text.strip().lower().removesuffix("/s")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    try:
        value = float(num)
    except ValueError:
        raise UnitError("not a size (a number with an optional unit, such as 200MB, 1.5GiB "
                        "or 5e7)") from None
    if unit not in _BYTE_UNITS:
        raise UnitError(f"unknown unit {unit!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")
    if not (math.isfinite(value * _BYTE_UNITS[unit]) and value > 0):
        raise UnitError("not a finite size above zero (such as 200MB)")
    return value * _BYTE_UNITS[unit]


def parse_seconds(text: str) -> float:
    """'50us' -> 5e-5, '2ms' -> 0.002, '0.1' -> 0.1 (seconds): finite, not negative."""
    s = text.strip().lower()
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if s.endswith(unit):
            s, mult = s[: -len(unit)], scale
            break
    else:
        mult = 1.0
    try:
        seconds = float(s) * mult
    except ValueError:
        raise UnitError(f"{text!r} is not a duration; expected e.g. 50us, 2ms or 0.1") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise UnitError(f"{text!r}: expected a finite duration >= 0, e.g. 50us, 2ms or 0.1")
    return seconds


@overload
def capacity_per_layer(capacity: int | str, num_experts: int, top_k: int, *,
                       expert_bytes: int, num_layers: int = 1,
                       forms: Collection[CapacityForm] = CAPACITY_FORMS,
                       name: str = "capacity",
                       error: type[Exception] = UnitError) -> int: ...


@overload
def capacity_per_layer(capacity: int | str, num_experts: int, top_k: int, *,
                       expert_bytes: None = None, num_layers: int = 1,
                       forms: Collection[CapacityForm] = CAPACITY_FORMS,
                       name: str = "capacity",
                       error: type[Exception] = UnitError) -> int | None: ...


def capacity_per_layer(capacity: int | str, num_experts: int, top_k: int, *,
                       expert_bytes: int | None = None, num_layers: int = 1,
                       forms: Collection[CapacityForm] = CAPACITY_FORMS,
                       name: str = "capacity",
                       error: type[Exception] = UnitError) -> int | None:
    """A cache's experts per layer from ``capacity``, parsed and bounds-checked: the one
    place every caller (``stmoe.offload``, the CLI before torch loads, calibrate, eval, the
    simulator, the engine) reads a capacity, so each refuses the same values in the same
    words. It is a count (8 or "8"), a share of the ``num_experts`` ("50%", 0% to 100%)
    or a byte budget for ``num_layers`` layers of ``expert_bytes`` experts ("64MB"), of
    the ``forms`` the caller takes; what it gives must be ``top_k`` to ``num_experts`` (a
    byte budget above what all experts take gives all of them: a ceiling, not a request).

    A refusal is one ``error`` naming ``name``, the value given and what is allowed.
    ``expert_bytes`` None (the CLI, before the store is open): a byte budget's grammar is
    checked and None returned; its count is checked where its experts' size is known."""
    if top_k > num_experts:  # ("expected 20 to 16 experts per layer" said nothing)
        raise error(f"the model's router picks {top_k} experts per token of the {num_experts} "
                    "a layer has: its config's top-k (num_experts_per_tok or the like) or its "
                    "number of experts is wrong")
    text = "" if isinstance(capacity, bool) else str(capacity).strip()
    given = f"{name} {capacity!r}" if isinstance(capacity, str) else f"{name} {capacity}"
    allowed = _allowed(num_experts, top_k, forms)

    def refused(problem: str) -> Exception:
        return error(f"{given}: {problem}; {allowed}")

    if "count" in forms and (type(capacity) is int or text.isdigit()):
        count = int(text)
    elif "share" in forms and text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise refused("not a share") from None
        if not (math.isfinite(share) and 0 <= share <= 100):
            raise refused("a share is from 0% to 100%")
        count = round(share / 100 * num_experts)
    elif "bytes" in forms and any(c.isdigit() for c in text):
        if _is_number(text):  # 3.5 or 1e3: not a count, and a size without its unit
            raise refused("a count is a whole number of experts, and a size needs its unit "
                          "(such as 64MB)")
        try:
            budget = _size(text)
        except UnitError as exc:
            raise refused(str(exc)) from None
        if expert_bytes is None:
            return None
        count = int(min(budget // (expert_bytes * num_layers), num_experts))
    else:
        raise refused(_listed(["a count", "a share", "a size"], forms, "not "))
    if count > num_experts:
        raise refused(f"there are {num_experts} experts per layer, so at most {num_experts}")
    if count < top_k:
        raise error(f"{given} gives {count} experts per layer, below the router's "
                    f"top-{top_k} (one token's experts must fit); {allowed}")
    return count


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


LayerCapacity = int | str | Sequence[int]  # one capacity for every layer, or one per layer


def layer_capacities(capacity: LayerCapacity, num_experts: int, top_k: int, *,
                     num_layers: int | None, expert_bytes: int | None = None,
                     name: str = "capacity",
                     error: type[Exception] = UnitError) -> tuple[int, ...] | None:
    """Each layer's experts: ``capacity_per_layer``'s forms for every layer alike, or one
    count per layer ("48,60,12" or a sequence of ints: a split sized by
    ``stmoe.evaluate.layer_capacity``), each bounds-checked as a count, and as many as
    ``num_layers`` (None: not known yet, any number). None where a byte budget's count
    needs ``expert_bytes``, as ``capacity_per_layer``. One ``error`` naming the layer."""
    if isinstance(capacity, str) and "," in capacity:
        parts: list[int | str] = [p.strip() for p in capacity.split(",")]
    elif isinstance(capacity, Sequence) and not isinstance(capacity, str):
        parts = list(capacity)
    else:
        one = capacity_per_layer(capacity, num_experts, top_k, expert_bytes=expert_bytes,
                                 num_layers=num_layers or 1, name=name, error=error)
        return None if one is None or num_layers is None else (one,) * num_layers
    if num_layers is not None and len(parts) != num_layers:
        raise error(f"{name} {capacity!r}: {len(parts)} counts for {num_layers} MoE layers "
                    "(one per layer, or one capacity for all)")
    return tuple(capacity_per_layer(p, num_experts, top_k, forms=("count",),
                                    name=f"{name} of layer {i}", error=error)
                 for i, p in enumerate(parts))


def _allowed(num_experts: int, top_k: int, forms: Collection[CapacityForm]) -> str:
    """What a capacity of these forms may be, for a refusal's message."""
    return _listed([f"{top_k} to {num_experts} experts per layer",
                    "a share of the experts (50%, at most 100%)", "a size in bytes (64MB)"],
                   forms, "expected ")


def _listed(phrases: list[str], forms: Collection[CapacityForm], head: str) -> str:
    """``head`` and the phrases of ``forms`` (in ``CAPACITY_FORMS`` order), as a list."""
    kept = [p for f, p in zip(CAPACITY_FORMS, phrases, strict=True) if f in forms]
    return head + (f"{', '.join(kept[:-1])} or {kept[-1]}" if len(kept) > 1 else kept[0])


def parse_layer_range(layers: int | str, total: int) -> tuple[int, int]:
    """``N`` (the first N MoE layers) or ``"A:B"`` (layers A to B-1) of ``total``, as
    (start, stop); a range outside 0..total is refused naming both forms."""
    text = str(layers).strip()
    start_text, sep, stop_text = text.partition(":")
    try:
        start, stop = (int(start_text), int(stop_text)) if sep else (0, int(text))
    except ValueError:
        raise UnitError(f"--layers {text!r}: expected N (the first N MoE layers) or A:B "
                        "(layers A to B-1)") from None
    if not 0 <= start < stop <= total:
        raise UnitError(f"--layers {text}: there are {total} MoE layers (expected N in "
                        f"1..{total} or A:B with 0 <= A < B <= {total})")
    return start, stop
