"""Import numba with a usable cache folder.

numba caches compiled kernels next to the source, or in a per-user folder; when
neither is writable (a read-only install run by a user without a home, as in
some containers) it refuses to compile cached functions at all. Unless the user
chose ``NUMBA_CACHE_DIR``, point it at a writable folder before numba loads.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".stmoe-write-test"
        probe.touch()
        probe.unlink()
        return True
    except OSError:
        return False


if "NUMBA_CACHE_DIR" not in os.environ and not _writable(Path(__file__).parent / "__pycache__"):
    for candidate in (
        Path.home() / ".cache" / "stmoe" / "numba",
        Path(tempfile.gettempdir()) / f"stmoe-numba-{os.getuid() if hasattr(os, 'getuid') else 0}",
    ):
        if _writable(candidate):
            os.environ["NUMBA_CACHE_DIR"] = str(candidate)
            break

from numba import njit  # noqa: E402

__all__ = ["njit"]
