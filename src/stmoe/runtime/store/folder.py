"""A store folder's lock and its leftovers: what every writer of an index.json shares.

Both writers (``packing``: a data file and its index; ``in_place_index``: an index
alone) hold the folder's advisory lock while they write, so two writers into one
folder run one after the other, and remove the data files the new index does not
name (a replaced store, a killed pack's, version 1's).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stmoe.errors import StmoeNote, StoreError
from stmoe.runtime.store.index import DATA_NAME, MAX_INDEX_BYTES, STORE_FORMAT
from stmoe.util.cache_dir import existing_above
from stmoe.util.fileio import stale_temps
from stmoe.util.units import format_bytes
from stmoe.util.warn import warn

OLD_DATA = ("experts.bin", "experts.bin.tmp")  # version 1's data file and its temporary
DATA_TEMP = "experts.bin"  # a pack's temporary data file: .experts.bin.<pid>.<random>.tmp
LOCK_NAME = ".pack.lock"  # the folder's advisory lock (never removed: see pack_lock)
_held = threading.local()  # the folders whose lock this thread holds (``pack_lock``)


def refuse_foreign_index(out: Path) -> None:
    """A folder whose index.json is not a store's is refused: a writer replaces that file
    (and any data file beside it), so a user's own would be lost with no error. A store's,
    damaged or not, is replaced."""
    index = out / "index.json"
    if index.is_file() and _store_index(index) is None:
        raise StoreError(f"{index}: not an stmoe store's index, and packing into {out} "
                         "would replace it: pack into a new or empty folder (or remove it)")


def named_data(out: Path) -> str:
    """The data file the folder's index names ("" for none: no index, a damaged one, an
    in-place store's)."""
    data = _store_index(out / "index.json")
    name = data.get("data") if data is not None else None
    return name if isinstance(name, str) and DATA_NAME.fullmatch(name) else ""


def _store_index(index: Path) -> dict[str, object] | None:
    """``index``'s JSON if it is a store's (damaged or not), else None (none at all too)."""
    try:
        with index.open("rb") as f:
            data = json.loads(f.read(MAX_INDEX_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and data.get("format") == STORE_FORMAT else None


@contextmanager
def pack_lock(out: Path, waiting: str = "another pack is writing this store; waiting for "
              "it") -> Iterator[None]:
    """The folder's advisory lock for one pack (another pack into it waits, with the note
    ``waiting``); released when the pack ends or its process dies. A thread holding it
    already holds it again at no cost (a first use holds it from its check of the cached
    store to the pack's end). A folder holding someone else's index.json is refused first
    (``refuse_foreign_index``): every writer takes this lock."""
    refuse_foreign_index(out)
    held: set[str] = _held.__dict__.setdefault("folders", set())
    key = str(out.resolve())
    if key in held:
        yield
        return
    with open(out / LOCK_NAME, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            warn(f"{out}: {waiting}", StmoeNote)
            fcntl.flock(f, fcntl.LOCK_EX)
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_unnamed(out: Path, keep: str) -> None:
    """Data files the index does not name: the replaced one, a killed pack's, version 1's
    (called under ``pack_lock``, so no other pack's data is between its publish and its
    index)."""
    for f in unnamed(out, keep):
        f.unlink(missing_ok=True)


def unnamed(out: Path, keep: str) -> list[Path]:
    """The data files in ``out`` but ``keep`` (``remove_unnamed``'s)."""
    return [f for f in out.iterdir()
            if f.name != keep and (DATA_NAME.fullmatch(f.name) or f.name in OLD_DATA)]


def check_disk(out: Path, needed: float, option: str = "--store") -> None:
    """Refuse, in one line, a pack the disk under ``out`` cannot hold (``needed``: the
    experts' bytes in the store's format, estimated from the checkpoint's headers); what an
    earlier pack left there counts as free (the pack removes it first). ``option``: how the
    caller's user names another store folder."""
    where = existing_above(out)
    if not os.access(where, os.W_OK):
        raise StoreError(f"{out}: {where} is not writable by this user; pass {option} (or "
                         "STMOE_CACHE) in a folder that is")
    kept = named_data(out) if out.is_dir() else ""
    left = [*stale_temps(out / DATA_TEMP), *unnamed(out, kept)] if out.is_dir() else []
    free = shutil.disk_usage(where).free + sum(_bytes_of(f) for f in left)
    if free >= needed:
        return
    kept_note = (f" (the store it replaces keeps its {format_bytes(_bytes_of(out / kept))} "
                 "until the new one is whole)" if kept else "")
    raise StoreError(f"{out}: the store needs about {format_bytes(needed)} and its disk has "
                     f"{format_bytes(free)} free{kept_note}; free some space or pass {option} (or "
                     "STMOE_CACHE) on another disk")


def _bytes_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
