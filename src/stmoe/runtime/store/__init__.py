"""The expert store and the tiers it is read through.

    index.py         the index file: its fields, every entry checked, CRC-32C per block
    int4_store.py    an int4 store's CPU layout: recorded at pack, repacked at read elsewhere
    check.py         whether a store belongs to a model (shapes, weights, source files)
    expert_store.py  ``ExpertStore``: one checked ``pread`` per expert
    packing.py       packing (atomic), and the store a model folder uses by default
    pack_stream.py   packing one expert at a time from a checkpoint's safetensors shards
    folder.py        a store folder's lock and leftover data files (both index writers')
    in_place_index.py  an index reading a checkpoint's experts where its files hold them
    extents.py       an in-place index's extents derived again from the safetensors headers
    in_place.py      reading those extents (O_DIRECT, aligned spans): ``InPlaceTier``
    verify.py        ``stmoe pack --verify``: every block re-derived from the checkpoint
    tiers.py         where blocks are read from: the disk, an emulated link
    device_ops.py    what the GPU tiers ask of a device: pinning, async copies, events
    pinned.py        the store in pinned host memory, once per process (``--tier gpu``)
    bounce.py        disk -> GPU through a few pinned bounce buffers
    reading.py       ``open_tier``: which tier reads a store
    loader.py        ``Loader``: the one place the bytes of a block enter a cache slot
"""

from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.index import (
    ALIGN,
    STORE_FORMAT,
    STORE_VERSION,
    Block,
    StoreError,
    TensorSlot,
)
from stmoe.runtime.store.packing import (
    DATA_TEMP,
    ProgressFactory,
    default_store_dir,
    ensure_store,
    open_store,
    pack,
    pack_folder,
)

__all__ = ["ALIGN", "DATA_TEMP", "STORE_FORMAT", "STORE_VERSION", "Block", "ExpertStore",
           "ProgressFactory", "StoreError", "TensorSlot", "default_store_dir", "ensure_store",
           "open_store", "pack", "pack_folder"]
