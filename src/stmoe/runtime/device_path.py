"""A layer call on a device cache without host round trips it can do without: the router's
ids reach the host once, non-blocking into pinned memory (``IdsToHost``), and the ids the
experts' kernels take are renumbered to slots on the device (``SlotTable``).

Why: on a GPU the host needs the router's choice (which experts to load, what to teach the
predictor), so one device-to-host copy per layer call is the price of deciding on the host;
``ids.to("cpu")`` pays it through pageable memory and a whole-stream synchronisation. The
renumbered ids the kernels read need not come back from the host at all: each layer keeps
an expert -> slot table on the device, updated (one small copy from pinned memory, on the
compute stream) only for entries that changed, and the ids are gathered through it there.
In a steady decode whose experts stay in their slots, nothing goes up.

Both take the device's ``DeviceOps``; on the CPU's stand-in (``runtime.accelerator``) the
ids' copy lands late on another thread, so a read of the pinned buffer before its event
would see the last call's ids (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stmoe.runtime.store.device_ops import DeviceOps


class IdsToHost:
    """The router's ids of each layer call copied to one reused host buffer (pinned where
    they come from CUDA) on the compute stream, the host waiting for that copy alone."""

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops
        self._bufs = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self.transfers = 0  # host waits (one per layer call: tests count them)

    def rows(self, ids: torch.Tensor) -> np.ndarray:
        """``ids`` ([tokens, K], on the device) as a host array of the caller's own."""
        return self.rows_and(ids)[0]

    def rows_and(self, ids: torch.Tensor,
                 *also: torch.Tensor | None) -> tuple[np.ndarray | None, ...]:
        """``rows(ids)`` and each of ``also`` (more on the device: the next layer's early
        gate lookahead, a prompt's counts for the next layer; None: none) brought up by the
        same wait, in order."""
        tensors = [ids, *also]
        while len(self._bufs) < len(tensors):
            self._bufs.append(torch.empty(0, dtype=torch.int64))
        dsts: list[torch.Tensor | None] = []
        event = None
        for i, t in enumerate(tensors):
            if t is None:
                dsts.append(None)
                continue
            n = t.numel()
            if self._bufs[i].numel() < n or self._bufs[i].dtype != t.dtype:
                self._bufs[i] = torch.empty(max(n, 64), dtype=t.dtype, pin_memory=t.is_cuda)
            dst = self._bufs[i][:n].view(t.shape)
            dsts.append(dst)
            event = self.ops.copy_async(dst, t, None)  # queued on the compute stream
        assert event is not None
        event.synchronize()  # the compute stream's copies only, the last after the others
        self.transfers += 1
        # the buffers are the next call's: each its own copy
        return tuple(d.numpy().copy() if d is not None else None for d in dsts)


class SlotTable:
    """One layer's expert -> slot table on the device. ``known`` is what the device table
    holds as launched; ``uploads`` counts the updates sent."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        self.device = device
        self.table = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.known = np.full(num_experts, -1, dtype=np.int64)
        self.uploads = 0

    def renumber(self, slots: dict[int, int], ids: torch.Tensor) -> torch.Tensor:
        """``ids`` (experts, on the device) as the slots ``slots`` gives them (every id in
        ``ids`` must be a key): the table updated for the entries that changed, then one
        gather on the device, in the compute stream's order."""
        stale = [(e, s) for e, s in slots.items() if self.known[e] != s]
        if stale:
            update = torch.tensor(stale, dtype=torch.int64).t().contiguous()  # [2, changed]
            if self.device.type == "cuda":  # (torch keeps a pinned block until its copy ran)
                update = update.pin_memory().to(self.device, non_blocking=True)
            self.table[update[0]] = update[1]
            self.known[[e for e, _ in stale]] = [s for _, s in stale]
            self.uploads += 1
        return self.table[ids].to(ids.dtype)


@dataclass
class DeviceSide:
    """A device cache's helpers for the compute thread: the ids' way up, each layer's
    table."""

    ids: IdsToHost
    tables: list[SlotTable]
