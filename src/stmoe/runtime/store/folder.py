"""A store folder's lock and its leftovers: what every writer of an index.json shares.

Both writers (``packing``: a data file and its index; ``in_place_index``: an index
alone) hold the folder's advisory lock while they write, so two writers into one
folder run one after the other, and remove the data files the new index does not
name (a replaced store, a killed pack's, version 1's).
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stmoe.errors import StmoeNote, StoreError
from stmoe.runtime.store.index import DATA_NAME, MAX_INDEX_BYTES, STORE_FORMAT
from stmoe.util.warn import warn

OLD_DATA = ("experts.bin", "experts.bin.tmp")  # version 1's data file and its temporary
LOCK_NAME = ".pack.lock"  # the folder's advisory lock (never removed: see pack_lock)


def refuse_foreign_index(out: Path) -> None:
    """A folder whose index.json is not a store's is refused: a writer replaces that file
    (and any data file beside it), so a user's own would be lost with no error. A store's,
    damaged or not, is replaced."""
    index = out / "index.json"
    if not index.is_file():
        return
    try:
        with index.open("rb") as f:
            data = json.loads(f.read(MAX_INDEX_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        data = None
    if not (isinstance(data, dict) and data.get("format") == STORE_FORMAT):
        raise StoreError(f"{index}: not an stmoe store's index, and packing into {out} "
                         "would replace it: pack into a new or empty folder (or remove it)")


@contextmanager
def pack_lock(out: Path) -> Iterator[None]:
    """The folder's advisory lock for one pack (another pack into it waits, with a note);
    released when the pack ends or its process dies. A folder holding someone else's
    index.json is refused first (``refuse_foreign_index``): every writer takes this lock."""
    refuse_foreign_index(out)
    with open(out / LOCK_NAME, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            warn(f"{out}: another pack is writing this store; waiting for it",
                 StmoeNote)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_unnamed(out: Path, keep: str) -> None:
    """Data files the index does not name: the replaced one, a killed pack's, version 1's
    (called under ``pack_lock``, so no other pack's data is between its publish and its
    index)."""
    for f in out.iterdir():
        if f.name != keep and (DATA_NAME.fullmatch(f.name) or f.name in OLD_DATA):
            f.unlink(missing_ok=True)
