"""The plugin's kernel-layout store (stmoe.vllm_plugin.kernel_store) against a damaged
block: inside vLLM a step computes every request together, so a block that does not read
would stop vLLM's engine. At the start every block is read once: the plugin's own store is
packed again, a store given as ``store=`` refused naming the block; one damaged after the
start fails the step with what to do about it. Needs no vLLM: the layers are stand-ins with
vLLM's attribute names."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from stmoe.errors import BlockError
from stmoe.runtime.store import StoreError
from stmoe.runtime.store.expert_store import CORRUPT
from stmoe.vllm_plugin.kernel_store import first_damaged, open_or_pack
from stmoe.vllm_plugin.layers import MoeLayer
from stmoe.vllm_plugin.steps import Steps, TablesWatch

N_LAYERS, N_EXPERTS = 2, 4


class CPUFusedMOE:  # a stand-in named like vLLM's portable kernel
    isa = "vec"


def fake_layers(seed: int = 0) -> list[MoeLayer]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(N_LAYERS):
        module = SimpleNamespace(
            quant_method=SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=CPUFusedMOE())),
            w13_weight=torch.nn.Parameter(torch.randn(N_EXPERTS, 8, 4, generator=g),
                                          requires_grad=False),
            w2_weight=torch.nn.Parameter(torch.randn(N_EXPERTS, 4, 4, generator=g),
                                         requires_grad=False),
            hidden_size=4, global_num_experts=N_EXPERTS)
        out.append(MoeLayer(f"model.layers.{i}.mlp.experts", module, None, i))
    return out


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"x": torch.zeros(2)}, str(d / "model.safetensors"))
    return d


def damage(store: Path, layer: int, expert: int) -> None:
    """One byte of (layer, expert)'s block flipped in the data file."""
    index = json.loads((store / "index.json").read_text())
    block = next(b for b in index["blocks"] if (b["layer"], b["expert"]) == (layer, expert))
    with open(store / index["data"], "r+b") as f:
        f.seek(block["offset"] + 10)
        byte = f.read(1)[0]
        f.seek(block["offset"] + 10)
        f.write(bytes([byte ^ 0xFF]))


def test_the_plugins_own_store_damaged_is_packed_again_at_the_start(tmp_path, model_dir,
                                                                    caplog):
    path, layers = tmp_path / "cache-store", fake_layers()
    assert open_or_pack(path, layers, "qwen2_moe", model_dir, owned=True)[1]  # packed now
    store, packed = open_or_pack(path, layers, "qwen2_moe", model_dir, owned=True)
    assert not packed and first_damaged(store) is None  # intact: opened, every block read
    damage(path, 1, 2)
    assert isinstance(first_damaged(store), BlockError)
    logger = logging.getLogger("vllm.stmoe")  # (vLLM's own logger may not propagate)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.stmoe"):
            store, packed = open_or_pack(path, layers, "qwen2_moe", model_dir, owned=True)
    finally:
        logger.removeHandler(caplog.handler)
    assert packed
    assert ("layer 1, expert 2 fails its checksum; packing the plugin's store again"
            in caplog.text)
    assert "pack it again" not in caplog.text  # (`stmoe pack` cannot write this layout)
    assert first_damaged(store) is None
    for layer in layers:  # the very weights vLLM loaded, block by block
        for e in range(N_EXPERTS):
            got = store.read(layer.index, e)
            for name in ("w13_weight", "w2_weight"):
                want = getattr(layer.module, name)[e].numpy()
                assert got[name].tobytes() == want.tobytes()


def test_a_given_store_damaged_stops_the_start_naming_the_block(tmp_path, model_dir):
    path, layers = tmp_path / "given", fake_layers()
    open_or_pack(path, layers, "qwen2_moe", model_dir)
    damage(path, 0, 3)
    data = path / json.loads((path / "index.json").read_text())["data"]
    before = data.read_bytes()
    with pytest.raises(StoreError, match=r"layer 0, expert 3 fails its checksum.*store= is "
                       r"not the plugin's to replace: remove .*given \(the plugin packs it "
                       r"again at its next start\)") as caught:
        open_or_pack(path, layers, "qwen2_moe", model_dir, owned=False)
    assert CORRUPT not in str(caught.value)  # (`stmoe pack` cannot write this layout)
    assert data.read_bytes() == before  # not the plugin's: left as it was


