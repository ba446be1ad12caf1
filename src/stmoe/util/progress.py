"""Progress bars for long work, shown only when a person is watching a terminal.

Library calls stay silent in scripts, pipes, CI and tests (stderr not a TTY).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")


def _enabled() -> bool:
    return sys.stderr.isatty() and not os.environ.get("STMOE_NO_PROGRESS")


def _bar(in_bytes: bool = False):  # type: ignore[no-untyped-def]
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn() if in_bytes else MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def progress(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    """Iterate ``items``, with a bar of ``total`` steps when on a terminal."""
    if not _enabled():
        yield from items
        return
    with _bar() as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


def progress_bytes(f: IO[bytes], path: Path, description: str) -> Iterator[bytes]:
    """The lines of a binary file, with a bar over its bytes when on a terminal."""
    if not _enabled():
        yield from f
        return
    with _bar(in_bytes=True) as bar:
        task = bar.add_task(f"{description} {path.name}", total=path.stat().st_size)
        for line in f:
            yield line
            bar.advance(task, len(line))


@contextmanager
def byte_progress(total: int, description: str,
                  in_bytes: bool = True) -> Iterator[Callable[[int], None]]:
    """A bar over ``total`` bytes (or steps: ``in_bytes`` False), when on a terminal;
    yields ``advance(n)``."""
    if not _enabled():
        yield lambda nbytes: None
        return
    with _bar(in_bytes=in_bytes) as bar:
        task = bar.add_task(description, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)


def announced_byte_progress(
    announce: Callable[[int], str],
) -> Callable[[int, str], AbstractContextManager[Callable[[int], None]]]:
    """A ``byte_progress`` factory that first prints ``announce(total)`` on stderr, on a
    terminal or not (the bar itself only on a terminal): for work a person did not ask
    for by name (packing a store on first use: gigabytes of disk)."""

    @contextmanager
    def bar(total: int, description: str) -> Iterator[Callable[[int], None]]:
        print(announce(total), file=sys.stderr, flush=True)
        with byte_progress(total, description) as advance:
            yield advance

    return bar
