"""What every command shares: consoles, the error boundary and output helpers."""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stmoe.errors import StmoeError
from stmoe.trace.engines import ImportNote

F = TypeVar("F", bound=Callable[..., Any])

# Off a terminal rich would wrap at 80 columns; results tables read better wider.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False)


def _fail(message: str) -> NoReturn:
    err.print("[bold red]error:[/] " + escape(message), markup=True, soft_wrap=True)
    raise typer.Exit(1)


def friendly(fn: F) -> F:
    """The error boundary: every failure becomes one line on stderr and exit status 1.

    ``StmoeError`` is the expected kind (bad input, named precisely at its source);
    ``OSError`` is a file the system refused; anything else is a check stmoe lacks,
    said as such. ``STMOE_DEBUG=1`` shows the traceback instead. Usage errors
    (unknown option, missing argument) are click's and exit 2.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get("STMOE_DEBUG"):
            return fn(*args, **kwargs)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("ignore", RuntimeWarning)  # one line, not numpy's too
                warnings.simplefilter("always", ImportNote)
                result = fn(*args, **kwargs)
            _show(caught)  # after success only: a refusal stays one line
            return result
        except StmoeError as exc:
            _fail(str(exc))
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(f"{where}{exc.strerror or exc}")
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError, EOFError, MemoryError) as exc:  # fmt: skip
            _fail(f"unexpected input stmoe does not check yet ({type(exc).__name__}: {exc}); "
                  "please report it, and rerun with STMOE_DEBUG=1 for the traceback")  # fmt: skip

    return wrapper  # type: ignore[return-value]


def _show(caught: list[warnings.WarningMessage]) -> None:
    """An importer's notes as one ``note:`` line each; other warnings as Python shows them."""
    for w in caught:
        if issubclass(w.category, ImportNote):
            err.print(f"note: {w.message}", markup=False, soft_wrap=True)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def print_json(data: Any) -> None:
    """Machine-readable output: stdout carries the JSON and nothing else."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


# One convention for every command: --json PATH writes the results there; '-' prints
# them on stdout instead of the human-readable output (which then goes nowhere).
JSON_HELP = "Write the results as JSON to this file ('-': print them on stdout instead)."


def write_json(data: Any, dest: Path | None) -> bool:
    """Honour ``--json``: True when the JSON went to stdout (print nothing else)."""
    if dest is None:
        return False
    if str(dest) == "-":
        print_json(data)
        return True
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(data, indent=2) + "\n")
    out.print(f"wrote {escape(str(dest))}")
    return False


def key_value_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, str(value))
    return table
