"""Experts read in place from the checkpoint's safetensors: the packed store's bytes, with
no second copy on disk, and refused as loudly as a damaged store.

Every layout stmoe reads from disk (fused experts over several shards, per-expert
tensors, the shipped model) is indexed in place and each block compared with the
packed store's bytes; the offloaded model reading in place gives the resident model's
bits; a damaged index, a checkpoint changed after it was indexed, and the tiers and
formats that cannot read in place are refused with one clear line.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from checkpoint_folders import FOLDERS, make_model_folder, saved_folder  # noqa: E402
from refused_o_direct import refuse_o_direct_reads  # noqa: E402
from stmoe.errors import OffloadError  # noqa: E402
from stmoe.hf.layout import experts_modules  # noqa: E402
from stmoe.hf.loading import load_causal_lm  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.options import top_k_of  # noqa: E402
from stmoe.runtime.store import ExpertStore, StoreError, open_store, pack_folder  # noqa: E402
from stmoe.runtime.store.in_place import InPlaceTier  # noqa: E402
from stmoe.runtime.store.in_place_index import NotInPlace, make_in_place  # noqa: E402
from stmoe.runtime.store.index import IN_PLACE, checksum  # noqa: E402
from stmoe.runtime.store.reading import open_tier  # noqa: E402
from stmoe.runtime.store.tiers import aligned_buffer, buffer_bytes  # noqa: E402


def _tier_bytes(tier: InPlaceTier, block) -> bytes:
    """One block through the runtime's two ways in: a slot's parts, and ``fetch``."""
    buf = aligned_buffer(buffer_bytes(block))
    parts = [np.zeros(t.nbytes, np.uint8) for t in _slots(block)]
    assert tier.read_into(block, parts, buf=buf)
    fetched = tier.fetch(block, aligned_buffer(buffer_bytes(block))).numpy().tobytes()
    assert b"".join(p.tobytes() for p in parts) == fetched
    return fetched


def _slots(block):
    from stmoe.runtime.cache import param_specs

    return param_specs(block)


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_in_place_reads_are_the_packed_stores_bytes(kind, tmp_path, monkeypatch):
    from stmoe.runtime.store import tiers

    folder = FOLDERS[kind](tmp_path / "model")
    if len(kind) % 2:  # pieces of a few pages: the chunking and the spans' edges exercised
        monkeypatch.setattr(tiers, "CHUNK_BYTES", 3 * 4096)
        import stmoe.runtime.store.in_place as in_place

        monkeypatch.setattr(in_place, "CHUNK_BYTES", 3 * 4096)
    packed = ExpertStore(pack_folder(folder, tmp_path / "packed"))
    index = make_in_place(folder, tmp_path / "in-place")
    assert sorted(p.name for p in index.iterdir()) == [".pack.lock", "index.json"]  # no data
    store = ExpertStore(index)
    assert store.in_place and store.data_path is None
    store.check_source(folder)
    assert store.index.data_bytes == sum(b.nbytes for b in packed.blocks.values())
    tier = open_tier("disk", store, None, 0.0)
    try:
        for key, want in packed.blocks.items():
            got = store.blocks[key]
            assert (got.nbytes, got.crc32c, got.tensors) == (want.nbytes, want.crc32c,
                                                             want.tensors), key
            raw = packed.read(*key)
            assert _tier_bytes(tier, got) == b"".join(raw[t.name].tobytes()
                                                       for t in want.tensors), key
            assert all(np.array_equal(a, raw[n]) for n, a in store.read(*key).items())
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["made-qwen3_moe-bf16", "saved-mixtral", "shipped"])
def test_offloaded_in_place_is_the_resident_model_bit_for_bit(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    folder = FOLDERS[kind](tmp_path / "model")
    resident = load_causal_lm(folder)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        want = resident.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
    n = int(experts_modules(resident)[0][1].num_experts)
    for capacity in (top_k_of(resident.config), n):
        predictor = "oracle" if capacity < n else "ondemand"  # prefetch workers read too
        with offload(folder, capacity=capacity, in_place=True, predictor=predictor) as om:
            assert om.config["in_place"] and om.config["tier"] == "disk"
            assert "-in-place" in om.config["store"]
            (got, stats) = om.measure(lambda om=om: om.model.generate(
                ids, max_new_tokens=6, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0))
            assert torch.equal(got.sequences, want.sequences), capacity
            assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True))
            assert stats.bytes_moved > 0
    # made once: a second offload reuses the index (its mtime unchanged)
    index = next((tmp_path / "cache" / "stores").glob("*-in-place")) / "index.json"
    before = index.stat().st_mtime_ns
    with offload(folder, capacity=n, in_place=True, predictor="ondemand"):
        pass
    assert index.stat().st_mtime_ns == before


@pytest.fixture
def indexed(tmp_path):
    folder = make_model_folder("qwen3_moe", tmp_path / "model", "bfloat16")
    return folder, make_in_place(folder, tmp_path / "in-place")


def _rewrite(index_dir, change) -> None:
    """Change the index and recompute its checksum: a hand-made index, not a damaged one."""
    path = index_dir / "index.json"
    index = json.loads(path.read_text())
    change(index)
    index["checksum"] = checksum(index)
    path.write_text(json.dumps(index))


BAD_INDEXES = {
    "extent past its file": (lambda i: i["blocks"][3]["extents"][0].__setitem__(
        1, i["source"]["files"][i["blocks"][3]["extents"][0][0]][1]), "run past checkpoint file"),
    "unknown file": (lambda i: i["blocks"][0]["extents"][0].__setitem__(0, 99),
                     "expected [file, offset, nbytes]"),
    "overlap": (lambda i: i["blocks"][1].__setitem__("extents", i["blocks"][0]["extents"]),
                "overlap another block's"),
    "short extents": (lambda i: i["blocks"][2]["extents"][-1].__setitem__(
        2, i["blocks"][2]["extents"][-1][2] - 2), "but its extents hold"),
    "an offset as a packed block": (lambda i: i["blocks"][0].__setitem__("offset", 0),
                                    "expected an object with keys"),
    "quantized": (lambda i: i.__setitem__("weights", {"name": "int8", "group_size": None}),
                  "in-place index"),
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_a_damaged_or_hand_made_index_is_refused_naming_the_entry(case, indexed):
    _, index_dir = indexed
    change, words = BAD_INDEXES[case]
    _rewrite(index_dir, change)
    with pytest.raises(StoreError, match="damaged") as err:
        ExpertStore(index_dir)
    assert words in str(err.value) and str(index_dir) in str(err.value)


def _crc_of(folder, index: dict, extents: list) -> int:
    """The CRC-32C of the bytes ``extents`` name (what a forger recomputes)."""
    from stmoe.runtime.store.index import block_crc

    crc = 0
    for file, offset, nbytes in extents:
        with open(folder / index["source"]["files"][file][0], "rb") as f:
            crc = block_crc(os.pread(f.fileno(), nbytes, offset), crc)
    return crc


def _swapped(folder, index: dict) -> None:
    """Blocks (1, 2) and (1, 5) trade extents and CRC-32Cs: no byte overlaps, every read
    passes its checksum, each expert serves the other's weights."""
    one, two = (next(b for b in index["blocks"] if (b["layer"], b["expert"]) == (1, e))
                for e in (2, 5))
    for key in ("extents", "crc32c"):
        one[key], two[key] = two[key], one[key]


