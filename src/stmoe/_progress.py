"""Progress bars for long work, shown only when a person is watching a terminal.

Library calls stay silent in scripts, pipes, CI and tests (stderr not a TTY).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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
def byte_progress(total: int, description: str) -> Iterator[Callable[[int], None]]:
    """A bar over ``total`` bytes (when on a terminal); yields ``advance(nbytes)``."""
    if not _enabled():
        yield lambda nbytes: None
        return
    with _bar(in_bytes=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)
