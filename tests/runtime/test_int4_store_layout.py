"""An int4 store records the CPU layout it was packed in (torch's int4 packing differs
between AVX512, AVX2 and plain builds: quant/int4_layout.py), and a store packed on another
kind of CPU is repacked as it is read: the resident int4 model's exact bits here, never
other weights with exit 0. A store of version 5 or older does not record it: opened as this
CPU's, with a note. The other CPU is torch forced to another capability in a child process
(``ATEN_CPU_CAPABILITY``), which packs the store as that machine would."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_quantized import _generate  # noqa: E402  (the same padded batch and outputs)

from stmoe.errors import StmoeNote  # noqa: E402
from stmoe.quant import parse_format  # noqa: E402
from stmoe.quant.experts import quantize_model  # noqa: E402
from stmoe.quant.int4_layout import cpu_layout, pack_cpu_int4, unpack_cpu_int4  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.store import ExpertStore, StoreError, pack, pack_folder  # noqa: E402
from stmoe.runtime.store.index import Block, TensorSlot, checksum, slot_bytes  # noqa: E402
from stmoe.runtime.store.int4_store import Repack  # noqa: E402
from stmoe.runtime.store.tiers import DiskTier  # noqa: E402
from stmoe.runtime.store.verify import verify_store  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

INT4 = parse_format("int4", 32)
# the layout another kind of CPU packs: the plain build's differs from AVX2's and AVX512's
OTHER = "default" if cpu_layout() != "default" else "avx2"

_CHILD = """
import sys, torch
from stmoe.quant import parse_format
from stmoe.runtime.store import pack_folder
pack_folder(sys.argv[1], sys.argv[2], weights=parse_format("int4", 32))
print(torch.backends.cpu.get_cpu_capability().lower())
"""


def _model() -> torch.nn.Module:
    """The tiny qwen3_moe with experts int4 in groups of 32 takes (as test_quantized's)."""
    return tiny_model("qwen3_moe", moe_intermediate_size=32)[0]


def _same(got, want) -> bool:
    return torch.equal(got[0], want[0]) and all(
        torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The model's folder, its int4 store packed here, one packed by torch forced to
    ``OTHER`` in a child process, and the resident int4 model's generation."""
    root = tmp_path_factory.mktemp("int4-layout")
    _model().save_pretrained(root / "model")
    here = pack_folder(root / "model", root / "here", weights=INT4)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": OTHER}
    run = subprocess.run([sys.executable, "-c", _CHILD, str(root / "model"), str(root / "other")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    child = run.stdout.split()[-1]
    if (child if child in ("avx512", "avx2") else "default") == cpu_layout():
        pytest.skip(f"torch here cannot pack another layout than {cpu_layout()}")
    return root / "model", here, root / "other", _generate(quantize_model(_model(), INT4))


def _index(store) -> dict:
    return json.loads((store / "index.json").read_text())


def _rewrite(store, dest, mutate):
    """A copy of ``store`` whose index went through ``mutate``, its checksum redone."""
    shutil.copytree(store, dest)
    index = _index(dest)
    mutate(index)
    index["checksum"] = checksum(index)
    (dest / "index.json").write_text(json.dumps(index))
    return dest


def test_a_packed_int4_store_records_this_cpus_layout(stores, tmp_path):
    folder, here, _, ref = stores
    index = _index(here)
    assert index["version"] == 6 and index["int4_layout"] == cpu_layout()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StmoeNote)  # its own CPU's store: nothing to say
        assert ExpertStore(here).repack is None
        with offload(folder, store=here, capacity=2, predictor="ondemand") as om:
            assert _same(_generate(om.model), ref)
    for fmt in ("native", "int8"):  # the same bytes on every CPU: nothing recorded
        store = pack(_model(), tmp_path / fmt, weights=parse_format(fmt))
        assert "int4_layout" not in _index(store)


def test_a_store_packed_on_another_cpu_is_repacked_as_it_is_read(stores):
    folder, here, other, ref = stores
    assert _index(other)["int4_layout"] == OTHER
    with pytest.warns(StmoeNote, match=rf"{other}: int4 store packed on a CPU with the "
                                       rf"{OTHER} int4 layout, this CPU reads {cpu_layout()}: "
                                       r"each block is repacked as it is read .* stmoe pack"):
        store = ExpertStore(other)
    assert store.repack == Repack(OTHER, cpu_layout())
    mine = ExpertStore(here)
    assert store.data_path.read_bytes() != mine.data_path.read_bytes()  # another layout
    for layer, expert in [(0, 0), (1, 3)]:  # read: this CPU's bytes, as packed here
        got, want = store.read(layer, expert), mine.read(layer, expert)
        assert all(got[n].tobytes() == want[n].tobytes() for n in want)
    block, tier, want = store.blocks[(1, 3)], DiskTier(store, direct=False), mine.read(1, 3)
    parts = [np.empty(slot_bytes(t), dtype=np.uint8) for t in block.tensors]
    try:  # straight into a slot's tensors (aligned ones, where O_DIRECT reads): repacked there
        assert tier.read_into(block, parts)
    finally:
        tier.close()
    assert b"".join(p.tobytes() for p in parts) == b"".join(
        want[t.name].tobytes() for t in block.tensors)
    with pytest.warns(StmoeNote, match="repacked as it is read"):
        assert verify_store(folder, other).repack is not None  # its bytes are the checkpoint's
        runs = [dict(store=other, capacity=2),  # the disk: misses into slots, and beyond them
                dict(store=other, capacity=2, tier="emulated", bandwidth="10GB/s")]
        for kw in runs:
            with offload(folder, predictor="ondemand", **kw) as om:
                assert _same(_generate(om.model), ref), kw
        # a model in memory: its experts' checksums compared in the store's layout
        with offload(_model(), other, capacity=2, format="int4", predictor="ondemand") as om:
            assert _same(_generate(om.model), ref)


def test_a_store_without_the_layout_is_assumed_this_cpus_with_a_note(stores, tmp_path):
    folder, here, _, ref = stores

    def older(index):
        del index["int4_layout"]
        index["version"] = 5

    old = _rewrite(here, tmp_path / "old", older)
    note = (rf"{old}: this int4 store does not record the CPU layout .* assumed to be this "
            rf"CPU's \({cpu_layout()}\).* stmoe pack MODEL -o .* again on this machine")
    with pytest.warns(StmoeNote, match=note), offload(folder, store=old, capacity=2,
                                                      predictor="ondemand") as om:
        assert _same(_generate(om.model), ref)


@pytest.mark.parametrize("change, why", [
    (lambda i: i.pop("int4_layout"), "int4_layout: 'None', expected one of avx512, avx2, default"),
    (lambda i: i.update(int4_layout="neon"), "int4_layout: 'neon', expected one of"),
    (lambda i: i.update(int4_layout=["avx2"]), "int4_layout: \"['avx2']\", expected"),
    (lambda i: i.update(version=5), "in a version 6 int4 store, none in others"),
])
def test_a_layout_field_out_of_place_is_refused_naming_it(stores, tmp_path, change, why):
    _, here, _, _ = stores
    bad = _rewrite(here, tmp_path / "bad", change)
    with pytest.raises(StoreError) as exc:
        ExpertStore(bad)
    msg = str(exc.value)
    assert "\n" not in msg and str(bad) in msg and why in msg, msg


def test_a_native_index_with_a_layout_is_refused(tmp_path):
    store = pack(_model(), tmp_path / "native")
    bad = _rewrite(store, tmp_path / "bad", lambda i: i.update(int4_layout=cpu_layout()))
    with pytest.raises(StoreError, match=r"int4_layout: .* in a version 6 int4 store, none in"):
        ExpertStore(bad)


def test_a_block_read_in_pieces_is_repacked_across_them():
    """A slot's tensors may land in several buffers: a matrix cut anywhere is repacked
    whole, and the bytes around it are left alone."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randint(0, 16, (64, 32), generator=gen, dtype=torch.int32)
    scale = torch.randint(0, 256, (40,), generator=gen, dtype=torch.uint8)  # left alone
    stored = pack_cpu_int4(values, OTHER)
    slots = (TensorSlot("bias", "uint8", (16,), 0),
             TensorSlot("down_proj_qweight", "uint8", (64, 16), 16),
             TensorSlot("down_proj_qscale", "uint8", tuple(scale.shape), 16 + 64 * 16))
    raw = torch.cat([torch.arange(16, dtype=torch.uint8), stored.reshape(-1), scale])
    block = Block(0, 0, 0, raw.numel(), 0, slots)
    for cuts in ([], [16, 16 + 64 * 16], [7, 500, 1030]):
        data = bytearray(raw.numpy().tobytes())
        edges = [0, *cuts, len(data)]
        views = [memoryview(data)[a:b] for a, b in itertools.pairwise(edges)]
        Repack(OTHER, cpu_layout()).block(block, views)
        out = torch.frombuffer(data, dtype=torch.uint8)
        assert torch.equal(out[:16], raw[:16]) and torch.equal(out[16 + 64 * 16 :], scale)
        moved = out[16 : 16 + 64 * 16].reshape(64, 16)
        assert torch.equal(unpack_cpu_int4(moved), values.to(torch.uint8)), cuts
