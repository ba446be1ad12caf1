"""The expert store: deterministic, one checked read per expert, loud when damaged."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stmoe.model_introspect import experts_modules  # noqa: E402
from stmoe.runtime.store import ALIGN, ExpertStore, StoreError, pack  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    model, _ = tiny_model("mixtral")
    return model, pack(model, tmp_path_factory.mktemp("store"))


def test_blocks_hold_each_experts_weights_aligned(packed):
    model, path = packed
    store = ExpertStore(path)
    modules = experts_modules(model)
    assert len(store.blocks) == len(modules) * 8
    for (layer, expert), block in store.blocks.items():
        assert block.offset % ALIGN == 0
        tensors = store.read(layer, expert)
        for name, param in modules[layer][1].named_parameters(recurse=False):
            assert np.array_equal(tensors[name], param.detach()[expert].numpy())


def test_packing_twice_gives_the_same_bytes(packed, tmp_path):
    model, path = packed
    again = pack(model, tmp_path / "again")
    assert (again / "experts.bin").read_bytes() == (path / "experts.bin").read_bytes()
    assert (again / "index.json").read_text() == (path / "index.json").read_text()


def test_damage_and_mismatch_are_clear_errors(packed, tmp_path):
    model, path = packed
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "index.json").write_text((path / "index.json").read_text())
    data = bytearray((path / "experts.bin").read_bytes())
    data[10] ^= 0xFF
    (broken / "experts.bin").write_bytes(bytes(data))
    with pytest.raises(StoreError, match="layer 0, expert 0 fails its checksum"):
        ExpertStore(broken).read(0, 0)
    (broken / "experts.bin").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(StoreError, match="truncated"):
        ExpertStore(broken)
    with pytest.raises(StoreError, match="not an expert store"):
        ExpertStore(tmp_path)
    other, _ = tiny_model("qwen3_moe")
    ExpertStore(path).check_model(model)  # its own model passes
    with pytest.raises(StoreError, match="packed for"):
        ExpertStore(path).check_model(other)


def test_pack_command(cli, tmp_path):
    from stmoe.models import SHIPPED_MODEL

    result = cli("pack", SHIPPED_MODEL, "-o", tmp_path / "store")
    assert result.exit_code == 0, result.output
    store = ExpertStore(tmp_path / "store")
    assert len(store.blocks) == 8 * 16
    bad = cli("pack", tmp_path, "-o", tmp_path / "x")
    assert bad.exit_code == 1 and "no config.json" in bad.output
