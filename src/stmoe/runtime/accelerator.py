"""The device the GPU tiers' caches live on: CUDA's, or the CPU's stand-in for it.

Why: the GPU tiers (``gpu``: the store pinned in host memory; ``gpu-disk``: the disk's reads
through pinned bounce buffers) are the engine's asynchronous path, where copies land after
the call that queued them returns, and that path has to run where CI runs, with no GPU.
An ``Accelerator`` is the four things the path asks of a device: where its caches and
resident weights live, its copies and events (``DeviceOps``), how host memory is
page-locked (``HostPinning``) and its free memory (``--memory``'s HBM plan).
``accelerator(tier)`` is CUDA's (refused in one line where torch sees no GPU); inside
``stand_in()`` it is the CPU's: the caches in CPU memory, every copy landing late on a
thread of its own (``store.stand_in.HostThreadOps``), memory left ordinary, a given free
memory. So ``offload(..., tier="gpu-disk")`` runs whole in a CPU test or the GPU check's dry
run, with the slot protocol's waits, the tiers' buffers and the HBM plan all exercised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from stmoe.errors import OffloadError
from stmoe.runtime.memory import device_free_bytes
from stmoe.runtime.store.checked_ops import CheckedOps
from stmoe.runtime.store.device_ops import (
    NO_CUDA,
    CudaHostPinning,
    CudaOps,
    DeviceOps,
    HostPinning,
)
from stmoe.runtime.store.stand_in import HostThreadOps, NoPinning

GPU_TIERS = ("gpu", "gpu-disk")  # the tiers whose cache is on an accelerator


@dataclass(frozen=True)
class Accelerator:
    """A device the GPU tiers can use (see the module docstring)."""

    device: torch.device
    ops: DeviceOps
    pinning: HostPinning
    free_bytes: Callable[[], int]  # its free memory now (CUDA: ``mem_get_info``)
    name: str  # "cuda", or "cpu stand-in"


_LOCK = threading.Lock()
_STAND_IN: list[Accelerator] = []  # the stand-in in force (``stand_in``), innermost last


def accelerator(tier: str) -> Accelerator:
    """The device for ``tier`` (one of GPU_TIERS): the stand-in inside ``stand_in()``, else
    CUDA's; no GPU is one line naming the tier."""
    with _LOCK:
        if _STAND_IN:
            return _STAND_IN[-1]
    if not torch.cuda.is_available():
        raise OffloadError(f"--tier {tier} {NO_CUDA}")
    device = torch.device("cuda", torch.cuda.current_device())  # the caller's, by index
    return Accelerator(device, CudaOps(device), CudaHostPinning(),
                       lambda: device_free_bytes(device.index), "cuda")


@contextmanager
def stand_in(delay: float = 0.0, free_bytes: int = 64 << 30,
             ops: HostThreadOps | CheckedOps | None = None,
             pinning: HostPinning | None = None) -> Iterator[Accelerator]:
    """The CPU standing in for the GPU (for tests and the GPU check's dry run): every copy
    lands ``delay`` seconds late on a copy thread of its own stream (``ops`` if given),
    ``free_bytes`` of device memory free, host memory "locked" by ``pinning`` (default
    ``NoPinning``). The copy threads stop when the block ends."""
    ops = ops or HostThreadOps(delay=delay)
    acc = Accelerator(torch.device("cpu"), ops, pinning or NoPinning(), lambda: free_bytes,
                      "cpu stand-in")
    with _LOCK:
        _STAND_IN.append(acc)
    try:
        yield acc
    finally:
        with _LOCK:
            _STAND_IN.remove(acc)
        ops.close()
