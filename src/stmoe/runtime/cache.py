"""A bounded cache of one MoE layer's experts in fast memory.

The cache owns fixed slabs (one tensor per expert parameter, ``capacity`` rows,
faulted in when the cache is made; on the CPU followed by spare rows of address
space that a call needing more experts than the capacity pages in and gives back),
allocated once: it can never hold more than its capacity, and resident memory
stays flat however long generation runs. Each slot is FREE, LOADING (a thread is
writing it; nobody else may touch it) or READY. A LOADING slot records its loader
thread and since when, so a waiter can tell a slow load from one that will never
finish (its thread died) and bound its wait (``prefetch.Prefetcher.reap``).

Every method except ``write``, ``copy_row`` and ``release_spare`` must be called
with the engine's lock held; the lock guards the bookkeeping, never a copy.

The victim of an eviction is chosen by a policy of ``stmoe.cache_policy`` (the
names and their rules are documented there, once for every cache), with the
same rules as the cache replay, so both give the same hits on the same requests
(``tests/test_cache_policy.py``): only a READY slot may be a victim; never an
expert the compute thread is using (``pinned``) nor one predicted for
the coming layer (``protected``: the whole prefetch set being inserted, as in the
replay, so a load never evicts a member of its own set). A use is
stamped with the cache's step: setting ``pinned`` to a demand starts a step,
every expert of that demand shares its stamp, and a prefetched expert is stamped
with the step it was loaded for (the next one); ties go to the smaller id.
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from contextlib import nullcontext

import numpy as np
import torch

from stmoe import cache_policy as cp
from stmoe.errors import OffloadError
from stmoe.runtime.slot_layout import (
    ParamSpec,
    SlotLayout,
    device_layouts,
    param_specs,
    torch_dtype,
)

__all__ = ["FREE", "LOADING", "POLICIES", "READY", "TEMP", "LayerCache", "ParamSpec",
           "param_specs", "populate_pages", "torch_dtype"]

FREE, LOADING, READY = 0, 1, 2
TEMP = -1  # ``copy_row``'s one-expert buffer (breaks a cycle of moves)
POLICIES = cp.names_for(cp.RUNTIME)  # the policy names the runtime accepts


_NO_FUTURE = np.zeros(0, dtype=np.int64)  # the runtime cannot see next uses (no belady)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
# spare rows are address space, not a commitment (strict overcommit would count them)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


def populate_pages(memory: mmap.mmap, length: int) -> None:
    """Fault the slots' pages in now: the cache's memory is resident from the start, and a
    read into never-touched memory would pay its page faults on the load's path (about as
    long as the read itself for a 6 MiB expert on a VM: docs/runtime.md)."""
    if length <= 0:
        return
    try:
        memory.madvise(_MADV_POPULATE_WRITE, 0, length)
    except (OSError, ValueError):  # an older kernel: touch every page
        torch.frombuffer(memory, dtype=torch.uint8, count=length).zero_()


class LayerCache:
    """``capacity`` slots for one layer's experts; see the module docstring."""

    def __init__(self, layer: int, capacity: int, params: list[ParamSpec], num_experts: int,
                 policy: str, device: torch.device,
                 layouts: dict[str, SlotLayout] | None = None) -> None:
        self.layer = layer
        # parameters a slot holds in another layout than the store's (int4 on CUDA: the
        # kernel's), converted after each copy lands (``convert``); default: the device's
        self.layouts = device_layouts(params, device) if layouts is None else layouts
        self.capacity = capacity
        self.params = params
        self.policy = policy
        self._code = cp.policy_code(policy, cp.RUNTIME)
        self.device = device
        # With room for every expert, expert e always lives in slot e: the slabs are then
        # the model's own [N, ...] tensors and the compute needs no gather (fast path).
        self.identity = capacity == num_experts
        self._memory: list[mmap.mmap] = []  # what the CPU slabs live in (page-aligned)
        # Rows past the capacity (CPU): address space for the experts one call needs beyond
        # it (a long prompt's), paged in only when written and given back after the call
        # (``release_spare``); they are never cache slots.
        self.reserved = num_experts if device.type == "cpu" and not self.identity else capacity
        self.rows = {p.name: self._slab(p, device) for p in params}  # [reserved, ...]
        self.slabs = {name: rows[:capacity] for name, rows in self.rows.items()}
        # a slot can be read into straight from the store when its tensors sit end to end
        # in the block, in this order (one read, no copy: ``slot_parts``)
        ends = [p.offset + p.nbytes for p in params]
        self.in_block_order = device.type == "cpu" and not self.layouts and all(
            p.offset == (ends[i - 1] if i else 0) for i, p in enumerate(params))
        self.where: dict[int, int] = {}  # expert -> slot
        self.holder = [-1] * capacity
        self.state = [FREE] * capacity
        self.prefetched = [False] * capacity  # loaded by a prefetch ...
        self.used = [False] * capacity  # ... and used since it was loaded
        # a LOADING slot's loader thread and when it claimed the slot (time.monotonic)
        self.loader: list[threading.Thread | None] = [None] * capacity
        self.since = [0.0] * capacity
        # per expert, as the policies take them: stamp of the last use or load, and uses
        self.last_use = np.zeros(num_experts, dtype=np.int64)
        self.uses = np.zeros(num_experts, dtype=np.int64)
        self.clock = 0  # the current step (see the module docstring)
        # policy score: the scores of the layer's latest prediction (the planner's; none yet:
        # victims as LRU)
        self.scores: np.ndarray = cp.NO_SCORES
        self._in_step = False  # a demand is pinned: its uses share one stamp
        # predicted for the coming layer: the whole prefetch set being inserted
        self.protected: frozenset[int] = frozenset()
        self._pinned: frozenset[int] = frozenset()  # being used by the compute thread

    def _slab(self, p: ParamSpec, device: torch.device) -> torch.Tensor:
        """``reserved`` rows of parameter ``p``; on the CPU in page-aligned private memory,
        so that O_DIRECT can read into a row (rows of page-multiple size stay aligned)."""
        lay = self.layouts.get(p.name)
        shape, dtype = (lay.shape, lay.dtype) if lay else (p.shape, p.dtype)
        if device.type != "cpu":
            return torch.empty((self.capacity, *shape), dtype=dtype, device=device)
        try:
            memory = mmap.mmap(-1, max(1, self.reserved * p.nbytes),
                               flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
        except OSError:  # no address space for the spare rows: the slots alone
            self.reserved = self.capacity
            memory = mmap.mmap(-1, max(1, self.capacity * p.nbytes), flags=mmap.MAP_PRIVATE)
        self._memory.append(memory)
        populate_pages(memory, self.capacity * p.nbytes)
        rows = len(memory) // max(1, p.nbytes)
        flat = torch.frombuffer(memory, dtype=torch.uint8, count=rows * p.nbytes)
        return flat.view(dtype).view(rows, *shape)

    def slot_parts(self, slot: int) -> list[np.ndarray] | None:
        """Row ``slot``'s memory (a slot, or a spare row past the capacity) as one uint8
        array per tensor, in block order (a tier reads into them); None where the slabs
        are not CPU memory in block order."""
        if not self.in_block_order:
            return None
        return [self.rows[p.name][slot].view(-1).view(torch.uint8).numpy() for p in self.params]

    def device_parts(self, slot: int) -> list[torch.Tensor]:
        """Row ``slot``'s tensors as uint8, in block order: where a tier copies a block
        asynchronously (``store.loader``: a device cache's slot, its ``SlotEvents``)."""
        order = sorted(self.params, key=lambda p: p.offset)
        return [self.rows[p.name][slot].view(-1).view(torch.uint8) for p in order]

    def convert(self, slot: int) -> None:
        """Row ``slot``'s parameters that the slot holds in another layout, converted in
        place from the store's bytes just copied there (queued after the copy, on its
        stream: the caller's)."""
        for p in self.params:
            if (lay := self.layouts.get(p.name)) is not None:
                row = self.rows[p.name][slot]
                row.copy_(lay.convert(row.view(-1).view(torch.uint8).view(p.dtype)
                                      .view(p.shape)).view(row.shape))

    def release(self) -> None:
        """(lock held; the engine closed) Drop the slots' memory (the mapped memory too:
        it goes with the last tensor on it)."""
        self.rows, self.slabs, self._memory = {}, {}, []

    def row_buffer(self) -> dict[str, torch.Tensor]:
        """One row of each parameter as the slots hold it (``copy_row``'s ``TEMP``): in the
        slot's layout where it has one (int4 on CUDA), not the store's."""
        return {name: torch.empty_like(rows[0]) for name, rows in self.rows.items()}

    def copy_row(self, src: int, dst: int, temp: dict[str, torch.Tensor]) -> None:
        """Copy row ``src`` to row ``dst`` (either may be ``TEMP``: the one-expert ``temp``)."""
        for p in self.params:
            rows = self.rows[p.name]
            (temp[p.name] if dst == TEMP else rows[dst]).copy_(
                temp[p.name] if src == TEMP else rows[src])

    def release_spare(self, used: int) -> None:
        """Give back the memory of the first ``used`` spare rows (their pages; none once
        ``release`` let the memory go)."""
        if used <= 0 or self.device.type != "cpu" or not self._memory:
            return
        for p, memory in zip(self.params, self._memory, strict=True):
            start = -(-self.capacity * p.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            end = min(len(memory), (self.capacity + used) * p.nbytes)
            if end > start:
                memory.madvise(mmap.MADV_DONTNEED, start, end - start)

    @property
    def pinned(self) -> frozenset[int]:
        """Experts the compute thread is using; setting a demand starts a step."""
        return self._pinned

    @pinned.setter
    def pinned(self, experts: frozenset[int]) -> None:
        self._pinned = experts
        self._in_step = bool(experts)
        self.clock += self._in_step

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slabs.values())

    def loading(self) -> list[int]:
        return sorted(e for e, s in self.where.items() if self.state[s] == LOADING)

    def claim(self, expert: int, prefetch: bool) -> tuple[int | None, bool]:
        """A slot for ``expert`` (now LOADING), and whether the expert it displaced
        had been prefetched and never used (wasted bytes).

        ``(None, False)`` when the expert is already here or every slot is busy. An id
        outside the layer's experts is refused before anything changes.
        """
        self.last_evicted: int | None = None  # the expert this claim displaced, if any
        if expert in self.where:
            return None, False
        if not 0 <= expert < len(self.uses):
            raise OffloadError(f"layer {self.layer}: expert {expert} is outside its experts "
                               f"0..{len(self.uses) - 1}")
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
            self.last_evicted = self.holder[slot]
            del self.where[self.holder[slot]]
        self.where[expert] = slot
        self.holder[slot] = expert
        self.state[slot] = LOADING
        self.loader[slot] = threading.current_thread()  # the claimer loads it
        self.since[slot] = time.monotonic()
        self.prefetched[slot] = prefetch
        self.used[slot] = False
        if prefetch:  # a load is a use for LRU, stamped with the step it is loaded for
            self.last_use[expert] = self.clock + 1
        return slot, wasted

    def _victim(self) -> int | None:
        """(a full cache) The slot of the policy's victim, or None when all are protected."""
        evictable = np.zeros(len(self.uses), dtype=np.bool_)
        for s in range(self.capacity):
            if self.state[s] == READY:
                evictable[self.holder[s]] = True
        keep = np.zeros(len(self.uses), dtype=np.bool_)
        for e in self.pinned.union(self.protected):
            keep[e] = True
        e = cp.choose_victim(evictable, keep, self.last_use, self.uses, _NO_FUTURE, self.scores,
                             self._code)
        return self.where[e] if e >= 0 else None

    def write(self, slot: int, src: torch.Tensor, stream: object = None) -> None:
        """Copy a block's bytes (CPU uint8) into ``slot``; the caller holds the slot LOADING."""
        non_blocking = self.device.type == "cuda"
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            for p in self.params:
                dst = self.rows[p.name][slot].view(-1).view(torch.uint8)
                dst.copy_(src[p.offset : p.offset + p.nbytes], non_blocking=non_blocking)
            self.convert(slot)
        if stream is not None:
            stream.synchronize()  # type: ignore[attr-defined]

    def place(self, target: dict[int, int], slots: dict[int, int]) -> None:
        """(lock held) The bookkeeping once ``arrange.plan_id_order``'s moves are done: each
        needed expert is in row ``target[e]``; the cached ones (``slots``, the rows they
        held) moved past the capacity leave the cache, a slot given to an expert not
        loaded yet is LOADING by this thread (it reads it next)."""
        flags = {e: (self.prefetched[s], self.used[s]) for e, s in slots.items()}
        for e in slots:
            del self.where[e]
        now, me = time.monotonic(), threading.current_thread()
        for e, row in target.items():
            if row >= self.capacity:
                continue
            self.where[e], self.holder[row] = row, e
            if e in flags:
                self.state[row], self.loader[row] = READY, None
                self.prefetched[row], self.used[row] = flags[e]
            else:
                self.state[row], self.loader[row], self.since[row] = LOADING, me, now
                self.prefetched[row] = self.used[row] = False

    def filled(self, slot: int) -> None:
        self.state[slot] = READY
        self.loader[slot] = None

    def abandon(self, slot: int) -> None:
        """A load failed: the slot goes back to FREE and holds nothing."""
        expert = self.holder[slot]
        if self.where.get(expert) == slot:
            del self.where[expert]
        self.holder[slot] = -1
        self.state[slot] = FREE
        self.loader[slot] = None
        self.prefetched[slot] = self.used[slot] = False

    def touch(self, slot: int) -> None:
        """A use of the slot's expert: in the current step when a demand is pinned,
        else a step of its own."""
        if not self._in_step:
            self.clock += 1
        expert = self.holder[slot]
        self.last_use[expert] = self.clock
        self.used[slot] = True
        self.uses[expert] += 1

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
                   for s in range(self.capacity))

    def check(self) -> None:
        """Invariants (tests): the maps agree and nothing exceeds the capacity."""
        assert len(self.where) <= self.capacity
        for e, s in self.where.items():
            assert self.holder[s] == e and self.state[s] != FREE
        for s in range(self.capacity):
            assert (self.loader[s] is not None) == (self.state[s] == LOADING)
            if self.state[s] == FREE:
                assert self.holder[s] == -1
            else:
                assert self.where.get(self.holder[s]) == s
