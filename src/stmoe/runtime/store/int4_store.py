"""An int4 store's CPU layout: recorded when it is packed, reconciled when it is opened.

Why: torch's CPU int4 packing is not one layout (``quant.int4_layout``): a store packed on
an AVX512 machine and read as it is on an AVX2 one computes other weights, with no error.
So an int4 index records the layout of the CPU that packed it (``int4_layout``, store
version 6), and opening one made on another kind of CPU repacks each block into this
CPU's layout as it lands: in the bytes just read and checked, before anything computes
with them. That is ``ExpertStore.check_block`` / ``check_parts``, which every tier's read
passes (the disk's, into a buffer or straight into a cache slot; the emulated link's and
the pinned store's copies, once each), so the engine's compute path never sees the stored
layout. The repack is exact (values unpacked, packed again). A store of version 5 or older
does not say which layout it holds: it is assumed to be this CPU's, with a note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stmoe.errors import StmoeNote, StoreError
from stmoe.quant.formats import WeightFormat
from stmoe.runtime.store.index import Block, StoreIndex, TensorSlot
from stmoe.util.warn import warn

if TYPE_CHECKING:
    import torch

# The cost, measured (``Repack.block`` on one Qwen1.5-MoE expert's int4 matrices, gate_up
# [2816, 2048] and down [2048, 1408]: 4.33 MB packed; avx512 -> avx2, torch 2.13 CPU, 1
# thread, median of 20): 14.4 ms, so ~3.3 ms per MB. What each miss of a store made on
# another kind of CPU costs more, on the reading thread, until it is packed again here.
REPACK_MS_PER_MB = 3.3


def packing_layout(weights: WeightFormat) -> str | None:
    """What an index written now records: this CPU's int4 layout, for int4 stores only
    (native and int8 bytes are the same on every CPU)."""
    if weights.name != "int4":
        return None
    from stmoe.quant.int4_layout import cpu_layout

    return cpu_layout()


def int4_matrix(slot: TensorSlot) -> bool:
    """Whether a block's tensor holds CPU-packed int4 bytes (``NAME_qweight``, uint8
    ``[out, in / 2]``; its scales and any bias are the same on every CPU)."""
    return slot.name.endswith("_qweight") and slot.dtype == "uint8" and len(slot.shape) == 2


@dataclass(frozen=True)
class Repack:
    """Between a store's int4 layout (``stored``) and this CPU's (``here``)."""

    stored: str
    here: str

    def to_here(self, packed: torch.Tensor) -> torch.Tensor:
        """A stored int4 matrix as this CPU's kernel reads it."""
        from stmoe.quant.int4_layout import pack_cpu_int4, unpack_cpu_int4

        return pack_cpu_int4(unpack_cpu_int4(packed, self.stored), self.here)

    def to_stored(self, packed: torch.Tensor) -> torch.Tensor:
        """A matrix packed here as the store holds it (to compare with its bytes)."""
        from stmoe.quant.int4_layout import pack_cpu_int4, unpack_cpu_int4

        return pack_cpu_int4(unpack_cpu_int4(packed, self.here), self.stored)

    def block(self, block: Block, views: list[memoryview]) -> None:
        """``block``'s int4 matrices repacked in place in ``views`` (its bytes, checked, end
        to end in one or more writable buffers: a read buffer, a cache slot's tensors)."""
        import torch

        starts, at = [], 0
        for v in views:
            if v.readonly:  # (every tier reads into memory of its own)
                raise StoreError(f"layer {block.layer}, expert {block.expert}: its int4 "
                                 "bytes must be repacked, but were read into read-only memory")
            starts.append(at)
            at += v.nbytes
        for slot in block.tensors:
            if not int4_matrix(slot):
                continue
            lo, hi = slot.offset, slot.offset + slot.shape[0] * slot.shape[1]
            pieces = [(max(lo, s), min(hi, s + v.nbytes), s, v)
                      for s, v in zip(starts, views, strict=True) if s < hi and lo < s + v.nbytes]
            held = [torch.frombuffer(v, dtype=torch.uint8)[a - s : b - s]
                    for a, b, s, v in pieces]
            new = self.to_here(torch.cat(held).reshape(slot.shape)).reshape(-1)
            for (a, b, _, _), dest in zip(pieces, held, strict=True):
                dest.copy_(new[a - lo : b - lo])


def reconcile(path: Path, index: StoreIndex) -> Repack | None:
    """An int4 store opened here: the ``Repack`` its blocks need, or None (not int4, or in
    this CPU's layout). Made elsewhere: a note that each block is repacked as it is read;
    unrecorded (version 5 or older): a note that this CPU's layout is assumed."""
    if index.weights.name != "int4":
        return None
    from stmoe.quant.int4_layout import cpu_layout

    here, stored = cpu_layout(), index.int4_layout
    again = f"stmoe pack MODEL -o {path} --format int4 again on this machine"
    if stored is None:
        warn(f"{path}: this int4 store does not record the CPU layout its bytes "
             f"were packed in (packed before stmoe recorded it); assumed to be this "
             f"CPU's ({here}). If it was packed on another kind of CPU it computes "
             f"wrong weights here: run {again}", StmoeNote)
        return None
    if stored == here:
        return None
    first = index.blocks[min(index.blocks)]
    mb = sum(math.prod(t.shape) for t in first.tensors if int4_matrix(t)) / 1e6
    warn(f"{path}: int4 store packed on a CPU with the {stored} int4 layout, this "
         f"CPU reads {here}: each block is repacked as it is read (exact; about "
         f"{mb * REPACK_MS_PER_MB:.2g} ms per expert on one core); to save that, "
         f"run {again}", StmoeNote)
    return Repack(stored, here)
