"""Where stmoe keeps what it makes on first use: ``$STMOE_CACHE``, else ~/.cache/stmoe (no
torch). One function, so the stores, the demo's checkpoint and the vLLM plugin's kernel
stores read the variable alike: an empty value once put a store in the working directory."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """``kind``'s folder in stmoe's cache (``STMOE_CACHE`` unset or empty: ~/.cache/stmoe)."""
    root = os.environ.get("STMOE_CACHE") or Path.home() / ".cache" / "stmoe"
    return Path(root) / kind
