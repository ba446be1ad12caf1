"""Files stmoe reads and writes: inputs checked before opening, outputs written atomically.

``check_input_file`` refuses, in one line, what ``open`` would hang on or fail
on less clearly: a missing path, a directory, a FIFO or device (reading one
blocks forever), a file this user may not read.

Every file stmoe writes (traces, tables, the store's files, JSON results) goes
through ``atomic_write``: the bytes go to a temporary file beside the target,
are flushed to the device, and replace the target in one ``rename``. A process
killed mid-write leaves the old file intact and a temporary file whose name
carries the writer's pid; the next write to the same target removes such
leftovers once their writer is gone, so a killed ``import`` does not leave
hundreds of MB behind for good. The result gets the mode a plain ``open``
would give (``0o666`` less the umask), not ``mkstemp``'s private ``0o600``.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from stmoe.errors import StmoeError

_SUFFIX = ".tmp"


def current_umask() -> int:
    """The process umask, read without changing it where the system allows."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: the classic read-and-restore (not thread-safe)
    os.umask(mask)
    return mask


def check_output_path(path: str | Path, folder_ok: bool = False) -> Path:
    """``path`` as a file to write (or, ``folder_ok``, a folder): refused when it is a
    directory (``-o /tmp``) or a device, FIFO or socket, which a rename would replace by a
    regular file (``-o /dev/null``). A symbolic link is written through (its target)."""
    p = Path(path)
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    if p.is_dir():
        if folder_ok:
            return p
        raise StmoeError(f"{p}: is a directory; give the name of the file to write")
    if p.exists() and not p.is_file():
        raise StmoeError(f"{p}: not a regular file (a device, FIFO or socket); give the "
                         "path of a file to write")
    if not p.name or p.name in (".", ".."):
        raise StmoeError(f"{p}: not a file name")
    return p


def check_input_file(path: str | Path, what: str = "an input file") -> Path:
    """``path`` as a regular, readable file, or one clear error naming it."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise StmoeError(f"{p}: no such file; expected {what}") from None
    except OSError as exc:
        raise StmoeError(f"{p}: cannot be read ({exc.strerror}); expected {what}") from None
    if stat.S_ISDIR(st.st_mode):
        raise StmoeError(f"{p}: is a directory; expected {what}")
    if not stat.S_ISREG(st.st_mode):
        raise StmoeError(f"{p}: not a regular file (a FIFO, socket or device); expected {what}")
    if not os.access(p, os.R_OK):
        raise StmoeError(f"{p}: permission denied; expected {what} this user may read")
    return p


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete temporary files of earlier writes to ``path`` whose writer has exited."""
    removed = []
    with contextlib.suppress(OSError):
        for tmp in path.parent.glob(f".{path.name}.*{_SUFFIX}"):
            pid = _writer_pid(tmp, path.name)
            if pid is not None and not _alive(pid):
                with contextlib.suppress(OSError):
                    tmp.unlink()
                    removed.append(tmp)
    return removed


@contextmanager
def temp_beside(path: str | Path) -> Iterator[Path]:
    """A fresh temporary file beside ``path``, named with this pid (so a later write can
    tell a dead writer's leftover); removed unless ``publish`` moved it first."""
    target = check_output_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.{os.getpid()}.",
                                suffix=_SUFFIX)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def publish(tmp: Path, dest: Path) -> None:
    """Make a written temporary file durable, give it the mode ``open`` would (the umask's),
    and move it onto ``dest`` in one rename."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o666 & ~current_umask())
    os.replace(tmp, dest)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(f)`` on a temporary file, then move it onto ``path`` in one rename."""
    target = check_output_path(path)
    with temp_beside(target) as tmp:
        with open(tmp, "wb") as f:
            write(f)
        publish(tmp, target)
    return target


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """``atomic_write`` of a ready byte string."""
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write`` of text, UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _writer_pid(tmp: Path, name: str) -> int | None:
    """The pid embedded in a temporary file's name (``.NAME.PID.RANDOM.tmp``)."""
    rest = tmp.name[len(name) + 2 :]
    head = rest.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
