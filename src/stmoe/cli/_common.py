"""What every command shares: consoles, the error boundary and output helpers."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from stmoe.errors import StmoeError

F = TypeVar("F", bound=Callable[..., Any])

# Off a terminal rich would wrap at 80 columns; results tables read better wider.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False)


def friendly(fn: F) -> F:
    """The error boundary: a user-caused ``StmoeError`` becomes one line and exit 1.

    Usage errors (unknown option, missing argument) are click's and exit 2.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except StmoeError as exc:
            err.print(f"[bold red]error:[/] {exc}", markup=True, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def print_json(data: Any) -> None:
    """Machine-readable output: stdout carries the JSON and nothing else."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


def key_value_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, str(value))
    return table
