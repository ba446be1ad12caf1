"""Shared fixtures: the real sample in ../shared/traces and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stmoe.cli import app

REPO = Path(__file__).resolve().parents[1]
SHARED_TRACES = Path(os.environ.get("STMOE_SHARED", REPO.parent / "shared")) / "traces"
REAL_ROUTES = SHARED_TRACES / "qwen3.6-35b-a3b_chat-1prompt.routes.json"
REAL_NPZ = SHARED_TRACES / "qwen3.6-35b-a3b_chat-1prompt.npz"

# The predictor names the eval issue fixes as a contract (tools outside the project parse them).
CONTRACT_PREDICTORS = (
    "stmoe", "ondemand", "previous-token", "cct-static", "cct-online", "frequency", "random",
    "oracle", "stmoe-plus",
)  # fmt: skip

needs_shared = pytest.mark.skipif(
    not (REAL_ROUTES.exists() and REAL_NPZ.exists()),
    reason=f"the real sample traces are not at {SHARED_TRACES} "
    "(set STMOE_SHARED to the shared/ folder)",
)


class Cli:
    """Runs ``stmoe ARGS`` in-process and returns click's result."""

    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: str | os.PathLike[str]):
        return self.runner.invoke(app, [str(a) for a in args], prog_name="stmoe")


@pytest.fixture
def cli() -> Cli:
    return Cli()
