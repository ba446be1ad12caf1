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
would give (``0o666`` less the umask), not ``mkstemp``'s private ``0o600``. A write
the system refuses (a full disk) names the file it was writing.

Outputs of several files switch as one: ``atomic_write_files`` writes every file
beside its target first, then renames them in, then a manifest listing each file's
size and SHA-256 (``manifest_mismatch`` tells a reader which file is not the
manifest's: a pair a kill split between two renames); an error before or during
the renames leaves every old file as it was. A folder (a checkpoint) is written
whole beside the old one and exchanged with it in one ``renameat2`` where Linux
has it (``atomic_folder``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import BinaryIO

from stmoe.errors import StmoeError

_SUFFIX = ".tmp"
MANIFEST_FORMAT = "stmoe-manifest"
Writer = Callable[[BinaryIO], None]


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


def stale_temps(path: Path) -> list[Path]:
    """Temporary files (and folders) of earlier writes to ``path`` whose writer has exited."""
    with contextlib.suppress(OSError):
        return [tmp for tmp in path.parent.glob(f".{path.name}.*{_SUFFIX}")
                if (pid := _writer_pid(tmp, path.name)) is not None and not _alive(pid)]
    return []


def remove_stale_temps(path: Path) -> None:
    for tmp in stale_temps(path):  # (deleted)
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink()


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


def _make_durable(tmp: Path) -> None:
    """Flush a written temporary file to the device and give it the mode ``open`` would."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o666 & ~current_umask())


def publish(tmp: Path, dest: Path) -> None:
    """Make a written temporary file durable, give it the mode ``open`` would (the umask's),
    and move it onto ``dest`` in one rename."""
    _make_durable(tmp)
    os.replace(tmp, dest)


@contextmanager
def naming_failures(target: Path) -> Iterator[None]:
    """An ``OSError`` that names no file (``ENOSPC`` from ``write``), or only ``target``'s
    temporary file (a read-only folder), re-raised naming ``target``, so the one-line error
    says which output the disk refused."""
    try:
        yield
    except OSError as exc:
        named = Path(exc.filename) if isinstance(exc.filename, str) else None
        if named is not None and not (named.parent == target.parent and named.name.startswith(
                f".{target.name}.") and _writer_pid(named, target.name) is not None):
            raise
        raise OSError(exc.errno, f"{exc.strerror or exc}; nothing was replaced",
                      str(target)) from None


def atomic_write(path: str | Path, write: Writer) -> Path:
    """Call ``write(f)`` on a temporary file, then move it onto ``path`` in one rename."""
    target = check_output_path(path)
    with naming_failures(target), temp_beside(target) as tmp:
        with open(tmp, "wb") as f:
            write(f)
        publish(tmp, target)
    return target


def atomic_write_files(files: Sequence[tuple[str | Path, Writer]], manifest: str | Path,
                       info: dict[str, object] | None = None) -> list[Path]:
    """Write files that belong together (a main file and its side file) so they switch as
    one: each file is written beside its target, then all are renamed in, the ``manifest``
    (each file's size and SHA-256, and ``info``) last. An error at any step leaves every
    old file as it was and no temporary file; a kill between two renames leaves a set
    that ``manifest_mismatch`` names, never a mix a reader takes for whole."""
    targets = [check_output_path(p) for p, _ in files]
    man = check_output_path(manifest)
    with ExitStack() as stack:
        temps, listed = [], {}
        for target, (_, write) in zip(targets, files, strict=True):
            tmp = stack.enter_context(temp_beside(target))
            with naming_failures(target), open(tmp, "wb") as f:
                write(f)
            listed[target.name] = _digest(tmp)
            temps.append(tmp)
        man_tmp = stack.enter_context(temp_beside(man))
        text = json.dumps({"format": MANIFEST_FORMAT, "version": 1, "files": listed,
                           **(info or {})}, indent=1)
        with naming_failures(man):
            with open(man_tmp, "wb") as f:
                f.write(text.encode("utf-8") + b"\n")
            _switch([*zip(temps, targets, strict=True), (man_tmp, man)])
    return targets


def manifest_mismatch(manifest: Path) -> str | None:
    """The first file beside ``manifest`` that is not the one it lists (another size or
    content: an export a kill split; not a plain file beside it), or None when all
    match; a manifest that cannot be read is reported as itself."""
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
        listed = dict(doc["files"]) if doc.get("format") == MANIFEST_FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        listed = None
    if not listed:
        return manifest.name
    for name, want in listed.items():
        path = manifest.parent / str(name)
        if "/" in str(name) or not path.is_file() or not isinstance(want, dict) \
                or path.stat().st_size != want.get("size") or _digest(path) != want:
            return str(name)
    return None


def _digest(path: Path) -> dict[str, int | str]:
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": path.stat().st_size, "sha256": sha}


def _switch(pairs: list[tuple[Path, Path]]) -> None:
    """Rename each temporary file onto its target; a failure part-way puts back the old
    files (hard-linked aside first) and removes the new ones already renamed in."""
    for tmp, _ in pairs:
        _make_durable(tmp)
    backups: dict[Path, Path | None] = {}
    try:
        for _, dest in pairs:
            backups[dest] = _link_aside(dest)
        done = []
        try:
            for tmp, dest in pairs:
                os.replace(tmp, dest)
                done.append(dest)
        except BaseException:
            for dest in done:
                old = backups.get(dest)
                if old is not None:
                    os.replace(old, dest)
                else:
                    dest.unlink(missing_ok=True)
            raise
    finally:
        for old in backups.values():
            if old is not None:
                old.unlink(missing_ok=True)


def _link_aside(dest: Path) -> Path | None:
    """A hard link to the current ``dest`` under a temporary name (None: no old file)."""
    if not dest.exists():
        return None
    aside = dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.old{_SUFFIX}")
    try:
        os.link(dest, aside)
    except OSError:  # a file system without hard links: no way back, the manifest tells
        return None
    return aside


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A fresh folder beside ``path`` to fill; on a clean exit it takes ``path``'s place
    (exchanged in one rename where the system can, the old folder removed after), on an
    error it is removed and ``path`` is untouched. A killed writer's folder carries its
    pid and is removed by the next write."""
    target = check_output_path(path, folder_ok=True)
    if target.exists() and not target.is_dir():
        raise StmoeError(f"{target}: exists and is not a folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{os.getpid()}.",
                                suffix=_SUFFIX))
    try:
        yield tmp
        for f in (f for f in tmp.rglob("*") if f.is_file() and not f.is_symlink()):
            _make_durable(f)  # every file on the device before the switch names them
        os.chmod(tmp, 0o777 & ~current_umask())
        _swap_folder(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_folder(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target``; the old folder, if any, ends at ``new`` (removed
    by the caller). One ``renameat2(RENAME_EXCHANGE)`` where Linux has it, else two
    renames (a kill between them leaves the old folder under a temporary name)."""
    if not target.exists():
        os.rename(new, target)
        return
    if _exchange(new, target):
        return
    aside = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.old{_SUFFIX}")
    os.rename(target, aside)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(aside, target)
        raise
    os.rename(aside, new)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's ``renameat2``; False where it is missing."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


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
