"""Slow tiers an expert is read from: the disk itself, or an emulated link.

A tier's one job is ``fetch(block, buf)``: return the block's checked bytes as a
CPU uint8 tensor, using ``buf`` (a page-aligned, writable buffer at least
``padded(block)`` long, one per reading thread) where it needs somewhere to read.

* ``DiskTier`` reads the store file so that a miss costs a device read: with
  ``O_DIRECT`` where the file system allows it, otherwise with a plain read
  followed by ``posix_fadvise(DONTNEED)`` so the page cache keeps no copy.
* ``EmulatedLinkTier`` (**emulated**, for reproducible comparisons) keeps the
  store in host memory and makes every read take ``latency + bytes / bandwidth``
  on one shared link, as a PCIe or network link would serialise transfers.

The tiers that feed a GPU cache live beside this module: ``pinned.PinnedHostTier`` (the
store in page-locked host memory, once per process) and ``bounce.DiskToDeviceTier`` (the
disk's reads through a few pinned bounce buffers). ``reading.open_tier`` makes one by the
name ``stmoe.offload`` takes.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from stmoe.errors import BlockError, OffloadError
from stmoe.runtime.options import MAX_LATENCY, MIN_BANDWIDTH, TIERS, check_link
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.index import ALIGN, Block
from stmoe.util.units import parse_bytes, parse_seconds

__all__ = [
    "MAX_LATENCY",
    "MIN_BANDWIDTH",
    "TIERS",
    "DiskTier",
    "EmulatedLinkTier",
    "Tier",
    "aligned_buffer",
    "buffer_bytes",
    "check_link",
    "padded",
    "parse_bytes",
    "parse_seconds",
]

def padded(block: Block) -> int:
    """Bytes a block occupies in the file (its payload rounded up to ALIGN)."""
    return -(-block.nbytes // ALIGN) * ALIGN


def buffer_bytes(block: Block) -> int:
    """A reading thread's buffer for ``block``: its padded size; for a block read in place
    (``in_place``) one chunk's aligned span more, where its pieces land before their copy."""
    return padded(block) + (CHUNK_BYTES + 2 * ALIGN if block.extents else 0)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned writable buffer (anonymous mmap), as O_DIRECT requires."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN))


def open_direct(path: str | os.PathLike[str]) -> int | None:
    """``path`` opened with O_DIRECT and one aligned page read back, or None where the
    file system refuses either. Why the read: some (FUSE, sandboxed ones) accept the flag
    at open and refuse every read with EINVAL, which would fail each load of a run that
    a plain read serves."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:  # tmpfs and some others refuse O_DIRECT
        return None
    try:
        os.preadv(fd, [aligned_buffer(ALIGN)], 0)
    except OSError:
        os.close(fd)
        return None
    return fd


class Tier(Protocol):
    """Where blocks are read from. ``reads_in_place``: ``read_into`` can read a block
    straight into a slot's memory (else it is never called, and ``fetch`` reads into the
    thread's buffer for a copy). ``runtime.store.loader.Loader`` is the one caller that
    brings blocks into slots (calibrate also times one-page reads of its own)."""

    name: str
    emulated: bool
    reads_in_place: bool

    def fetch(self, block: Block, buf: ReadBuffer, between: Between = None) -> torch.Tensor: ...

    def read_into(self, block: Block, parts: list[np.ndarray], between: Between = None,
                  buf: mmap.mmap | None = None) -> bool:
        ...

    def close(self) -> None: ...


# Reads of whole blocks go in chunks of this many bytes (a multiple of ALIGN), calling
# ``between()`` before each chunk after the first: a prefetch worker waits there while the
# compute thread stalls, so a demand read queues behind one chunk of a prefetch, never a
# whole expert (docs/runtime.md, Demand first). 4 MiB: on the development VM's disk 1 MiB
# reads cost a 17 MB expert's read 12-15% more, 4 MiB 5% (benchmarks/bench_chunked_reads.py).
CHUNK_BYTES = 4 << 20
Between = Callable[[], None] | None
# a reader's page-aligned buffer: a mapping, or a view of locked memory (``host_lock``)
ReadBuffer = mmap.mmap | memoryview


def chunks(total: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges of ``total`` in ``chunk``-sized pieces (one piece: 0)."""
    if chunk <= 0 or total <= chunk:
        return [(0, total)]
    return [(s, min(s + chunk, total)) for s in range(0, total, chunk)]


