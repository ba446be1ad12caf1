"""``stmoe pack MODEL_DIR -o STORE --verify``: proof that a store is what packing that
checkpoint gives, for what the checks at open cannot prove.

Opening a store proves the index is sound and (``index.placement``) that each block
sits where packing puts its (layer, expert), so an index edited alone cannot swap two
experts; an in-place index's extents are derived again from the checkpoint's headers
(``extents``). What opening cannot prove without reading every expert is that a packed
data file's bytes are the checkpoint's: someone who swaps two blocks' bytes in the data
file AND their CRC-32Cs in the index (its checksum recomputed) has a store that opens
and serves other weights. ``verify_store`` re-derives every block from the checkpoint
(read, and quantized in the store's format, as a pack does), hashes every checkpoint
file again (no size-and-mtime shortcut), and compares: each block's tensors, size,
CRC-32C and bytes in the data file. It writes nothing. The cost is one pack's read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stmoe.runtime.store.check import file_records
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.index import StoreError, block_crc
from stmoe.runtime.store.pack_stream import CheckpointExperts, StreamUnsupported
from stmoe.runtime.store.packing import ProgressFactory, block_bytes, quantized_blocks


def verify_store(model_dir: str | Path, store_dir: str | Path,
                 progress: ProgressFactory | None = None) -> ExpertStore:
    """``store_dir`` opened and proven to be ``model_dir``'s (module docstring), or one
    StoreError naming the first block or file that differs."""
    from stmoe.util.progress import byte_progress

    model_dir = Path(model_dir)
    store = ExpertStore(store_dir)
    store.check_source(model_dir)  # names and sizes; an in-place index's extents
    record = file_records(model_dir)  # every file hashed again
    recorded = [[name, size, sha] for name, size, _, sha in store.index.source["files"]]
    if [[name, size, sha] for name, size, _, sha in record["files"]] != recorded:
        raise StoreError(f"{store.path}: packed from other files than {model_dir}'s "
                         "(their SHA-256 differ); pack it again")
    total = sum(b.nbytes for b in store.blocks.values())
    with (progress or byte_progress)(total, f"verifying {store.path.name}") as advance:
        if store.in_place:  # the extents are the checkpoint's: their bytes must match
            for layer, expert in sorted(store.blocks):
                store.read(layer, expert)  # its CRC-32C checked
                advance(store.blocks[(layer, expert)].nbytes)
            return store
        _compare_packed(store, model_dir, record, advance)
    return store


def _compare_packed(store: ExpertStore, model_dir: Path, record: dict[str, Any],
                    advance: Callable[[int], None]) -> None:
    """Every block of a packed store equal to the one packing ``model_dir`` gives."""
    try:
        experts = CheckpointExperts(model_dir)
    except StreamUnsupported as exc:
        raise StoreError(f"{model_dir}: its experts cannot be read one by one ({exc}), so "
                         "stmoe cannot verify a store of it; pack it again") from None
    if experts.architecture != store.model:
        raise StoreError(f"{store.path}: packed for {store.model}, {model_dir} holds "
                         f"{experts.architecture}; pack it again")
    assert store.data_path is not None
    fd = os.open(store.data_file, os.O_RDONLY)
    try:
        blocks = experts.blocks(record)
        if store.weights.quantized:  # the index's format, its group size resolved
            blocks = quantized_blocks(blocks, store.weights, experts.transposed)
        for layer, expert, tensors in blocks:
            if store.repack is not None:  # int4 packed on another kind of CPU: in its layout
                tensors = [(n, store.repack.to_stored(t) if n.endswith("_qweight") else t)
                           for n, t in tensors]
            blob, slots = block_bytes(tensors)
            del tensors
            b = store.blocks[(layer, expert)]
            same = (b.tensors == slots and b.nbytes == len(blob)
                    and b.crc32c == block_crc(blob)
                    and os.pread(fd, len(blob), b.offset) == blob)
            if not same:
                raise StoreError(f"{store.path}: layer {layer}, expert {expert} is not what "
                                 f"packing {model_dir} gives (its entry or its bytes differ): "
                                 "the store was edited or damaged; pack it again")
            advance(len(blob))
    finally:
        os.close(fd)
        experts.release(force=True)
