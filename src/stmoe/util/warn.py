"""``warn``: a warning attributed to the first caller outside stmoe.

Why: a fixed ``stacklevel`` names the right line for one call path only; the store's
warnings are reached through several (``offload``, ``stmoe generate``, the vLLM plugin,
the GPU check), and a warning that names a line inside stmoe tells its reader nothing.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from pathlib import Path

# frames passed over: stmoe's own, and the standard library's between them (contextlib's
# ``__enter__`` of a context manager stmoe wrote, say)
_PASSED = tuple(str(Path(p).resolve()) + os.sep for p in
                (Path(__file__).parent.parent, sysconfig.get_paths()["stdlib"]))


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` at the first frame outside stmoe (and outside
    the standard library); the outermost frame where there is none, as under ``python -m
    stmoe``."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _passed(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level + 1)


def _passed(filename: str) -> bool:
    try:
        return str(Path(filename).resolve()).startswith(_PASSED)
    except (OSError, ValueError):  # "<string>" and the like
        return False
