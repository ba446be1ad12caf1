"""stmoe export (issue 30, item 1): every format written atomically over an older export.

A kill or a full disk is simulated by a file system that fails part-way through a
write (``failing_disk``), or a rename that fails part-way through the switch: the old
export must survive byte for byte, no temporary file may stay, and an npy pair that a
real kill split between its renames is refused, never read as whole.
"""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import one_line_error
from stmoe import load_trace, save_trace, synthesize
from stmoe.errors import TraceError
from stmoe.trace.engines import EngineOptions
from stmoe.trace.export import EXPORT_FORMATS, export_trace
from stmoe.util import fileio

OLD = synthesize(tokens=40, layers=3, experts=8, top_k=2, sequences=3, seed=1)
NEW = synthesize(tokens=96, layers=3, experts=8, top_k=2, sequences=8, seed=2)
FILES = {"npy": 3}  # files one export writes: npy writes its side file and manifest too
IMPORT = {"sglang": {"engine": EngineOptions(layers=3, top_k=2)}}


def folder(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.parent.iterdir())}


class FailingDisk:
    """``open`` in util.fileio whose ``file``-th file written (0-based) takes ``room`` bytes, then
    fails as a full disk does (ENOSPC), like a kill part-way through that file."""

    def __init__(self, file: int, room: int = 10) -> None:
        self.file, self.room, self.opened = file, room, 0

    def __call__(self, name, mode="r", *args, **kwargs):
        f = builtins.open(name, mode, *args, **kwargs)  # noqa: SIM115 - returned, as open does
        if "w" not in mode:
            return f
        index, self.opened = self.opened, self.opened + 1
        return _Limited(f, self.room) if index == self.file else f


class _Limited:
    """A binary file that fails once ``room`` bytes are written (not a real file object,
    so np.save writes through ``write`` too)."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self.f.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def old_export(tmp_path: Path, fmt: str) -> tuple[Path, dict[str, bytes]]:
    path = export_trace(OLD, tmp_path / f"old.{fmt}", fmt)
    return path, folder(path)


# the note is asserted in test_engines.py (no prompt length)
@pytest.mark.filterwarnings('ignore:.*the file gives no prompt length:stmoe.errors.StmoeNote')
@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_a_write_failing_at_each_file_keeps_the_old_export(tmp_path, monkeypatch, fmt):
    for step in range(FILES.get(fmt, 1)):
        path, before = old_export(tmp_path / f"{fmt}-{step}", fmt)
        monkeypatch.setattr(fileio, "open", FailingDisk(step), raising=False)
        with pytest.raises(OSError, match="No space left") as exc:
            export_trace(NEW, path, fmt)
        monkeypatch.undo()
        assert exc.value.filename is not None and Path(exc.value.filename).parent == path.parent
        assert folder(path) == before, (fmt, step)  # the old files, byte for byte; no temp
        back = load_trace(path, num_experts=8, **IMPORT.get(fmt, {}))
        assert np.array_equal(back.experts, OLD.experts)
        assert back.seq_starts.tolist() == OLD.seq_starts.tolist()


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_a_rename_failing_at_each_step_of_the_switch_keeps_the_old_export(tmp_path,
                                                                          monkeypatch, fmt):
    real = os.replace
    for step in range(FILES.get(fmt, 1)):
        path, before = old_export(tmp_path / f"{fmt}-{step}", fmt)
        calls = [0]

        def replace(src, dst, step=step, calls=calls):
            calls[0] += 1
            if calls[0] == step + 1:
                raise OSError(errno.EIO, "Input/output error", str(dst))
            return real(src, dst)

        monkeypatch.setattr(fileio.os, "replace", replace)
        with pytest.raises(OSError, match="Input/output"):
            export_trace(NEW, path, fmt)
        monkeypatch.undo()
        assert folder(path) == before, (fmt, step)


def test_an_npy_pair_a_kill_split_between_its_renames_is_refused(tmp_path, cli):
    """A real kill cannot roll back: new ids beside the old sequence starts (3 where the
    new trace has 8) must not import as a trace."""
    path, _ = old_export(tmp_path, "npy")
    other = export_trace(NEW, tmp_path / "new" / "old.npy", "npy")
    os.replace(other, path)  # the main file renamed in, then the kill
    result = cli("import", path, "-o", tmp_path / "back.npz", "--num-experts", "8")
    one_line_error(result, "old.npy", "is not the file old.manifest.json lists",
                   "export again")
    assert not (tmp_path / "back.npz").exists()
    with pytest.raises(TraceError, match="manifest"):
        load_trace(path, num_experts=8)
    # a side file from another export, the main file untouched: refused too
    export_trace(OLD, tmp_path / "b.npy", "npy")
    os.replace(other.with_suffix(".seq_starts.npy"), tmp_path / "b.seq_starts.npy")
    with pytest.raises(TraceError, match=r"b\.seq_starts\.npy is not the file"):
        load_trace(tmp_path / "b.npy", num_experts=8)


def test_a_full_disk_during_export_is_one_line_naming_the_output(tmp_path, monkeypatch, cli):
    src = tmp_path / "s.npz"
    from stmoe.trace import save_trace

    save_trace(OLD, src)
    dest, before = old_export(tmp_path / "out", "jsonl")
    monkeypatch.setattr(fileio, "open", FailingDisk(0), raising=False)
    result = cli("export", src, "-o", dest, "--format", "jsonl")
    monkeypatch.undo()
    one_line_error(result, str(dest), "No space left on device", "nothing was replaced")
    assert folder(dest) == before


# the note is asserted in test_engines.py (no prompt length)
@pytest.mark.filterwarnings('ignore:.*the file gives no prompt length:stmoe.errors.StmoeNote')
def test_a_killed_exports_leftover_is_removed_by_the_next_export(tmp_path):
    path, _ = old_export(tmp_path, "vllm")
    stale = tmp_path / f".{path.name}.999999999.abc.tmp"  # no process has that pid
    stale.write_bytes(b"half")
    export_trace(NEW, path, "vllm")
    assert not stale.exists()
    assert load_trace(path).num_sequences == NEW.num_sequences


@pytest.mark.parametrize(("fmt", "lost", "kept"), [
    ("npy", ["the model name", "the SYNTHETIC mark", "--num-experts 64", "decode tokens"], []),
    ("vllm", ["the SYNTHETIC mark", "--num-experts 64", "decode tokens"], ["model name"]),
    ("sglang", ["the model name", "the SYNTHETIC mark", "--num-experts 64"], ["decode"]),
    ("jsonl", [], ["does not keep"]),
])
def test_an_export_says_what_its_format_does_not_keep(cli, tmp_path, fmt, lost, kept):
    """Synthetic routing of 64 experts whose highest id used is below 63, two sequences: an
    import of a foreign file would read it back as real, of fewer experts (review, item 6)."""
    trace = synthesize(tokens=40, layers=4, experts=64, top_k=2, sequences=2, skew=4, seed=3)
    assert int(trace.experts.max()) < 63 and trace.meta.synthetic
    save_trace(trace, tmp_path / "t.npz")
    res = cli("export", tmp_path / "t.npz", "-o", tmp_path / f"out.{fmt}", "--format", fmt)
    assert res.exit_code == 0, res.output
    for words in lost:
        assert words in res.output, (words, res.output)
    for words in kept:
        assert words not in res.output, (words, res.output)