def test_the_check_names_the_first_damaged_block_in_the_files_order(tmp_path, model_dir):
    path, layers = tmp_path / "store", fake_layers()
    store = open_or_pack(path, layers, "qwen2_moe", model_dir, owned=True)[0]
    order = sorted(store.blocks, key=lambda k: store.blocks[k].offset)
    damage(path, *order[-1])  # the last block alone: read ahead of its check, still found
    found = first_damaged(store)
    assert isinstance(found, BlockError) and (found.layer, found.expert) == order[-1]
    damage(path, *order[2])  # and an earlier one: that one is named
    found = first_damaged(store)
    assert isinstance(found, BlockError) and (found.layer, found.expert) == order[2]


def test_a_damaged_data_file_or_an_unreadable_block_is_damage_too(tmp_path, model_dir,
                                                                  monkeypatch):
    path, layers = tmp_path / "store", fake_layers()
    open_or_pack(path, layers, "qwen2_moe", model_dir, owned=True)
    data = path / json.loads((path / "index.json").read_text())["data"]
    with open(data, "r+b") as f:  # cut short: refused as the store opens, before any block
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(StoreError):
        open_or_pack(path, layers, "qwen2_moe", model_dir, owned=False)
    store, packed = open_or_pack(path, layers, "qwen2_moe", model_dir, owned=True)
    assert packed and first_damaged(store) is None
    real, bad = os.pread, store.blocks[(0, 1)].offset

    def failing(fd, nbytes, offset):  # a bad sector under layer 0's expert 1
        if offset == bad:
            raise OSError(5, "Input/output error")
        return real(fd, nbytes, offset)

    monkeypatch.setattr(os, "pread", failing)
    found = first_damaged(store)
    assert isinstance(found, BlockError) and (found.layer, found.expert) == (0, 1)
    assert "layer 0, expert 1 cannot be read (Input/output error)" in str(found)


def test_a_block_damaged_after_the_start_fails_the_step_saying_what_to_do(tmp_path):
    def run(*args, **kwargs):
        raise BlockError(f"{tmp_path}/experts.bin: layer 1, expert 2 fails its checksum; "
                         f"{CORRUPT}", 1, 2)

    for in_place, again in ((False, "packs it again at its next start"),
                            (True, "indexes the checkpoint again at its next start")):
        store = SimpleNamespace(path=tmp_path / "store", in_place=in_place)
        engine = SimpleNamespace(path=SimpleNamespace(run=run),
                                 state=SimpleNamespace(store=store))
        steps = Steps(None, engine, None, TablesWatch(None, lambda: None))
        forward = steps._layer_call(1)
        with pytest.raises(BlockError) as caught:
            forward(torch.zeros(1, 4), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.int64))
        assert (caught.value.layer, caught.value.expert) == (1, 2)
        assert str(caught.value).startswith(f"{tmp_path}/experts.bin: layer 1, expert 2 fails")
        assert (f"{tmp_path}/experts.bin: layer 1, expert 2 fails its checksum. Inside vLLM "
                "the step's requests are computed together, so the step fails with it: "
                f"remove {tmp_path / 'store'} and the plugin {again}") in str(caught.value)


def test_a_pack_the_disk_cannot_hold_is_refused_before_a_byte_is_written(tmp_path, model_dir,
                                                                        monkeypatch):
    import shutil

    layers = fake_layers()
    weights = sum(getattr(layer.module, w).data.nbytes for layer in layers
                  for w in ("w13_weight", "w2_weight"))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=weights // 2))
    with pytest.raises(StoreError, match=r"the store needs about .* and its disk has .* free; "
                       r"free some space or pass store= \(or STMOE_CACHE\) on another disk"):
        open_or_pack(tmp_path / "full", layers, "qwen2_moe", model_dir, owned=True)
    assert not (tmp_path / "full").exists()


def test_a_streamed_pack_the_disk_cannot_hold_is_refused_first(tmp_path, model_dir,
                                                              monkeypatch):
    """experts=stream: each layer holds one processed expert as the store is packed."""
    import shutil

    from stmoe.vllm_plugin.kernel_store import model_record
    from stmoe.vllm_plugin.streamed import open_or_pack_streamed

    layers = fake_layers()
    record = model_record(layers, "qwen2_moe")
    per_expert = 0
    for layer in layers:  # (vLLM's stand-in: one zero expert a layer)
        for w in ("w13_weight", "w2_weight"):
            one = getattr(layer.module, w).data[:1].clone()
            setattr(layer.module, w, torch.nn.Parameter(one, requires_grad=False))
            per_expert += one.nbytes
    needed = per_expert * N_EXPERTS
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=needed - 1))
    with pytest.raises(StoreError, match="pass store= \\(or STMOE_CACHE\\) on another disk"):
        open_or_pack_streamed(tmp_path / "s", layers, record, model_dir)
    assert not (tmp_path / "s").exists()
