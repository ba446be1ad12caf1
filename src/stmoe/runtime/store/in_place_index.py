"""The in-place index of a checkpoint: where each expert's bytes lie in its own files.

In a checkpoint's shards each expert's tensors lie as one or a few byte ranges
(fused ``gate_up_proj`` [N, 2I, H]: the slice [e]; per expert,
``experts.{e}.gate_proj.weight`` then ``up_proj``, which transformers concatenates
row-wise: the two tensors whole). ``make_in_place`` finds them from the files'
safetensors headers (``extents``, which checks them again whenever the index is opened
with its folder), checks expert 0 of every layer against safetensors' own reading
(transformers' operations applied), reads every expert once for its CRC-32C, and
writes a store's index.json with ``data: "checkpoint"`` (``in_place``). A checkpoint
whose experts are not byte ranges (an operation that interleaves them, a cast dtype)
is refused before anything is written: it is packed instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stmoe.quant.formats import NATIVE
from stmoe.runtime.store.check import check_unchanged, file_records
from stmoe.runtime.store.extents import NotInPlace, planned_blocks, tensor_spans
from stmoe.runtime.store.folder import pack_lock, refuse_foreign_index, remove_unnamed
from stmoe.runtime.store.in_place import ExtentReader
from stmoe.runtime.store.index import ALIGN, IN_PLACE, Block, index_text
from stmoe.runtime.store.pack_stream import CheckpointExperts, StreamUnsupported
from stmoe.runtime.store.tiers import CHUNK_BYTES, aligned_buffer

__all__ = ["NotInPlace", "make_in_place", "tensor_spans"]  # the derivation: ``extents``


def make_in_place(model_dir: str | Path, out_dir: str | Path,
                  progress: Any = None) -> Path:
    """Write ``out_dir``/index.json reading ``model_dir``'s experts in place (every expert
    read once for its CRC-32C, ``progress`` a byte bar as ``pack_folder``'s); returns
    ``out_dir``. Refused (``NotInPlace``) for a checkpoint whose experts are not byte
    ranges of its files, before anything is written."""
    from stmoe.util.fileio import atomic_write_text
    from stmoe.util.progress import byte_progress

    model_dir, out = Path(model_dir), Path(out_dir)
    refuse_foreign_index(out)  # before the experts are read (pack_lock checks it again)
    try:
        experts = CheckpointExperts(model_dir)
    except StreamUnsupported as exc:
        raise NotInPlace(f"{exc}; its experts cannot be read in place: pack it "
                         f"(stmoe pack {model_dir} -o DIR)") from None
    try:
        record = file_records(model_dir)
        files = [model_dir / f[0] for f in record["files"]]
        planned = list(planned_blocks(experts, files))
        _check_against_stream(experts, planned, files)
    finally:
        experts.release(force=True)
    reader = ExtentReader(files)
    blocks, scratch = [], np.frombuffer(aligned_buffer(CHUNK_BYTES + 2 * ALIGN), np.uint8)
    dest = np.empty(max(b.nbytes for b in planned), np.uint8)
    try:
        with (progress or byte_progress)(sum(b.nbytes for b in planned),
                                         f"indexing {model_dir.name}'s experts") as advance:
            for b in planned:
                crc = reader.read(b, [dest[: b.nbytes]], scratch, where=str(model_dir))
                blocks.append(dataclasses.replace(b, crc32c=crc))
                advance(b.nbytes)
    finally:
        reader.close()
    check_unchanged(model_dir, record, "indexed", "index it again")
    out.mkdir(parents=True, exist_ok=True)
    with pack_lock(out):
        total = sum(b.nbytes for b in blocks)
        atomic_write_text(out / "index.json", index_text(experts.architecture, record,
                                                         IN_PLACE, total, blocks, NATIVE))
        remove_unnamed(out, IN_PLACE)  # a packed store's data file here is not named now
    return out


def _check_against_stream(experts: Any, blocks: list[Block], files: list[Path]) -> None:
    """Expert 0 of every layer read through its extents equals safetensors' own reading of
    it (transformers' operations applied): the extents are the packer's bytes."""
    reader = ExtentReader(files, direct=False)
    try:
        for b in blocks:
            if b.expert:
                continue
            want = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                            for _, t in experts.tensors(b.layer, 0))
            got = np.empty(b.nbytes, np.uint8)
            reader.read(b, [got], None, where=str(experts.path))
            if got.tobytes() != want:
                raise NotInPlace(f"{experts.path}: layer {b.layer}'s experts are not laid out "
                                 "as the model reads them; pack the model instead")
    finally:
        reader.close()
