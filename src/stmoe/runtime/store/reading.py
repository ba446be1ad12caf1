"""Which tier reads a store: the one place a tier's name becomes a tier."""

from __future__ import annotations

from stmoe.runtime.options import check_link
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.in_place import InPlaceTier, refuse_tier
from stmoe.runtime.store.tiers import DiskTier, EmulatedLinkTier, PinnedHostTier, Tier


def open_tier(name: str, store: ExpertStore, bandwidth: float | str | None,
              latency: float | str) -> Tier:
    """The tier ``name`` (one of TIERS) over ``store``; the emulated one needs a bandwidth.
    An in-place store is read from the disk only (``in_place.InPlaceTier``)."""
    bw, lat = check_link(name, bandwidth, latency)
    if store.in_place:
        refuse_tier(store, name)
        return InPlaceTier(store)
    if name == "disk":
        return DiskTier(store)
    if name == "gpu":
        return PinnedHostTier(store)
    assert bw is not None
    return EmulatedLinkTier(store, bw, lat)
