"""The in-place index of a checkpoint: where each expert's bytes lie in its own files.

In a checkpoint's shards each expert's tensors lie as one or a few byte ranges
(fused ``gate_up_proj`` [N, 2I, H]: the slice [e]; per expert,
``experts.{e}.gate_proj.weight`` then ``up_proj``, which transformers concatenates
row-wise: the two tensors whole). ``make_in_place`` finds them from the files'
safetensors headers, checks expert 0 of every layer against safetensors' own reading
(transformers' operations applied), reads every expert once for its CRC-32C, and
writes a store's index.json with ``data: "checkpoint"`` (``in_place``). A checkpoint
whose experts are not byte ranges (an operation that interleaves them, a cast dtype)
is refused before anything is written: it is packed instead.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stmoe.quant.formats import NATIVE
from stmoe.runtime.store.check import check_unchanged, file_records
from stmoe.runtime.store.folder import pack_lock, remove_unnamed
from stmoe.runtime.store.in_place import ExtentReader
from stmoe.runtime.store.index import (
    ALIGN,
    IN_PLACE,
    Block,
    Extent,
    StoreError,
    TensorSlot,
    index_text,
)
from stmoe.runtime.store.pack_stream import CheckpointExperts, StreamUnsupported, param_nbytes
from stmoe.runtime.store.tiers import CHUNK_BYTES, aligned_buffer

MAX_HEADER = 100 << 20  # bytes: safetensors' own limit on a header


class NotInPlace(StoreError):
    """This checkpoint's experts are not byte ranges of its files; pack it instead."""


def make_in_place(model_dir: str | Path, out_dir: str | Path,
                  progress: Any = None) -> Path:
    """Write ``out_dir``/index.json reading ``model_dir``'s experts in place (every expert
    read once for its CRC-32C, ``progress`` a byte bar as ``pack_folder``'s); returns
    ``out_dir``. Refused (``NotInPlace``) for a checkpoint whose experts are not byte
    ranges of its files, before anything is written."""
    from stmoe.util.fileio import atomic_write_text
    from stmoe.util.progress import byte_progress

    model_dir, out = Path(model_dir), Path(out_dir)
    try:
        experts = CheckpointExperts(model_dir)
    except StreamUnsupported as exc:
        raise NotInPlace(f"{exc}; its experts cannot be read in place: pack it "
                         f"(stmoe pack {model_dir} -o DIR)") from None
    try:
        record = file_records(model_dir)
        files = [model_dir / f[0] for f in record["files"]]
        planned = list(_planned_blocks(experts, files))
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


def _planned_blocks(experts: Any, files: list[Path]) -> Iterator[Block]:
    """Each (layer, expert)'s block, its extents found in the files' headers (CRC 0)."""
    number = {f: i for i, f in enumerate(files)}
    headers: dict[Path, dict[str, tuple[int, int]]] = {}

    def span(f: Path, key: str) -> tuple[int, int]:
        if f not in headers:
            headers[f] = tensor_spans(f)
        return headers[f][key]

    for layer, params in enumerate(experts.layers):
        for expert in range(experts.num_experts):
            extents: list[Extent] = []
            slots, inner = [], 0
            for p in params:
                nbytes = param_nbytes(p)
                for f, start, n in _param_pieces(p, expert, nbytes, experts.num_experts,
                                                 span):
                    extents.append(Extent(number[f], start, n))
                slots.append(TensorSlot(p.name, str(p.dtype).removeprefix("torch."),
                                        tuple(p.shape), inner))
                inner += nbytes
            yield Block(layer, expert, -1, inner, 0, tuple(slots), _merged(extents))


def _param_pieces(p: Any, expert: int, nbytes: int, num_experts: int,
                  span: Callable[[Path, str], tuple[int, int]]) -> list[tuple[Path, int, int]]:
    """Where ``expert``'s slice of parameter ``p`` lies: (file, offset, nbytes) pieces."""
    if p.fused is not None:
        f, key = p.fused
        start, end = span(f, key)
        if end - start != num_experts * nbytes:
            raise NotInPlace(f"{f}: tensor {key} is not its experts' slices end to end")
        return [(f, start + expert * nbytes, nbytes)]
    from transformers.core_model_loading import Concatenate

    ops = list(p.converter.operations)[1:]  # the first stacks experts (pack_stream checked it)
    if any(type(op) is not Concatenate or op.dim != 1 for op in ops):
        raise NotInPlace(f"{p.full} is built by {ops}, which interleaves its tensors' bytes; "
                         "its experts cannot be read in place: pack it")
    pieces = []
    for pattern in p.converter.source_patterns:  # concatenated in this order (checked after)
        f, key = p.pieces[pattern][expert]
        start, end = span(f, key)
        pieces.append((f, start, end - start))
    if sum(n for _, _, n in pieces) != nbytes:
        raise NotInPlace(f"{p.full}: its checkpoint tensors hold other than one expert's "
                         "bytes; pack it")
    return pieces


def _merged(extents: list[Extent]) -> tuple[Extent, ...]:
    """Extents that continue one another in one file as one."""
    out: list[Extent] = []
    for e in extents:
        last = out[-1] if out else None
        if last is not None and last.file == e.file and last.offset + last.nbytes == e.offset:
            out[-1] = Extent(e.file, last.offset, last.nbytes + e.nbytes)
        else:
            out.append(e)
    return tuple(out)


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


def tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) bytes in a safetensors file (its header, checked)."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= MAX_HEADER:
            raise NotInPlace(f"{path}: not a safetensors file (header size {size})")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise NotInPlace(f"{path}: its safetensors header is not JSON") from None
    base, total = 8 + size, path.stat().st_size
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        if not 0 <= lo <= hi <= total - base:
            raise NotInPlace(f"{path}: tensor {key}'s bytes run past the file")
        out[key] = (base + lo, base + hi)
    return out
