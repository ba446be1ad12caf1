"""Experts read in place from a checkpoint's own safetensors: no second copy on disk.

A checkpoint bigger than RAM is also big on disk (28.6 GB for all of
Qwen1.5-MoE-A2.7B): packing it writes the experts a second time. They need not be
copied: in its shards each expert's tensors already lie as one or a few byte ranges,
which a small index lists (``in_place_index.make_in_place``: a store's index.json
with ``data: "checkpoint"``, each block's extents and CRC-32C, the files' sizes,
mtimes and SHA-256). ``InPlaceTier`` reads the extents with O_DIRECT: safetensors'
offsets are not page-aligned, so each piece's enclosing 4 KiB-aligned span is read
into the reading thread's buffer and its payload copied into the slot (one copy,
where a packed store's read lands in the slot directly), then the CRC-32C checked as
for a packed store. Only the native format and the disk tier: a quantized store's
bytes are not the checkpoint's, and the other tiers hold a data file in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stmoe.errors import BlockError, OffloadError
from stmoe.runtime.store.index import (
    ALIGN,
    Block,
    Extent,
    block_crc,
)
from stmoe.runtime.store.tiers import CHUNK_BYTES, Between, open_direct

if TYPE_CHECKING:
    from stmoe.runtime.store.expert_store import ExpertStore


class ExtentReader:
    """Reads blocks' extents from checkpoint files: page-aligned O_DIRECT spans into a
    scratch buffer where the file system allows it, else plain reads straight into the
    destination with the pages dropped after (the page cache keeps no copy either way).
    Safetensors' offsets are not page-aligned, so with O_DIRECT every piece is copied from
    the scratch buffer into its destination (docs/runtime.md says why no slot is placed
    to take the read itself)."""

    def __init__(self, files: list[Path], direct: bool = True) -> None:
        self.files = files
        self.fds: list[int] = []
        self.direct = direct and self._open_direct()
        if not self.direct:  # one file refused: all read plainly
            try:
                self.fds.extend(os.open(f, os.O_RDONLY) for f in self.files)
            except BaseException:
                self.close()
                raise

    def _open_direct(self) -> bool:
        """Every file opened with O_DIRECT and its reads tried (``open_direct``), or none."""
        for f in self.files:
            fd = open_direct(f)
            if fd is None:
                self.close()
                return False
            self.fds.append(fd)
        return True

    def read(self, block: Block, dests: list[np.ndarray], scratch: np.ndarray | None,
             where: str, between: Between = None) -> int:
        """``block``'s payload into ``dests`` (uint8 arrays laid end to end), in pieces of at
        most CHUNK_BYTES, ``between()`` before each after the first; its CRC-32C.
        ``scratch``: an aligned buffer of CHUNK_BYTES + 2 ALIGN (O_DIRECT only)."""
        crc, pos = 0, 0
        for i, (e, start, n) in enumerate(_pieces(block.extents, CHUNK_BYTES)):
            if i and between is not None:
                between()
            fd, name = self.fds[e.file], self.files[e.file]
            try:
                if self.direct:
                    assert scratch is not None
                    lo = start - start % ALIGN
                    hi = -(-(start + n) // ALIGN) * ALIGN
                    got = os.preadv(fd, [memoryview(scratch[: hi - lo])], lo) - (start - lo)
                    src = scratch[start - lo : start - lo + n]
                    for dst, a, b in _targets(dests, pos, n):
                        np.copyto(dst, src[a:b])
                else:
                    views = [memoryview(d) for d, _, _ in _targets(dests, pos, n)]
                    got = os.preadv(fd, views, start)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
            except OSError as exc:
                raise BlockError(f"{name}: reading layer {block.layer}, expert "
                                 f"{block.expert} in place failed: {exc.strerror}",
                                 block.layer, block.expert) from None
            if got < n:
                raise BlockError(f"{name}: short read of layer {block.layer}, expert "
                                 f"{block.expert} ({where}: the file is shorter than the "
                                 "in-place index says; make it again)",
                                 block.layer, block.expert)
            for dst, _, _ in _targets(dests, pos, n):
                crc = block_crc(dst, crc)
            pos += n
        return crc

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _pieces(extents: tuple[Extent, ...], chunk: int) -> Iterator[tuple[Extent, int, int]]:
    """(extent, file offset, nbytes) pieces of at most ``chunk`` bytes, in payload order."""
    for e in extents:
        for s in range(0, e.nbytes, chunk):
            yield e, e.offset + s, min(chunk, e.nbytes - s)


def _targets(dests: list[np.ndarray], pos: int, n: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """The pieces of ``dests`` (end to end) that payload bytes [pos, pos + n) go to, each
    with the range of those ``n`` bytes it takes."""
    start = 0
    for d in dests:
        end = start + d.nbytes
        lo, hi = max(pos, start), min(pos + n, end)
        if lo < hi:
            yield d[lo - start : hi - start], lo - pos, hi - pos
        start = end


class InPlaceTier:
    """The disk tier of an in-place store: its blocks read where the checkpoint holds them."""

    name = "disk"
    emulated = False
    reads_in_place = True

    def __init__(self, store: ExpertStore) -> None:
        self.store = store
        self.chunk_bytes = CHUNK_BYTES
        self.reader = ExtentReader(store.checkpoint_files())
        self.direct = self.reader.direct
        self.drop_cache()

    def drop_cache(self) -> None:
        """Forget cached pages of the experts' bytes, so the next reads hit the device."""
        if hasattr(os, "posix_fadvise"):
            for block in self.store.blocks.values():
                for e in block.extents:
                    os.posix_fadvise(self.reader.fds[e.file], e.offset, e.nbytes,
                                     os.POSIX_FADV_DONTNEED)

    def fetch(self, block: Block, buf: Any, between: Between = None) -> torch.Tensor:
        """The block's checked bytes assembled at the start of ``buf`` (``buffer_bytes``)."""
        raw = np.frombuffer(buf, np.uint8)
        head = -(-block.nbytes // ALIGN) * ALIGN
        self._read(block, [raw[: block.nbytes]], raw[head:], between)
        return torch.frombuffer(buf, dtype=torch.uint8, count=block.nbytes)

    def read_into(self, block: Block, parts: list[np.ndarray], between: Between = None,
                  buf: Any = None) -> bool:
        """``block`` into ``parts`` (a slot's tensors, block order), checked; ``buf`` the
        reading thread's buffer (the aligned spans land there). False without one."""
        if buf is None and self.direct:
            return False
        self._read(block, parts, np.frombuffer(buf, np.uint8) if buf is not None else None,
                   between)
        return True

    def _read(self, block: Block, dests: list[np.ndarray], scratch: np.ndarray | None,
              between: Between) -> None:
        crc = self.reader.read(block, dests, scratch, self.store.where, between)
        self.store.check_crc(block, crc)

    def read_page(self, block: Block, buf: Any) -> None:
        """One aligned page of ``block`` (calibrate's per-read cost)."""
        e = block.extents[0]
        os.preadv(self.reader.fds[e.file], [memoryview(buf)[:ALIGN]], e.offset - e.offset % ALIGN)

    def close(self) -> None:
        self.reader.close()


def refuse_tier(store: ExpertStore, tier: str) -> None:
    """An in-place store is read from the disk only: the disk tier, or the disk -> GPU one
    (the others hold a data file in memory)."""
    if store.in_place and tier not in ("disk", "gpu-disk"):
        raise OffloadError(f"{store.path}: an in-place index is read from the disk tier "
                           f"(disk, or gpu-disk); --tier {tier} holds the experts in memory: "
                           "pack a store (stmoe pack) for it")
