"""Where a checkpoint holds each expert's bytes, from its own safetensors headers: what an
in-place index lists (``in_place_index``), and the check that it still lists exactly that.

The extents are derived, never trusted: ``planned_blocks`` maps every (layer, expert) to
its byte ranges by transformers' own loading rules (``pack_stream.CheckpointExperts``:
the fused ``gate_up_proj`` [N, 2I, H] holds expert e as the slice [e]; per-expert
``experts.{e}.gate_proj.weight`` then ``up_proj``, concatenated row-wise, the two
tensors whole) and the files' headers. ``check_extents`` derives them again when an
in-place index is opened with its folder and refuses any block that lists other bytes:
an index edited by hand (its checksum recomputed) cannot point a (layer, expert) at
another expert's bytes, the header, or anything else in the files.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stmoe.runtime.store.index import Block, Extent, StoreError, StoreIndex, TensorSlot
from stmoe.runtime.store.pack_stream import CheckpointExperts, StreamUnsupported, param_nbytes

MAX_HEADER = 100 << 20  # bytes: safetensors' own limit on a header


class NotInPlace(StoreError):
    """This checkpoint's experts are not byte ranges of its files; pack it instead."""


def check_extents(store: Path, index: StoreIndex, model_dir: Path) -> None:
    """Every block of in-place ``index`` lists exactly the bytes ``model_dir``'s headers
    give its (layer, expert), with the same tensors; else one StoreError naming the block.
    ``model_dir``'s files are the index's (``check.check_source`` ran first)."""
    again = f"make it again: stmoe pack {model_dir} -o {store} --in-place"
    try:
        experts = CheckpointExperts(model_dir)
    except StreamUnsupported as exc:
        raise StoreError(f"{store}: an in-place index of a checkpoint whose experts cannot be "
                         f"read one by one ({exc}); it cannot be checked: pack it") from None
    try:
        if experts.architecture != index.model:
            raise StoreError(f"{store}/index.json: made for {index.model}, {model_dir} holds "
                             f"{experts.architecture}; {again}")
        files = [model_dir / f[0] for f in index.source["files"]]
        for want in planned_blocks(experts, files):
            got = index.blocks[(want.layer, want.expert)]
            if (got.extents, got.tensors, got.nbytes) != (want.extents, want.tensors,
                                                          want.nbytes):
                raise StoreError(
                    f"{store}/index.json: layer {want.layer}, expert {want.expert} lists bytes "
                    f"{[list(e) for e in got.extents]}, where {model_dir}'s safetensors headers "
                    f"hold that expert at {[list(e) for e in want.extents]}; the index was "
                    f"edited or made for other files: {again}")
    finally:
        experts.release(force=True)


def planned_blocks(experts: Any, files: list[Path]) -> Iterator[Block]:
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
