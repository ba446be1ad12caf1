"""What an interrupted or failed pack leaves, and the next pack (a reliability review,
2026-12-07): a killed pack's temporary data file and a failed pack's data file that no
index names used to stay, so on a nearly full disk the free-space check refused every pack
after them, and nothing ever removed them. They count as free now and go first; a data file
whose index.json could not be written goes with that failure (unless the old index names
it); and the refusal says its sizes in a unit that shows them."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")

from checkpoint_folders import saved_folder
from stmoe.runtime.store import (
    ExpertStore,
    StoreError,
    pack,
    pack_folder,
    packing,
)
from stmoe.runtime.store.folder import named_data
from stmoe.util.units import format_bytes
from tiny_moe import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return saved_folder("mixtral", tmp_path_factory.mktemp("model"))


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def _nearly_full(monkeypatch, free: int) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".pack.lock"}


def test_a_killed_and_a_failed_packs_leftovers_count_as_free_and_go(checkpoint, tmp_path,
                                                                    monkeypatch):
    out = pack_folder(checkpoint, tmp_path / "store")
    size = ExpertStore(out).data_path.stat().st_size
    killed = out / f".experts.bin.{_dead_pid()}.x1y2z3.tmp"  # a SIGKILLed pack's half
    orphan = out / "experts-0123456789abcdef.bin"  # a pack whose index.json failed
    killed.write_bytes(bytes(size // 2))
    orphan.write_bytes(bytes(size // 2 + 4096))
    _nearly_full(monkeypatch, free=4096)  # with the leftovers: just enough
    pack_folder(checkpoint, out)
    assert not killed.exists() and not orphan.exists()
    ExpertStore(out).check_source(checkpoint)
    with pytest.raises(StoreError) as caught:  # nothing left to reclaim: refused, sized
        pack_folder(checkpoint, out)
    said = str(caught.value)
    shown = format_bytes(size)  # (576 KiB: "0.0 GiB" before)
    assert size >= 2**10 and "0.0 GiB" not in said
    assert f"needs about {shown} and its disk has 4.0 KiB free" in said, said
    assert f"the store it replaces keeps its {shown} until the new one is whole" in said


def test_a_data_file_whose_index_could_not_be_written_goes_with_the_failure(tmp_path,
                                                                             monkeypatch):
    first, _ = tiny_model("mixtral")
    other, _ = tiny_model("qwen3_moe")
    out = pack(first, tmp_path / "store")
    before = _files(out)

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(packing, "atomic_write_text", full)
    for model in (other, first):  # another store; the same one again (the same file name)
        with pytest.raises(OSError, match="No space left"):
            pack(model, out)
        assert _files(out) == before  # the old store whole, nothing of the new one left
        ExpertStore(out)
    with pytest.raises(OSError, match="No space left"):
        pack(other, tmp_path / "fresh")
    assert not any(p.name.startswith("experts") for p in (tmp_path / "fresh").iterdir())


def test_a_folder_this_user_cannot_write_is_said_before_the_free_space(checkpoint, tmp_path,
                                                                        monkeypatch):
    """(As root, a read-only folder is writable: the check is stood in for.)"""
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: mode != os.W_OK and real(path, mode))
    with pytest.raises(StoreError, match=r"is not writable by this user; pass --store"):
        pack_folder(checkpoint, tmp_path / "store")


# ---- a store opened while another process packs it again -----------------------------------
def test_an_open_store_reads_its_own_data_file_after_a_pack_replaced_it(tmp_path):
    """A reader holds the data file its index named: a pack that replaces the store (and
    removes that file) does not pull it from under the reader (it read "No such file")."""
    from stmoe.runtime.store.tiers import DiskTier

    first, _ = tiny_model("mixtral")
    out = pack(first, tmp_path / "store")
    opened = ExpertStore(out)
    want = opened.read(1, 3)
    pack(tiny_model("mixtral", seed=1)[0], out)  # another store in its place
    assert not opened.data_path.exists()
    got = opened.read(1, 3)
    assert all((got[k] == want[k]).all() for k in want)
    tier = DiskTier(opened, direct=False)
    try:
        assert os.fstat(tier.fd).st_ino != os.stat(ExpertStore(out).data_path).st_ino
    finally:
        tier.close()


def test_a_store_replaced_between_its_index_and_its_data_file_opens_the_new_one(tmp_path,
                                                                                monkeypatch):
    from stmoe.runtime.store import expert_store

    out = pack(tiny_model("mixtral")[0], tmp_path / "store")
    (tmp_path / "old").mkdir()
    shutil.copy(out / "index.json", tmp_path / "old" / "index.json")
    pack(tiny_model("mixtral", seed=1)[0], out)  # the old index's data file is gone
    real, calls = expert_store.read_index, []

    def stale_first(path):  # the index as it was when this process read it
        calls.append(path)
        return real(tmp_path / "old" / "index.json" if len(calls) == 1 else path)

    monkeypatch.setattr(expert_store, "read_index", stale_first)
    store = ExpertStore(out)
    assert len(calls) == 2 and store.index.data == named_data(out)  # read again, once
    store.read(0, 0)  # (CRC-checked)
    monkeypatch.setattr(expert_store, "read_index",
                        lambda path: real(tmp_path / "old" / "index.json"))
    with pytest.raises(StoreError, match=r"packed again twice while it was opened"):
        ExpertStore(out)


def test_a_first_use_beside_another_processs_pack_waits_and_uses_its_store(checkpoint,
                                                                           tmp_path,
                                                                           monkeypatch):
    """Two first uses of one model at once (two `stmoe generate`): the second waited for
    the first's pack, then packed the whole store again. It waits now before hashing the
    checkpoint, and uses the store the other wrote."""
    import threading

    from stmoe.errors import StmoeNote
    from stmoe.runtime.store.folder import pack_lock
    from stmoe.runtime.store.packing import default_store_dir, open_store

    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    made = pack_folder(checkpoint, tmp_path / "made")
    out = default_store_dir(checkpoint)
    out.mkdir(parents=True)
    holding, go_on = threading.Event(), threading.Event()

    def other_pack():  # another process's pack, in its lock
        with pack_lock(out):
            holding.set()
            go_on.wait(30)
            for name in (ExpertStore(made).index.data, "index.json"):
                shutil.copy(made / name, out / name)

    packer = threading.Thread(target=other_pack, daemon=True)
    packer.start()
    assert holding.wait(30)
    monkeypatch.setattr(packing, "pack_folder", lambda *a, **k: pytest.fail("packed again"))
    monkeypatch.setattr(packing, "file_records", lambda *a: pytest.fail("hashed again"))
    threading.Timer(0.3, go_on.set).start()
    with pytest.warns(StmoeNote, match="another process is packing this store; waiting"):
        opened = open_store(checkpoint, None)
    packer.join(30)
    assert opened.path == out and opened.index.data == ExpertStore(made).index.data


def test_a_cached_store_packed_beforehand_opens_without_its_lock(checkpoint, tmp_path,
                                                                 monkeypatch):
    """A cache packed beforehand may be read-only (a shared STMOE_CACHE): a usable store is
    opened without taking the folder's lock, which writes its lock file."""
    from stmoe.runtime.store.packing import open_store

    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    packed = open_store(checkpoint, None)  # packed on first use
    monkeypatch.setattr(packing, "pack_lock", lambda *a, **k: pytest.fail("locked"))
    assert open_store(checkpoint, None).index.data == packed.index.data
