"""A bounded cache of one MoE layer's experts in fast memory.

The cache owns fixed slabs (one tensor per expert parameter, ``capacity`` rows),
allocated once: it can never hold more than its budget, and resident memory
stays flat however long generation runs. Each slot is FREE, LOADING (a thread is
writing it; nobody else may touch it) or READY.

Every method except ``write`` must be called with the engine's lock held; the
lock guards the bookkeeping, never a copy.

Eviction policies (the victim is always a READY slot whose expert is not being
gathered by the compute thread):

* ``lru``: least recently used;
* ``lfu``: least often used (ties: least recently used);
* ``predicted`` (prediction-aware): LRU, but an expert predicted for the coming
  layer is never evicted;
* ``none``: no reuse: the compute thread frees every slot after each use
  (plain on-demand offloading, the baseline).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from stmoe.runtime.store import Block

FREE, LOADING, READY = 0, 1, 2
POLICIES = ("predicted", "lru", "lfu", "none")


@dataclass(frozen=True)
class ParamSpec:
    """One per-expert parameter: where its bytes sit inside a store block."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown tensor dtype {name!r} in the store")
    return dtype


def param_specs(block: Block) -> list[ParamSpec]:
    specs = []
    for t in block.tensors:
        dtype = torch_dtype(t.dtype)
        count = 1
        for d in t.shape:
            count *= d
        specs.append(ParamSpec(t.name, dtype, t.shape, t.offset, count * dtype.itemsize))
    return specs


class LayerCache:
    """``capacity`` slots for one layer's experts; see the module docstring."""

    def __init__(self, layer: int, capacity: int, params: list[ParamSpec], num_experts: int,
                 policy: str, device: torch.device) -> None:  # fmt: skip
        self.layer = layer
        self.capacity = capacity
        self.params = params
        self.policy = policy
        self.device = device
        self.slabs = {p.name: torch.empty((capacity, *p.shape), dtype=p.dtype, device=device)
                      for p in params}  # fmt: skip
        # With room for every expert, expert e always lives in slot e: the slabs are then
        # the model's own [N, ...] tensors and the compute needs no gather (fast path).
        self.identity = capacity == num_experts
        self.where: dict[int, int] = {}  # expert -> slot
        self.holder = [-1] * capacity
        self.state = [FREE] * capacity
        self.prefetched = [False] * capacity  # loaded by a prefetch ...
        self.used = [False] * capacity  # ... and used since it was loaded
        self.last_use = [0] * capacity
        self.freq = [0] * num_experts  # uses per expert, for LFU
        self.clock = 0
        self.protected: frozenset[int] = frozenset()  # predicted for the coming layer
        self.pinned: frozenset[int] = frozenset()  # being gathered by the compute thread

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slabs.values())

    def loading(self) -> list[int]:
        return sorted(e for e, s in self.where.items() if self.state[s] == LOADING)

    def claim(self, expert: int, prefetch: bool) -> tuple[int | None, bool]:
        """A slot for ``expert`` (now LOADING), and whether the expert it displaced
        had been prefetched and never used (wasted bytes).

        ``(None, False)`` when the expert is already here or every slot is busy.
        """
        if expert in self.where:
            return None, False
        if self.identity:
            slot: int | None = expert
        else:
            slot = next((s for s in range(self.capacity) if self.state[s] == FREE), None)
        wasted = False
        if slot is None:
            slot = self._victim()
            if slot is None:
                return None, False
            wasted = self.prefetched[slot] and not self.used[slot]
            del self.where[self.holder[slot]]
        self.where[expert] = slot
        self.holder[slot] = expert
        self.state[slot] = LOADING
        self.prefetched[slot] = prefetch
        self.used[slot] = False
        return slot, wasted

    def _victim(self) -> int | None:
        best, best_key = None, None
        for s in range(self.capacity):
            e = self.holder[s]
            if self.state[s] != READY or e in self.pinned:
                continue
            if self.policy == "predicted" and e in self.protected:
                continue
            key = (self.freq[e], self.last_use[s]) if self.policy == "lfu" else (self.last_use[s],)
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def write(self, slot: int, src: torch.Tensor, stream: object = None) -> None:
        """Copy a block's bytes (CPU uint8) into ``slot``; the caller holds the slot LOADING."""
        non_blocking = self.device.type == "cuda"
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            for p in self.params:
                dst = self.slabs[p.name][slot].view(-1).view(torch.uint8)
                dst.copy_(src[p.offset : p.offset + p.nbytes], non_blocking=non_blocking)
        if stream is not None:
            stream.synchronize()  # type: ignore[attr-defined]

    def filled(self, slot: int) -> None:
        self.state[slot] = READY

    def abandon(self, slot: int) -> None:
        """A load failed: the slot goes back to FREE and holds nothing."""
        expert = self.holder[slot]
        if self.where.get(expert) == slot:
            del self.where[expert]
        self.holder[slot] = -1
        self.state[slot] = FREE
        self.prefetched[slot] = self.used[slot] = False

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.last_use[slot] = self.clock
        self.used[slot] = True
        self.freq[self.holder[slot]] += 1

    def drop_ready(self) -> int:
        """Policy ``none``: free every READY slot; returns how many held a wasted prefetch."""
        wasted = 0
        for s in range(self.capacity):
            if self.state[s] == READY and self.holder[s] not in self.pinned:
                wasted += self.prefetched[s] and not self.used[s]
                self.abandon(s)
        return wasted

    def unused_prefetches(self) -> int:
        """READY experts that were prefetched and never used (wasted so far)."""
        return sum(self.state[s] == READY and self.prefetched[s] and not self.used[s]
                   for s in range(self.capacity))  # fmt: skip

    def check(self) -> None:
        """Invariants (tests): the maps agree and nothing exceeds the capacity."""
        assert len(self.where) <= self.capacity
        for e, s in self.where.items():
            assert self.holder[s] == e and self.state[s] != FREE
        for s in range(self.capacity):
            if self.state[s] == FREE:
                assert self.holder[s] == -1
            else:
                assert self.where.get(self.holder[s]) == s
