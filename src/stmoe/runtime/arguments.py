"""``stmoe.offload``'s arguments checked for what they are, before anything reads them.

Why apart from ``OffloadOptions.check``: the CLI and the vLLM plugin hand the options over
typed already (typer, ``vllm_plugin.config``); a Python caller can hand anything, and a value
of the wrong kind was taken as something else (``admission="no"`` as True, ``capacity=3.5``
as 3.5 bytes) or failed later with a bare TypeError (the options given second, in the store's
place). numpy's integers and booleans are taken as Python's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import OffloadError
from stmoe.runtime.options import OffloadOptions, with_overrides


def checked_call(model: object, store: object, options: object,
                 overrides: dict[str, Any]) -> OffloadOptions:
    """``offload``'s arguments, each checked for what it is, and the options with the
    overrides (``with_overrides``)."""
    if not (isinstance(model, (str, Path)) or hasattr(model, "named_modules")):
        got = "an offloaded model" if hasattr(model, "engine") else type(model).__name__
        raise OffloadError(f"offload: expected a loaded model or a model folder, got {got}")
    if store is not None and not isinstance(store, (str, os.PathLike)):
        hint = "; give options by name" if isinstance(store, OffloadOptions) else ""
        raise OffloadError(f"offload: store is a folder, got {type(store).__name__}{hint}")
    checked = with_overrides(OffloadOptions() if options is None else options, overrides)
    check_kinds(checked)
    return checked


def check_kinds(options: OffloadOptions) -> None:
    """The counts whole numbers, the flags True or False, the capacity no float."""
    for name in ("workers", "max_loads"):
        value = getattr(options, name)
        if value is not None and (not isinstance(value, (int, np.integer))
                                  or isinstance(value, (bool, np.bool_)) or value < 0):
            raise OffloadError(f"{name} must be a whole number >= 0, got {value!r}")
    for name in ("admission", "in_place"):
        if not isinstance(getattr(options, name), (bool, np.bool_)):
            raise OffloadError(f"{name} must be True or False, got {getattr(options, name)!r}")
    if isinstance(options.capacity, float):
        raise OffloadError(f"capacity {options.capacity!r}: give a whole number of experts (8), "
                           "a share ('50%') or bytes ('64MB')")