class DiskTier:
    """Real reads from the store file, bypassing (or dropping) the page cache."""

    name = "disk"
    emulated = False
    reads_in_place = True

    def __init__(self, store: ExpertStore, direct: bool = True) -> None:
        self.store = store
        self.chunk_bytes = CHUNK_BYTES
        fd = open_direct(store.data_file) if direct else None
        self.direct = fd is not None
        self.fd = fd if fd is not None else os.open(store.data_file, os.O_RDONLY)
        self.drop_cache()

    def drop_cache(self) -> None:
        """Forget any cached pages of the store, so the next reads hit the device."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read_page(self, block: Block, buf: ReadBuffer) -> None:
        """One aligned page of ``block`` (calibrate's per-read cost)."""
        os.preadv(self.fd, [memoryview(buf)[:ALIGN]], block.offset)

    def fetch(self, block: Block, buf: ReadBuffer, between: Between = None) -> torch.Tensor:
        self.read_block(block, memoryview(buf), between)
        return torch.frombuffer(buf, dtype=torch.uint8, count=block.nbytes)

    def read_block(self, block: Block, dest: memoryview, between: Between = None) -> None:
        """``block`` into the start of ``dest`` (page-aligned, at least ``padded(block)``
        long), its size and CRC-32C checked: the one aligned read the pinned store and the
        bounce buffers fill themselves with."""
        size = padded(block) if self.direct else block.nbytes
        got = self._read(block, [dest[:size]], between)
        self.store.check_block(block, dest[: min(got, block.nbytes)])

    def read_into(self, block: Block, parts: list[np.ndarray], between: Between = None,
                  buf: mmap.mmap | None = None) -> bool:
        """Read ``block`` straight into ``parts`` (its tensors' destinations in block order,
        uint8: a cache slot's memory), checked: no copy (``buf`` unused). False (nothing
        read) where O_DIRECT cannot (a part not page-aligned in address or length)."""
        if self.direct and any(p.ctypes.data % ALIGN or p.nbytes % ALIGN for p in parts):
            return False
        views = [memoryview(p) for p in parts]
        self.store.check_size(block, self._read(block, views, between))
        self.store.check_parts(block, views)
        return True

    def _read(self, block: Block, views: list[memoryview], between: Between = None) -> int:
        """``block`` into ``views``: one ``preadv``, or with ``between`` one per chunk,
        ``between()`` before each after the first (page cache dropped after it where
        O_DIRECT is off); the bytes read (a short read stops there)."""
        try:
            if between is None:
                got = os.preadv(self.fd, views, block.offset)
            else:
                got = 0
                for i, piece in enumerate(_pieces(views, self.chunk_bytes)):
                    if i:
                        between()
                    n = os.preadv(self.fd, piece, block.offset + got)
                    got += n
                    if n < sum(map(len, piece)):
                        break
        except OSError as exc:
            raise BlockError(f"{self.store.data_path}: reading layer {block.layer}, expert "
                             f"{block.expert} failed: {exc.strerror}",
                             block.layer, block.expert) from None
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, block.offset, sum(map(len, views)),
                             os.POSIX_FADV_DONTNEED)
        return got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class EmulatedLinkTier:
    """EMULATED link: the store sits in host memory, each read costs latency + bytes/bandwidth.

    Transfers share one link: a read waits until the link is free, so prefetches
    and on-demand loads queue behind each other as on real hardware. The blocks
    are checked once when the tier opens; a read then hands out a view of host
    memory after the transfer time, so the worker spends its time waiting, not
    copying (the copy into the cache is the transfer's landing).
    """

    name = "emulated"
    emulated = True
    reads_in_place = False

    def __init__(self, store: ExpertStore, bandwidth: float, latency: float = 0.0) -> None:
        if bandwidth <= 0:
            raise OffloadError(f"the emulated link needs a bandwidth > 0 bytes/s, got {bandwidth}")
        if latency < 0:
            raise OffloadError(f"the emulated link needs a latency >= 0 s, got {latency}")
        self.store = store
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        raw = _host_copy(store)
        for block in store.blocks.values():
            store.check_block(block, memoryview(raw)[block.offset : block.offset + block.nbytes])
        self.host = (
            torch.frombuffer(raw, dtype=torch.uint8)
            if len(raw)
            else torch.empty(0, dtype=torch.uint8)
        )
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.perf_counter() when the link is next idle
        self.chunk_bytes = CHUNK_BYTES

    def transfer_time(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def fetch(self, block: Block, buf: ReadBuffer, between: Between = None) -> torch.Tensor:
        """After the block's transfer time on the shared link: one transfer, or with
        ``between`` one per chunk (the latency paid once, by the first), so another
        reader's transfer can go between two chunks."""
        pieces = [(0, block.nbytes)] if between is None else chunks(block.nbytes,
                                                                    self.chunk_bytes)
        for i, (start, end) in enumerate(pieces):
            if i:
                between()
            self._transfer((self.latency if i == 0 else 0.0) + (end - start) / self.bandwidth)
        return self.host[block.offset : block.offset + block.nbytes]

    def _transfer(self, seconds: float) -> None:
        """Hold the link for ``seconds`` after whatever is queued on it (FIFO)."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = done = start + seconds
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

    def read_into(self, block: Block, parts: list[np.ndarray], between: Between = None,
                  buf: mmap.mmap | None = None) -> bool:
        """Never reads in place (``reads_in_place`` is False)."""
        return False

    def close(self) -> None:
        self.host = torch.empty(0, dtype=torch.uint8)


def _pieces(views: list[memoryview], chunk: int) -> list[list[memoryview]]:
    """``views`` (destinations laid end to end) cut into lists of at most ``chunk`` bytes
    each, in order: one ``preadv`` each."""
    out: list[list[memoryview]] = [[]]
    room = chunk
    for v in views:
        while len(v):
            take = min(room, len(v))
            out[-1].append(v[:take])
            v, room = v[take:], room - take
            if room == 0:
                out.append([])
                room = chunk
    return [p for p in out if p]


def _host_copy(store: ExpertStore) -> mmap.mmap | bytearray:
    """The store's data in host memory: a private mapping of the file (its pages come from
    the page cache, nothing is copied twice; writes, never made, would stay private)."""
    with open(store.data_file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else bytearray()
