"""The model stmoe ships, and where its profiled tables sit.

``tiny-moe/`` is a small MoE trained for the demo (docs/model-card.md), shipped
inside the package so ``stmoe demo``, ``stmoe capture`` and ``stmoe generate``
run with no download. Its location lives here, next to the model, rather than in
any one command that uses it. Importing this needs neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_MODEL = Path(__file__).parent / "tiny-moe"
# a model folder's tables, profiled on stmoe capture's built-in prompts; found there by offload
SHIPPED_TABLES = "stmoe-tables.npz"
