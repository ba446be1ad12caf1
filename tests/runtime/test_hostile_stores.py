"""Stores and checkpoints as a hostile or unlucky user leaves them: an index.json no JSON
reader takes, a safetensors header that lies about one expert's dtype or shape (made
before or after an in-place index), a weight map sending a shard into a subfolder. Each
is one clear line naming the file, never a traceback or the wrong weights with exit 0."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from checkpoint_folders import saved_folder  # noqa: E402
from stmoe.runtime.store import ExpertStore, StoreError, pack_folder  # noqa: E402
from stmoe.runtime.store.in_place_index import NotInPlace, make_in_place  # noqa: E402

LIAR = "model.layers.1.block_sparse_moe.experts.3.w1.weight"  # not expert 0: read unchecked


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A per-expert checkpoint (save_pretrained's, as the hub's), never changed."""
    return saved_folder("mixtral", tmp_path_factory.mktemp("hostile") / "model")


def _lie(folder: Path, dest: Path, field: str, value) -> Path:
    """A copy of ``folder`` whose safetensors header says ``value`` for LIAR's ``field``
    (the header's length kept, so safetensors itself still reads the file); the shard's
    mtime kept, as a copy that keeps it would."""
    if not dest.exists():
        shutil.copytree(folder, dest)
    shard = dest / "model.safetensors"
    st = shard.stat()
    with open(shard, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        header[LIAR][field] = value
        text = json.dumps(header, separators=(",", ":")).encode()
        f.seek(8)
        f.write(text + b" " * (size - len(text)))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    return dest


def test_an_index_with_a_number_of_5000_digits_is_one_line(folder, tmp_path):
    store = pack_folder(folder, tmp_path / "store")
    path = store / "index.json"
    path.write_text(path.read_text().replace('"version": 6', '"version": ' + "9" * 5000))
    with pytest.raises(StoreError) as err:  # was Python's ValueError, naming no file
        ExpertStore(store)
    assert str(path) in str(err.value) and "not valid JSON" in str(err.value)


def test_a_header_lying_about_one_experts_dtype_is_never_read_in_place(folder, tmp_path):
    """I32 where the model's F32 is: transformers casts that expert's values, the bytes
    read in place would be taken as F32 (other weights than the resident model's)."""
    liar = _lie(folder, tmp_path / "liar", "dtype", "I32")
    with pytest.raises(NotInPlace, match=r"experts\.3\.w1\.weight is I32"):
        make_in_place(liar, tmp_path / "in-place")
    # an index made before the header changed (its mtime kept): refused at open
    honest = tmp_path / "honest"
    shutil.copytree(folder, honest)
    make_in_place(honest, tmp_path / "before")
    _lie(folder, honest, "dtype", "I32")
    with pytest.raises(StoreError, match="is I32") as err:
        ExpertStore(tmp_path / "before").check_source(honest)
    assert "\n" not in str(err.value)


def test_a_header_lying_about_one_experts_shape_is_one_line_naming_it(folder, tmp_path):
    liar = _lie(folder, tmp_path / "liar", "shape", [32, 64])  # its bytes' count kept
    for make in (pack_folder, make_in_place):  # was torch.cat's RuntimeError for the packer
        with pytest.raises(StoreError) as err:
            make(liar, tmp_path / f"out-{make.__name__}")
        msg = str(err.value)
        assert f"{liar / 'model.safetensors'}: tensor {LIAR} has shape [32, 64]" in msg, msg


def test_a_shard_in_a_subfolder_is_refused_naming_the_weight_map(folder, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    (moved / "sub").mkdir()
    (moved / "model.safetensors").rename(moved / "sub" / "model.safetensors")
    with open(moved / "sub" / "model.safetensors", "rb") as f:
        keys = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    weight_map = {k: "sub/model.safetensors" for k in keys if k != "__metadata__"}
    (moved / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for make in (pack_folder, make_in_place):  # were FileNotFoundError and KeyError
        with pytest.raises(StoreError, match=r"shard sub/model\.safetensors is not in "
                                             "the model folder itself"):
            make(moved, tmp_path / f"out-{make.__name__}")


def test_packing_over_a_folder_whose_index_json_is_someone_elses_is_refused(folder, tmp_path,
                                                                             cli):
    """`stmoe pack -o DIR` replaces a store in DIR; a DIR holding a user's own index.json
    (and data beside it) is refused and left as it was, by every writer (no lock file left
    in it either). A store's own is still replaced."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "index.json").write_text('{"mine": true}')
    (out / "experts.bin").write_bytes(b"my data")
    for extra in ((), ("--in-place",)):
        res = cli("pack", folder, "-o", out, *extra)
        said = " ".join(res.output.split())
        assert res.exit_code == 1 and "not an stmoe store's index" in said, said
        assert (out / "index.json").read_text() == '{"mine": true}'
        assert (out / "experts.bin").read_bytes() == b"my data"
    def reads(*args):
        raise AssertionError("the checkpoint was read before the folder was refused")

    for make in (pack_folder, make_in_place):  # the library's writers too, not the CLI alone
        with pytest.MonkeyPatch.context() as mp:  # refused before any expert is read
            mp.setattr("stmoe.runtime.store.pack_stream.CheckpointExperts", reads)
            mp.setattr("stmoe.runtime.store.in_place_index.CheckpointExperts", reads)
            with pytest.raises(StoreError, match="not an stmoe store's index"):
                make(folder, out)
        assert (out / "index.json").read_text() == '{"mine": true}'
        assert sorted(p.name for p in out.iterdir()) == ["experts.bin", "index.json"]
    store = tmp_path / "store"
    for _ in range(2):  # a store's own index: replaced
        res = cli("pack", folder, "-o", store)
        assert res.exit_code == 0, res.output
    assert ExpertStore(store).blocks
