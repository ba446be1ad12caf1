"""The store in page-locked host memory, once per process: what ``--tier gpu`` copies from.

Why: on the gpu tier the transfer is the copy from host to device, and only page-locked
memory is copied asynchronously, by the GPU's copy engine at the link's speed. The store
used to be read into memory three times over (``read_bytes``, a ``bytearray``,
``pin_memory``) and torch rounded the pinned block up to a power of two, so a 12 GiB store
peaked near 40 GiB. Now it is one anonymous mapping of exactly the store's size (rounded
to a page), filled block by block with the disk tier's aligned reads (O_DIRECT: no page
cache copy either), each block's CRC-32C checked as it lands, then page-locked in place
(``device_ops.HostPinning``: ``cudaHostRegister``, which locks exactly those pages, where
``torch.empty(n, pin_memory=True)`` would round ``n`` up to a power of two).

Locking is slow (every page) and the memory large, so a process pins a store once:
``PinnedStore.acquire`` shares it between ``offload()`` calls, keyed by the store's folder,
its data file's name (the hash of its bytes) and identity (device, inode, size, mtime), and
how it is pinned; the last ``release`` unlocks and unmaps it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from stmoe.runtime.store.device_ops import (
    CopyEvent,
    CudaHostPinning,
    CudaOps,
    DeviceOps,
    HostPinning,
    copy_parts,
)
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.host_lock import LockedHost
from stmoe.runtime.store.index import ALIGN, Block, StoreError
from stmoe.runtime.store.tiers import CHUNK_BYTES, Between, DiskTier, padded

Key = tuple[str, str, int, int, int, int, str]

_LOCK = threading.Lock()
_SHARED: dict[Key, PinnedStore] = {}


def host_bytes(store: ExpertStore) -> int:
    """The bytes a store takes in host memory: its data file's, to the end of its last
    block's page (what is mapped and locked; nothing more)."""
    end = max((b.offset + padded(b) for b in store.blocks.values()), default=ALIGN)
    return -(-end // ALIGN) * ALIGN


def store_key(store: ExpertStore, pinning: HostPinning) -> Key:
    if store.data_path is None:
        raise StoreError(f"{store.path}: an in-place index has no data file to hold in "
                         "memory; pack a store (stmoe pack) for --tier gpu")
    st = os.stat(store.data_file)
    return (str(store.path.resolve()), store.index.data, st.st_dev, st.st_ino, st.st_size,
            st.st_mtime_ns, pinning.kind)


class PinnedStore:
    """One store's bytes in one locked mapping (``host``: uint8, at the data file's
    offsets). Made and shared through ``acquire``; ``release`` once per acquire."""

    def __init__(self, store: ExpertStore, pinning: HostPinning, key: Key) -> None:
        self.key, self.users = key, 0
        self.nbytes = host_bytes(store)
        # locked first (where registering is refused: allocated locked), then filled in place
        self.locked: LockedHost | None = LockedHost(self.nbytes, pinning)
        try:
            with self.locked.view() as view:
                fill(store, view)
        except BaseException:
            self.locked.close()
            raise
        self.host = self.locked.tensor
        self.how = self.locked.how

    @classmethod
    def acquire(cls, store: ExpertStore, pinning: HostPinning) -> PinnedStore:
        """The process's pinned copy of ``store``, made on first use (the fill under the
        registry's lock: a second offload of the same store waits, then shares it)."""
        key = store_key(store, pinning)
        with _LOCK:
            held = _SHARED.get(key)
            if held is None:
                held = _SHARED[key] = cls(store, pinning, key)
            held.users += 1
            return held

    def release(self) -> None:
        """One user fewer; the last one unlocks the pages and unmaps them (any view of
        ``host`` still alive keeps the mapping, unlocked, until it goes)."""
        with _LOCK:
            self.users -= 1
            if self.users > 0:
                return
            del _SHARED[self.key]
        self.host = torch.empty(0, dtype=torch.uint8)
        if self.locked is not None:
            self.locked.close()
            self.locked = None


def shared_stores() -> int:
    """How many stores this process holds pinned (for tests and reports)."""
    with _LOCK:
        return len(_SHARED)


def fill(store: ExpertStore, view: memoryview) -> None:
    """Every block of ``store`` read into ``view`` at its offset, in file order, with the
    disk tier's aligned reads, each checked (size, CRC-32C) as it lands."""
    reader = DiskTier(store)
    try:
        for block in sorted(store.blocks.values(), key=lambda b: b.offset):
            reader.read_block(block, view[block.offset : block.offset + padded(block)])
    finally:
        reader.close()


class PinnedHostTier:
    """The store in pinned host memory, checked once and shared in the process; a block's
    transfer is its copy to the device (``load``: asynchronous, an event after it).
    ``pinning`` and ``ops``: CUDA's unless given (a CPU test gives stand-ins)."""

    name = "gpu"
    emulated = False
    reads_in_place = False
    to_device = True

    def __init__(self, store: ExpertStore, pinning: HostPinning | None = None,
                 ops: DeviceOps | None = None) -> None:
        self.store = store
        self.pinned: PinnedStore | None = PinnedStore.acquire(store, pinning or
                                                              CudaHostPinning())
        self.host = self.pinned.host
        self._ops = ops
        self.chunk_bytes = CHUNK_BYTES  # a prefetch's copy pieces (``copy_parts``)

    @property
    def ops(self) -> DeviceOps:
        if self._ops is None:
            self._ops = CudaOps()
        return self._ops

    def fetch(self, block: Block, buf: Any = None, between: Between = None) -> torch.Tensor:
        """The block's bytes where they are pinned (a view: nothing is read)."""
        return self.host[block.offset : block.offset + block.nbytes]

    def load(self, block: Block, dsts: list[torch.Tensor], stream: object,
             between: Between = None) -> CopyEvent:
        """Queue the block's copy into ``dsts`` (a slot's parameters as uint8, block order)
        on ``stream``; the event completes when the slot holds it. Nothing to wait for
        before: the pinned bytes never change. A prefetch's (``between``) goes in chunks
        that a demand's copy overtakes (``device_ops.COPY_DEPTH``)."""
        return copy_parts(self.ops, dsts, self.fetch(block), stream, between,
                          self.chunk_bytes)

    def read_into(self, block: Block, parts: list[Any], between: Between = None,
                  buf: Any = None) -> bool:
        """Never reads in place (``reads_in_place`` is False)."""
        return False

    def close(self) -> None:
        """After every copy queued out of the pinned store (a prefetch's may still be in
        flight when a run ends on an error), the store given back."""
        if self.pinned is not None:
            if self._ops is not None:
                self._ops.drain()
            self.host = torch.empty(0, dtype=torch.uint8)
            self.pinned.release()
            self.pinned = None
