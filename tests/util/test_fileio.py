"""stmoe.util.fileio: atomic writes (old or new, never half; umask; leftovers gone), checked
inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stmoe.errors import StmoeError
from stmoe.util.fileio import atomic_write, atomic_write_text, check_input_file, current_umask


def test_mode_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        p = atomic_write_text(tmp_path / "a.json", "{}")
        assert p.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)
    p = atomic_write_text(tmp_path / "b.json", "{}")
    assert p.stat().st_mode & 0o777 == 0o666 & ~old


def test_a_directory_is_refused_and_nothing_is_written_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(StmoeError, match="is a directory"):
        atomic_write_text(target, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    p = atomic_write_text(tmp_path / "t.npz", "old")

    def boom(f: object) -> None:
        f.write(b"half")  # type: ignore[attr-defined]
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write(p, boom)
    assert p.read_text() == "old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.npz"]


def test_a_killed_writers_temp_is_removed_on_the_next_write(tmp_path: Path) -> None:
    # a process that has exited: its pid names a temp file it left behind
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(done.stdout)
    stale = tmp_path / f".t.npz.{dead}.abc123.tmp"
    stale.write_bytes(b"\0" * 1000)
    live = tmp_path / f".t.npz.{os.getpid()}.xyz.tmp"  # a writer still running: kept
    live.write_bytes(b"\0")
    atomic_write_text(tmp_path / "t.npz", "new")
    assert not stale.exists()
    assert live.exists()
    assert (tmp_path / "t.npz").read_text() == "new"


def test_inputs_that_would_hang_or_fail_are_refused_in_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(StmoeError, match="not a regular file"):
        check_input_file(fifo, "a trace")
    with pytest.raises(StmoeError, match="is a directory; expected a trace"):
        check_input_file(tmp_path, "a trace")
    with pytest.raises(StmoeError, match="no such file"):
        check_input_file(tmp_path / "missing.npz")
    ok = tmp_path / "ok.npz"
    ok.write_bytes(b"x")
    assert check_input_file(ok) == ok
    if os.geteuid() != 0:  # root reads anything
        ok.chmod(0)
        with pytest.raises(StmoeError, match="permission denied"):
            check_input_file(ok)


# ---- issue 30: disk-full errors name the file; several files and folders switch as one --


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path: Path) -> None:
    import errno

    p = atomic_write_text(tmp_path / "r.json", "old")

    def full(f: object) -> None:
        f.write(b"ha")  # type: ignore[attr-defined]
        raise OSError(errno.ENOSPC, "No space left on device")  # write(2) names no file

    with pytest.raises(OSError) as caught:
        atomic_write(p, full)
    assert caught.value.filename == str(p) and caught.value.errno == errno.ENOSPC
    assert "nothing was replaced" in caught.value.strerror
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.json"] and p.read_text() == "old"


def test_a_read_only_folder_names_the_output_not_its_temporary_file(tmp_path: Path,
                                                                    monkeypatch) -> None:
    """(``--json ro/x.json`` said ``ro/.x.json.<pid>.<random>.tmp: Read-only file system``.)
    A read-only mount stood in for: root may write anywhere else."""
    import errno
    import tempfile

    def read_only(dir: str, prefix: str, suffix: str) -> tuple[int, str]:
        raise OSError(errno.EROFS, "Read-only file system", f"{dir}/{prefix}q8x1{suffix}")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(OSError) as caught:
        atomic_write_text(tmp_path / "x.json", "{}")
    assert caught.value.filename == str(tmp_path / "x.json"), caught.value
    assert caught.value.errno == errno.EROFS
    monkeypatch.undo()

    def other(f: object) -> None:  # an error naming another file is left as it is
        raise OSError(errno.ENOENT, "No such file or directory", str(tmp_path / "elsewhere"))

    with pytest.raises(OSError) as caught:
        atomic_write(tmp_path / "x.json", other)
    assert caught.value.filename == str(tmp_path / "elsewhere")


def test_files_written_together_switch_as_one_and_a_split_pair_is_named(tmp_path: Path) -> None:
    from stmoe.util.fileio import atomic_write_files, manifest_mismatch

    a, b, man = tmp_path / "a.npy", tmp_path / "a.side", tmp_path / "a.manifest.json"
    atomic_write_files([(a, lambda f: f.write(b"A1")), (b, lambda f: f.write(b"B1"))], man)
    assert manifest_mismatch(man) is None
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def boom(f: object) -> None:
        f.write(b"B2-half")  # type: ignore[attr-defined]
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write_files([(a, lambda f: f.write(b"A2")), (b, boom)], man)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old  # no temp, no change
    a.write_bytes(b"A2")  # what a kill between the renames leaves: new main, old side
    assert manifest_mismatch(man) == "a.npy"
    man.write_text("{not json")
    assert manifest_mismatch(man) == "a.manifest.json"


@pytest.mark.parametrize("exchange", [True, False])
def test_a_folder_is_written_beside_the_old_one_and_switched(tmp_path: Path, monkeypatch,
                                                             exchange: bool) -> None:
    from stmoe.util import fileio

    if not exchange:  # a system without renameat2: two renames
        monkeypatch.setattr(fileio, "_exchange", lambda a, b: False)
    out = tmp_path / "ckpt"
    with fileio.atomic_folder(out) as tmp:
        (tmp / "w.bin").write_bytes(b"old")
    with pytest.raises(RuntimeError), fileio.atomic_folder(out) as tmp:
        (tmp / "w.bin").write_bytes(b"ha")
        raise RuntimeError("killed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (out / "w.bin").read_bytes() == b"old"
    with fileio.atomic_folder(out) as tmp:
        (tmp / "w.bin").write_bytes(b"new")
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "w.bin"]
    assert (out / "w.bin").read_bytes() == b"new"
    assert out.stat().st_mode & 0o777 == 0o777 & ~current_umask()
