"""The one place the bytes of an expert's block enter memory: read from the tier, checked.

Why one object: the engine's compute thread (a miss), its prefetch workers and
``stmoe calibrate`` all bring blocks in, and must do it the same way, or calibrate
measures another read than the runtime does. Read top to bottom, a block goes:

1. where the tier reads in place (``Tier.reads_in_place``: the disk's O_DIRECT read)
   and the destination is CPU memory in block order, straight into the slot's memory:
   one read, no copy, its size and CRC-32C checked by the tier;
2. where the tier feeds a device (``to_device``: ``pinned.PinnedHostTier``,
   ``bounce.DiskToDeviceTier``) and the cache offers the slot's device tensors
   (``device_parts``), the tier queues the copy on the thread's stream and hands back its
   event (the slot's *ready* event); the disk-to-device tier, which lends a bounce buffer,
   also takes the cache's own ``write`` where there are no ``device_parts``;
3. else the tier's bytes land in the reading thread's aligned buffer (``fetch``), are
   refused unless complete, and are copied into the slot (a cache's ``write``, which
   on CUDA copies on the thread's stream).

``fill`` waits for the copy before it returns unless told not to (``wait=False``: the
caller makes the compute stream wait on the event it returns instead of the host).

The caller holds the slot (LOADING) and no lock: reads run in parallel, and only the
cache changes which expert a slot holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from stmoe.runtime.store.device_ops import CopyEvent
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.index import Block
from stmoe.runtime.store.tiers import Between, Tier


class SlotMemory(Protocol):
    """What a cache offers a loader (``runtime.cache.LayerCache``). A cache on a device may
    also offer ``device_parts(slot) -> list[torch.Tensor]``: the slot's parameters as uint8
    views, in block order, for a tier to copy into asynchronously."""

    def slot_parts(self, slot: int) -> list[np.ndarray] | None: ...

    def write(self, slot: int, src: torch.Tensor, stream: object = None) -> None: ...


class Loader:
    """Reads ``store``'s blocks through ``tier`` into cache slots or plain memory."""

    def __init__(self, tier: Tier, store: ExpertStore) -> None:
        self.tier, self.store = tier, store

    def fill(self, cache: SlotMemory, slot: int, block: Block, buf: Any,
             stream: Any = None, between: Between = None,
             wait: bool = True) -> CopyEvent | None:
        """Bring ``block`` into row ``slot`` of ``cache`` (``buf``: the reading thread's
        aligned buffer; ``stream``: its CUDA stream, or None; ``between``: called between
        chunks of the read, where a prefetch waits for a stalled compute thread). A tier
        feeding a device returns the copy's event, complete unless ``wait`` is False."""
        if getattr(self.tier, "to_device", False):
            event = self._fill_device(cache, slot, block, buf, stream, between)
            if event is not None and wait:
                event.synchronize()
            return event
        parts = cache.slot_parts(slot) if self.tier.reads_in_place else None
        src = self.read(block, parts, buf, between)
        if src is not None:
            cache.write(slot, src, stream)
        return None

    def _fill_device(self, cache: SlotMemory, slot: int, block: Block, buf: Any,
                     stream: Any, between: Between) -> CopyEvent:
        """(a tier with ``to_device``) The slot's copy queued by the tier, its event."""
        tier: Any = self.tier
        parts: Callable[[int], list[torch.Tensor]] | None = getattr(cache, "device_parts",
                                                                    None)
        if parts is not None:
            return tier.load(block, parts(slot), stream, between)
        if hasattr(tier, "staged"):  # a bounce buffer lent to the cache's own write
            with tier.staged(block, stream, between) as (src, _):
                cache.write(slot, src, stream)
        else:
            src = self.read(block, None, buf, between)
            assert src is not None
            cache.write(slot, src, stream)
        return tier.ops.record(stream)  # after the cache's copy on the same stream

    def fill_parts(self, block: Block, parts: list[np.ndarray], buf: Any) -> None:
        """Bring ``block`` into ``parts`` (its tensors' memory, in block order, CPU)."""
        src = self.read(block, parts, buf)
        if src is None:
            return
        raw = src.numpy()
        for p in parts:
            start = p.ctypes.data - parts[0].ctypes.data
            p[:] = raw[start : start + p.nbytes]

    def fetch(self, block: Block, buf: Any) -> torch.Tensor:
        """The tier's bytes for ``block`` (CPU uint8, in ``buf``), refused unless complete."""
        src = self.read(block, None, buf)
        assert src is not None  # (no parts: always the tier's bytes)
        return src

    def read(self, block: Block, parts: list[np.ndarray] | None, buf: Any,
             between: Between = None) -> torch.Tensor | None:
        """Straight into ``parts`` where the tier reads in place (None returned: nothing
        left to copy), else the tier's bytes, complete (a short read refused)."""
        tier = self.tier
        if parts is not None and tier.reads_in_place and tier.read_into(block, parts, between,
                                                                         buf):
            return None
        src = tier.fetch(block, buf, between)
        self.store.check_size(block, src.numel())
        return src
