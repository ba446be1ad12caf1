"""Host memory the GPU copies from asynchronously: locked in place, or allocated locked
where the driver refuses to lock memory it did not allocate.

Why a fallback: ``cudaHostRegister`` on an anonymous mapping locks exactly its pages (the
pinned store's and the bounce buffers' way, ``device_ops``), but some virtualised GPUs
and sandboxes refuse to register memory the driver did not allocate itself while
``cudaHostAlloc`` works; there every ``--tier gpu`` and ``gpu-disk`` run would fail. So a
refused registration falls back to torch's pinned allocation (``HostPinning.allocate``):
the same asynchronous copies, at the cost of torch's host allocator rounding the size up
to a power of two and keeping the block cached after it is freed. ``LockedHost.how``
says which one a run got; a fallback warns once per process.
"""

from __future__ import annotations

import mmap

import torch

from stmoe.errors import OffloadError
from stmoe.runtime.store.device_ops import HostPinning, unmap
from stmoe.runtime.store.index import ALIGN
from stmoe.util.warn import warn

REGISTERED = "registered in place"
_warned = False


class LockedHost:
    """``nbytes`` of locked host memory, page-aligned: ``tensor`` (uint8) and ``view``
    (writable)."""

    def __init__(self, nbytes: int, pinning: HostPinning) -> None:
        self.pinning = pinning
        self._map: mmap.mmap | None = mmap.mmap(-1, nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.ptr: int | None = self.tensor.data_ptr()
        try:
            pinning.register(self.ptr, nbytes)
            self.how = REGISTERED
        except OffloadError as refused:
            self._drop_map()
            self.tensor = _allocate(nbytes, pinning, refused)
            self.how = f"allocated locked (registering was refused: {refused})"

    @property
    def registered(self) -> bool:
        return self.ptr is not None

    def view(self) -> memoryview:
        """The bytes, writable (to read a store or a block into)."""
        if self._map is not None:
            return memoryview(self._map)
        return memoryview(self.tensor.numpy()).cast("B")

    def close(self) -> None:
        """Unlocked and unmapped (registered), or handed back to torch (allocated)."""
        if self.ptr is not None:
            self.pinning.unregister(self.ptr)
        self._drop_map()  # (the allocated tensor dropped too)

    def _drop_map(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.ptr = None
        if self._map is not None:
            unmap(self._map)
            self._map = None


def _allocate(nbytes: int, pinning: HostPinning, refused: OffloadError) -> torch.Tensor:
    global _warned
    try:
        raw = pinning.allocate(nbytes + ALIGN)  # page-aligned within: O_DIRECT reads into it
        skip = -raw.data_ptr() % ALIGN
        tensor = raw[skip : skip + nbytes]
    except (RuntimeError, OffloadError) as exc:
        raise OffloadError(f"{refused}; and allocating {nbytes / 2**30:.2f} GiB of locked "
                           f"host memory instead failed too: {exc}") from exc
    if not _warned:
        _warned = True
        warn(f"{refused}; using torch's pinned allocation instead (the same "
             "asynchronous copies; torch rounds each block up to a power of two and "
             "keeps it cached once freed)", RuntimeWarning)
    return tensor
