"""What every command shares: consoles, the error boundary and output helpers."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stmoe.errors import StmoeError, StmoeNote
from stmoe.util.cache_dir import existing_above
from stmoe.util.fileio import atomic_write_text, check_input_file, check_output_path

F = TypeVar("F", bound=Callable[..., Any])

# Off a terminal rich would wrap at 80 columns; results tables read better wider, and a line
# of text is not wrapped at all (soft wrap): a script reading "wrote PATH: ..." gets one line
# however long the path. No emoji codes: a label such as "a:smile:b" is printed as written.
_TTY = sys.stdout.isatty()
out = Console(highlight=False, emoji=False, width=None if _TTY else 160, soft_wrap=not _TTY)
err = Console(stderr=True, highlight=False, emoji=False)

# What a label read from a file or the command line must not send to the terminal: C0 and
# C1 control characters (ESC starts sequences that clear the screen, move the cursor or set
# the window title; BEL rings), DEL, line and paragraph separators, bidirectional overrides.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f"
                                "\u202a-\u202e\u2066-\u2069]")


def plain_label(text: object, *, multiline: bool = False) -> str:
    """``text`` without the characters that move the cursor or drive the terminal.

    For output printed with ``markup=False``; ``multiline`` keeps newlines and tabs
    (generated text)."""
    return (_CONTROL_BUT_LINES if multiline else _CONTROL).sub("", str(text))


def clean_label(text: object) -> str:
    """``text`` (a model name, domain, path, anything a user or a file chose) made safe to
    print through rich markup: control characters removed, ``[...]`` shown literally."""
    return escape(plain_label(text))


def _fail(message: str) -> NoReturn:
    err.print("[bold red]error:[/] " + clean_label(message), markup=True, soft_wrap=True)
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
                warnings.simplefilter("always", StmoeNote)
                check_outputs_apart(kwargs)
                result = fn(*args, **kwargs)
            _show(caught)  # after success only: a refusal stays one line
            return result
        except StmoeError as exc:
            _fail(str(exc))
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            why = (" (a folder was expected there, new or existing: a file is in the way)"
                   if isinstance(exc, (FileExistsError, NotADirectoryError)) else "")
            _fail(f"{where}{exc.strerror or exc}{why}")
        except KeyboardInterrupt:
            _interrupted()
        except SystemError as exc:  # numba wraps a Ctrl-C landing inside a compiled call
            if not _from_interrupt(exc):
                raise
            _interrupted()
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError, EOFError, MemoryError) as exc:
            _fail(f"unexpected input stmoe does not check yet ({type(exc).__name__}: {exc}); "
                  "please report it, and rerun with STMOE_DEBUG=1 for the traceback")

    return wrapper  # type: ignore[return-value]


def _interrupted() -> NoReturn:
    """Ctrl-C: one word and the shell's status for it (outputs are written atomically, so
    none is left half-written)."""
    err.print("interrupted", soft_wrap=True)
    raise typer.Exit(130)


def _from_interrupt(exc: BaseException) -> bool:
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, KeyboardInterrupt):
            return True
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return False


# the parameters every command writes through, and the options that set them
OUTPUT_OPTIONS = {"output": "-o/--output", "json_out": "--json"}


def check_outputs_apart(options: dict[str, Any]) -> None:
    """Refuse, before any work, an output that is one of the command's inputs (``profile
    t.npz -o t.npz`` would replace the trace), a device, FIFO or socket, or one that cannot
    be made where it is named (a file in the way of its folder, a folder this user cannot
    write): found after an hour's generation, it would lose the hour."""
    inputs = []
    for name, value in options.items():
        if name not in OUTPUT_OPTIONS:
            inputs += [v for v in (value if isinstance(value, list) else [value])
                       if isinstance(v, Path)]
    for name, flag in OUTPUT_OPTIONS.items():
        dest = options.get(name)
        if not isinstance(dest, Path) or str(dest) == "-":
            continue
        if not dest.exists():
            _check_makeable(dest, flag)
            continue
        check_output_path(dest, folder_ok=True)
        for src in inputs:
            if src.exists() and os.path.samefile(src, dest):
                raise StmoeError(f"{dest}: is also an input of this command; write the "
                                 "result to another path")


def _check_makeable(dest: Path, flag: str) -> None:
    """``dest`` (absent) can be made: its nearest existing folder above is a folder this
    user may write (the writers make the folders between)."""
    target = Path(os.path.realpath(dest)) if dest.is_symlink() else dest  # (written through)
    above = existing_above(target.absolute().parent)
    if not above.is_dir():
        raise StmoeError(f"{dest} ({flag}): {above} is a file, not a folder; name another "
                         "path")
    if not os.access(above, os.W_OK | os.X_OK):
        raise StmoeError(f"{dest} ({flag}): the folder {above} is not writable by this "
                         "user; name another path")