def _header(folder, index: dict) -> None:
    """Block (0, 3)'s first 64 bytes read from the file's safetensors header instead."""
    b = next(b for b in index["blocks"] if (b["layer"], b["expert"]) == (0, 3))
    (file, offset, nbytes), *rest = b["extents"]
    b["extents"] = [[file, 0, 64], [file, offset + 64, nbytes - 64], *rest]
    b["crc32c"] = _crc_of(folder, index, b["extents"])


@pytest.mark.parametrize("forge", [_swapped, _header], ids=["swapped", "header"])
def test_a_forged_index_is_refused_where_the_checkpoint_says_otherwise(indexed, forge, cli):
    """Sound on its own terms (checksum recomputed, no overlap, each CRC-32C its bytes'), so
    only the checkpoint's headers can tell: the extents are derived again at open."""
    folder, index_dir = indexed
    _rewrite(index_dir, lambda i: forge(folder, i))
    store = ExpertStore(index_dir)
    with pytest.raises(StoreError) as err:
        store.check_source(folder)
    msg = str(err.value)
    where = "layer 1, expert 2" if forge is _swapped else "layer 0, expert 3"
    assert f"{where} lists bytes" in msg and "safetensors headers hold that expert" in msg
    assert "\n" not in msg and str(index_dir) in msg
    with pytest.raises(StoreError, match="safetensors headers"):
        offload(folder, index_dir, capacity="100%", predictor="ondemand")
    result = cli("pack", str(folder), "-o", str(index_dir), "--verify")
    assert result.exit_code == 1 and "safetensors headers" in result.output


def test_verify_proves_an_in_place_index(indexed, cli):
    folder, index_dir = indexed
    result = cli("pack", str(folder), "-o", str(index_dir), "--verify")
    assert result.exit_code == 0 and "every block of this in-place index" in result.output


def test_one_flipped_byte_of_the_index_fails_its_checksum(indexed):
    _, index_dir = indexed
    path = index_dir / "index.json"
    text = path.read_text()
    path.write_text(text.replace('"crc32c": ', '"crc32c": 1', 1))
    with pytest.raises(StoreError, match="fails its checksum"):
        ExpertStore(index_dir)


