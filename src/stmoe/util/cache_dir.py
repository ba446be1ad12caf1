"""Where stmoe keeps what it makes on first use: ``$STMOE_CACHE``, else ~/.cache/stmoe (no
torch). One function, so the stores, the demo's checkpoint and the vLLM plugin's kernel
stores read the variable alike: an empty value once put a store in the working directory.
And where any path stmoe would make lies (``existing_above``), for the checks of disk and
permissions before it writes."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """``kind``'s folder in stmoe's cache (``STMOE_CACHE`` unset or empty: ~/.cache/stmoe)."""
    root = os.environ.get("STMOE_CACHE") or Path.home() / ".cache" / "stmoe"
    return Path(root) / kind


def existing_above(path: Path) -> Path:
    """``path`` or the nearest of its parents that exists (where it would be made): the
    folder whose disk and permissions decide whether it can be."""
    return next((p for p in [path, *path.parents] if p.exists()), Path("/"))