def npz_output(dest: Path, what: str = "trace") -> None:
    """Refuse, before any work, an output named for another format (``-o x.json``):
    stmoe writes traces and tables as .npz whatever the name, so a .json would hold an
    npz that no JSON reader takes. No suffix is accepted (files are read by content)."""
    if dest.suffix.lower() not in ("", ".npz"):
        hint = "; `stmoe export` writes an engine's formats" if what == "trace" else ""
        raise StmoeError(f"{dest}: stmoe writes a {what} as .npz, not {dest.suffix}; name "
                         f"the file .npz{hint}")


def _show(caught: list[warnings.WarningMessage]) -> None:
    """stmoe's notes as one ``note:`` line each; other warnings as Python shows them."""
    for w in caught:
        if issubclass(w.category, StmoeNote):
            err.print(f"note: {plain_label(w.message)}", markup=False, soft_wrap=True)
        else:  # as Python shows them, less any control character a label brought in
            text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
            sys.stderr.write(plain_label(text, multiline=True))


def print_json(data: Any) -> None:
    """Machine-readable output: stdout carries the JSON and nothing else."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


# One convention for every command: --json PATH writes the results there; '-' prints
# them on stdout instead of the human-readable output (which then goes nowhere).
JSON_HELP = "Write the results as JSON to this file ('-': print them on stdout instead)."


def json_to_stdout(dest: Path | None) -> bool:
    """True for ``--json -``; a ``--json`` file that cannot be written (a directory) is
    refused here, before the command computes anything."""
    if dest is None:
        return False
    if str(dest) == "-":
        return True
    check_output_path(dest)
    return False


def write_json(data: Any, dest: Path | None) -> bool:
    """Honour ``--json``: True when the JSON went to stdout (print nothing else)."""
    if dest is None:
        return False
    if json_to_stdout(dest):
        print_json(data)
        return True
    atomic_write_text(dest, json.dumps(data, indent=2) + "\n")
    out.print(f"wrote {clean_label(dest)}")
    return False


def path_option(*decls: str, **kwargs: Any) -> Any:
    """``typer.Option`` for a path: typer's own readability check (exit 2, a usage box)
    off, since every command checks its files first (exit 1, one line: ``check_inputs``)."""
    return typer.Option(*decls, readable=False, **kwargs)


def path_argument(*decls: str, **kwargs: Any) -> Any:
    """``typer.Argument`` for a path (see ``path_option``)."""
    return typer.Argument(*decls, readable=False, **kwargs)


def check_range(option: str, value: float | None, low: float | None = None,
                high: float | None = None, *, exclusive: bool = False,
                why: str = "") -> None:
    """Refuse an option's NaN, infinite or out-of-range value in one line naming the option
    and the range (``exclusive``: the bounds themselves are refused too). None passes."""
    if value is None:
        return
    above = low is None or (value > low if exclusive else value >= low)
    below = high is None or (value < high if exclusive else value <= high)
    if math.isfinite(value) and above and below:
        return
    lo, hi = (x if x is None or isinstance(x, int) else f"{x:g}" for x in (low, high))
    if low is not None and high is not None:
        span = f"strictly between {lo} and {hi}" if exclusive else f"from {lo} to {hi}"
    else:
        sign = (">" if low is not None else "<") + ("" if exclusive else "=")
        span = f"{sign} {lo if hi is None else hi}"
    kind = "an integer" if isinstance(value, int) else "a number"
    raise StmoeError(f"{option} {value}: expected {kind} {span}" + (f" ({why})" if why else ""))


def check_inputs(what: str, paths: list[Path] | Path | None) -> None:
    """Each input file regular and readable, checked before any work (``check_input_file``),
    and none given twice (the same file under two names included): its routing would count
    twice, and a held-out part could hold a copy of a profiled one."""
    listed = [paths] if isinstance(paths, Path) else list(paths or [])
    seen: dict[tuple[int, int], Path] = {}
    for path in listed:
        check_input_file(path, what)
        st = path.stat()
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first is not path:
            raise StmoeError(f"{clean_label(path)}: the same file as {clean_label(first)}, given "
                             f"twice; give each {what.removeprefix('a ')} once")


def key_value_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    """A two-column table; the title, keys and values are taken as plain text (cleaned)."""
    table = Table(title=clean_label(title), show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(clean_label(key), clean_label(value))
    return table
