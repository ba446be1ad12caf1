"""Which tier reads a store: the one place a tier's name becomes a tier."""

from __future__ import annotations

from stmoe.runtime.options import check_link
from stmoe.runtime.store.bounce import DEFAULT_BUFFERS, DiskToDeviceTier, bounce_buffers
from stmoe.runtime.store.device_ops import DeviceOps, HostPinning
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.in_place import InPlaceTier, refuse_tier
from stmoe.runtime.store.pinned import PinnedHostTier
from stmoe.runtime.store.tiers import DiskTier, EmulatedLinkTier, Tier


def open_tier(name: str, store: ExpertStore, bandwidth: float | str | None,
              latency: float | str, ops: DeviceOps | None = None,
              pinning: HostPinning | None = None, workers: int = 2) -> Tier:
    """The tier ``name`` (one of TIERS) over ``store``; the emulated one needs a bandwidth,
    the GPU ones take the device's ``ops`` and ``pinning`` (CUDA's unless given:
    ``runtime.accelerator``); ``workers``, the prefetch threads, sizes the disk -> GPU
    tier's bounce pool. An in-place store is read from the disk only: by the disk tier, or
    the disk -> GPU one (``in_place.InPlaceTier``)."""
    bw, lat = check_link(name, bandwidth, latency)
    refuse_tier(store, name)
    if name == "gpu-disk":
        return open_disk_to_device(store, ops, pinning, bounce_buffers(workers))
    if store.in_place:
        return InPlaceTier(store)
    if name == "disk":
        return DiskTier(store)
    if name == "gpu":
        return PinnedHostTier(store, pinning, ops)
    assert bw is not None
    return EmulatedLinkTier(store, bw, lat)


def open_disk_to_device(store: ExpertStore, ops: DeviceOps | None = None,
                        pinning: HostPinning | None = None,
                        buffers: int = DEFAULT_BUFFERS) -> DiskToDeviceTier:
    """The disk tier feeding a device cache through pinned bounce buffers (``--tier
    gpu-disk``), for a packed store or one read in place."""
    reader: DiskTier | InPlaceTier = InPlaceTier(store) if store.in_place else DiskTier(store)
    try:
        return DiskToDeviceTier(reader, ops, pinning, buffers)
    except BaseException:
        reader.close()
        raise
