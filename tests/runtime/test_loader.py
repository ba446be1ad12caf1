"""The one load path (runtime.store.loader), the options object and the model layout that
``stmoe.offload`` computes once: what the engine is handed is what it uses."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.hf.layout import ModelLayout  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.options import OffloadOptions  # noqa: E402
from stmoe.runtime.store import ExpertStore, pack  # noqa: E402
from stmoe.runtime.store.index import DTYPE_SIZES  # noqa: E402
from stmoe.runtime.store.loader import Loader  # noqa: E402
from stmoe.runtime.store.reading import open_tier  # noqa: E402
from stmoe.runtime.store.tiers import aligned_buffer, padded  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    model, _ = tiny_model("mixtral")
    store = ExpertStore(pack(model, tmp_path_factory.mktemp("loader") / "store"))
    return model, store


def _parts(block):
    """Slot-like memory, one uint8 array per tensor in block order (as a cache's slot)."""
    raw = np.zeros(padded(block), dtype=np.uint8)
    return [raw[t.offset : t.offset + int(np.prod(t.shape)) * DTYPE_SIZES[t.dtype]]
            for t in block.tensors]


@pytest.mark.parametrize("tier", ["disk", "emulated"])
def test_every_tier_brings_the_same_checked_bytes_into_a_slot(packed, tier):
    """In place (the disk) or fetched and copied (the emulated link): the same bytes, which
    are the block's as the store holds them."""
    _, store = packed
    source = open_tier(tier, store, "1GB" if tier == "emulated" else None, 0.0)
    try:
        loader = Loader(source, store)
        assert loader.tier.reads_in_place is (tier == "disk")
        for block in list(store.blocks.values())[:4]:
            buf = aligned_buffer(padded(block))
            want = loader.fetch(block, buf).numpy()[: block.nbytes].copy()
            parts = _parts(block)
            loader.fill_parts(block, parts, aligned_buffer(padded(block)))
            assert np.array_equal(np.concatenate(parts), want)
            assert block.nbytes == sum(p.nbytes for p in parts)
    finally:
        source.close()


def test_offload_takes_an_options_object_and_fields_by_name(packed, tmp_path):
    model, store = packed
    fresh, _ = tiny_model("mixtral")
    options = OffloadOptions(capacity=2, predictor="ondemand", policy="lfu")
    with offload(fresh, store.path, options, workers=0) as om:
        assert (om.config["capacity"], om.config["policy"], om.config["workers"]) == (2, "lfu", 0)
        # the layout offload found is the one the engine serves by
        assert isinstance(om.engine.layout, ModelLayout)
        assert [m for _, m in om.engine.layout.modules] == [
            m for _, m in ModelLayout.of(om.model).modules]
    with pytest.raises(OffloadError, match="unknown offload option 'capcity'; valid: capacity"):
        offload(model, store.path, capcity=2)
    with pytest.raises(OffloadError, match="options: expected an OffloadOptions, got int"):
        offload(model, store.path, 2)
    assert OffloadOptions().capacity == "50%"  # the default generate's --help shows
