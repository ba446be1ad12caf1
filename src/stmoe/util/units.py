"""Sizes, durations and the capacity grammar, parsed in one place (no torch).

Why one module: the runtime (``--capacity``, ``--bandwidth``, ``--latency``), calibrate
and the simulator's runtime pipeline read the same texts; two parsers of "50%" would
drift apart. Each parser refuses with a ``UnitError`` that says what it expected; the
caller prefixes the option's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from stmoe.errors import StmoeError

_BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20,
               "gib": 2**30}
CAPACITY_GRAMMAR = ("expected experts per layer (8), a share of the experts (50%) or a size "
                    "in bytes (64MB)")


class UnitError(StmoeError, ValueError):
    """A size, duration or capacity text that does not parse."""


def parse_bytes(text: str) -> float:
    """'200MB' -> 2e8, '1.5GiB' -> 1.5 * 2**30, '5e7' -> 5e7 (bytes, or bytes per second):
    a finite amount above zero."""
    s = text.strip().lower().removesuffix("/s")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    try:
        value = float(num)
    except ValueError:
        raise UnitError(f"{text!r} is not a size; expected a number with an optional unit "
                        "such as 200MB, 1.5GiB or 5e7") from None
    if unit not in _BYTE_UNITS:
        raise UnitError(f"{text!r}: unknown unit {unit!r}; use B, KB, MB, GB, KiB, MiB or GiB")
    if not (math.isfinite(value * _BYTE_UNITS[unit]) and value > 0):
        raise UnitError(f"{text!r}: expected a finite size above zero, such as 200MB")
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


@dataclass(frozen=True)
class Capacity:
    """A parsed cache size: ``count`` experts per layer, a ``share`` of them (0..100, in
    percent), or a ``bytes`` budget for the whole model."""

    kind: Literal["count", "share", "bytes"]
    value: float

    def per_layer(self, num_experts: int, num_layers: int = 1, expert_bytes: int = 1) -> int:
        """Experts per layer for a model of these sizes (a byte budget above what all
        experts take caches them all: a budget is a ceiling, not a request)."""
        if self.kind == "count":
            return int(self.value)
        if self.kind == "share":
            return round(self.value / 100 * num_experts)
        return int(min(self.value // (expert_bytes * num_layers), num_experts))


def parse_capacity(capacity: int | str, *, allow_bytes: bool = True) -> Capacity:
    """``8``, ``"8"``, ``"50%"`` (0% to 100%) or, where ``allow_bytes``, ``"64MB"``.

    The count's upper bound (the model's N) is the caller's to check: it is not known
    here."""
    text = str(capacity).strip()
    if isinstance(capacity, bool):
        raise UnitError(f"capacity {capacity!r}: {CAPACITY_GRAMMAR}")
    if isinstance(capacity, int) or text.isdigit():
        return Capacity("count", int(text))
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise UnitError(f"capacity {capacity!r}: {CAPACITY_GRAMMAR}") from None
        if not (math.isfinite(share) and 0 <= share <= 100):
            raise UnitError(f"capacity {capacity!r}: expected a share from 0% to 100%")
        return Capacity("share", share)
    if not allow_bytes:
        raise UnitError(f"capacity {capacity!r}: {CAPACITY_GRAMMAR}")
    try:
        return Capacity("bytes", parse_bytes(text))
    except UnitError as exc:
        raise UnitError(f"capacity {text!r}: {CAPACITY_GRAMMAR} ({exc})") from None


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