def test_a_checkpoint_changed_after_indexing_is_refused(indexed):
    folder, index_dir = indexed
    store = ExpertStore(index_dir)
    block = store.blocks[(1, 3)]
    shard = folder / store.index.source["files"][block.extents[0].file][0]
    st = shard.stat()
    with open(shard, "r+b") as f:  # one expert byte flipped, the size kept
        f.seek(block.extents[0].offset + 100)
        byte = f.read(1)
        f.seek(block.extents[0].offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    # a new mtime: the checkpoint is hashed again and refused before any token
    with pytest.raises(StoreError, match="other weights"):
        ExpertStore(index_dir).check_source(folder)
    # the same mtime (a copy that kept it): the read itself fails the block's checksum
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    store = ExpertStore(index_dir)
    store.check_source(folder)
    _refused_read(store, block, f"layer {block.layer}, expert {block.expert} fails the "
                                "in-place index's checksum")


def test_a_truncated_checkpoint_is_a_short_read_naming_the_file(indexed):
    folder, index_dir = indexed
    store = ExpertStore(index_dir)
    store.check_source(folder)
    last = max(store.blocks.values(), key=lambda b: (b.extents[-1].file, b.extents[-1].offset))
    shard = store.checkpoint_files()[last.extents[-1].file]
    os.truncate(shard, last.extents[-1].offset + 10)
    _refused_read(store, last, f"{shard.name}: short read")


def _refused_read(store: ExpertStore, block, words: str) -> None:
    """The disk tier's read of ``block`` fails with a StoreError saying ``words``."""
    tier = open_tier("disk", store, None, 0.0)
    try:
        with pytest.raises(StoreError, match=words):
            tier.fetch(block, aligned_buffer(buffer_bytes(block)))
    finally:
        tier.close()


def test_what_cannot_read_in_place_is_refused_in_one_line(indexed, tmp_path):
    folder, index_dir = indexed
    store = ExpertStore(index_dir)
    with pytest.raises(StoreError, match="offload the model folder"):  # source not matched
        store.checkpoint_files()
    store.check_source(folder)
    for tier in ("emulated", "gpu"):
        with pytest.raises(OffloadError, match="read from the disk tier"):
            open_tier(tier, store, "1GB" if tier == "emulated" else None, 0.0)
    with pytest.raises(OffloadError, match="tier disk or gpu-disk and format native only"):
        offload(folder, in_place=True, format="int4")
    with pytest.raises(OffloadError, match="tier disk or gpu-disk and format native only"):
        offload(folder, in_place=True, tier="emulated", bandwidth="1GB")
    with pytest.raises(OffloadError, match="offload the folder, not a loaded model"):
        offload(load_causal_lm(folder), in_place=True)
    with pytest.raises(StoreError, match="cannot be read in place"):
        open_store(folder, None, weights=__import__("stmoe.quant", fromlist=["x"])
                   .parse_format("int8"), in_place=True)
    packed = pack_folder(folder, tmp_path / "packed")  # asked in place, given a packed store
    with pytest.raises(StoreError, match="a packed store, not an in-place index"):
        open_store(folder, packed, in_place=True)
    model = load_causal_lm(folder)  # an in-place index given with a model in memory
    with pytest.raises(StoreError, match="a model in memory cannot use it"):
        offload(model, index_dir)


def test_a_checkpoint_whose_experts_are_not_byte_ranges_is_refused(tmp_path):
    """A cast dtype: the experts' bytes on disk are not the model's, so nothing is written."""
    folder = saved_folder("mixtral", tmp_path / "model")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "bfloat16"  # float32 tensors that transformers would cast
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotInPlace, match="cannot be read in place: pack it"):
        make_in_place(folder, tmp_path / "in-place")
    assert not (tmp_path / "in-place").exists()


def test_the_cli_indexes_in_place_and_generate_says_so(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    folder = make_model_folder("qwen2_moe", tmp_path / "model", "bfloat16")
    got = cli("pack", str(folder), "-o", str(tmp_path / "ix"), "--in-place")
    assert got.exit_code == 0, got.output
    assert "read in place from" in got.output and (tmp_path / "ix" / "index.json").exists()
    assert json.loads((tmp_path / "ix" / "index.json").read_text())["data"] == IN_PLACE
    got = cli("pack", str(folder), "-o", str(tmp_path / "q"), "--in-place", "--format", "int4")
    assert got.exit_code != 0 and "packed (leave out --in-place)" in got.output
    for where in (["--store", str(tmp_path / "ix")], ["--in-place"]):
        got = cli("generate", "--model", str(folder), *where, "--predictor", "ondemand",
                  "--prompt", "hello", "--max-new-tokens", "3", "--capacity", "50%")
        assert got.exit_code == 0, got.output
        assert "read in place from the checkpoint" in got.output
    assert list((tmp_path / "cache" / "stores").glob("*-in-place/index.json"))
    shutil.rmtree(tmp_path / "ix")


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_in_place_reads_fall_back_where_o_direct_reads_are_refused(indexed, monkeypatch):
    """Every checkpoint file opens with O_DIRECT but its reads fail (EINVAL): the reader
    opens them all plainly and brings the same checked bytes."""
    folder, index = indexed
    store = ExpertStore(index)
    store.check_source(folder)
    plain = InPlaceTier(store)
    try:
        want = {key: _tier_bytes(plain, b) for key, b in list(store.blocks.items())[:3]}
    finally:
        plain.close()
    tried = refuse_o_direct_reads(monkeypatch)
    tier = InPlaceTier(store)
    try:
        assert len(tried) >= 1 and not tier.reader.direct
        for key, block in list(store.blocks.items())[:3]:
            assert _tier_bytes(tier, block) == want[key], key
    finally:
        tier.close()
