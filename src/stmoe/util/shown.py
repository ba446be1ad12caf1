"""A value from a file, as an error message shows it."""

from __future__ import annotations

from typing import Any


def short_repr(value: Any, limit: int = 40) -> str:
    """``value`` as Python writes it, cut to ``limit`` characters: quoted and escaped, so
    a newline or a control character in a file's value cannot break the one-line error
    that names it, nor pass for something else."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
