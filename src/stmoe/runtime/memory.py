"""The process's memory: a whole-process budget turned into a cache size (``--memory``), and
resident-memory sampling for the steadiness checks of long offloaded generations."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from stmoe.errors import OffloadError

if TYPE_CHECKING:
    from stmoe.runtime.engine import OffloadEngine


def _status_bytes(key: str) -> int:
    """A field of /proc/self/status in bytes (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# The shared libraries' pages this process maps (Python's, torch's): file-backed, so not in
# RssAnon; taken when this module is imported, before any weight is.
_LIBRARIES = _status_bytes("RssFile")


def process_bytes(model: torch.nn.Module) -> int:
    """What the process needs as it stands, for ``plan_memory``: its anonymous memory (after
    a collection and, with glibc, ``malloc_trim``: quantizing frees hundreds of MB the heap
    keeps), its shared libraries, and the model's live non-meta tensors. Weights mapped from
    the checkpoint are file pages, not in RssAnon; those dropped (a linear replaced by its
    quantized form) stay mapped but are clean and reclaimable, so they are not counted, and
    tensors in anonymous memory are counted twice: an overestimate, on the safe side."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the heap as it is
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    live = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
               if not t.is_meta)
    anon = _status_bytes("RssAnon") or rss_bytes()
    return anon + _LIBRARIES + live


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryProbe:
    """Samples RSS and the largest cache occupancy every ``every`` forward calls."""

    def __init__(self, model: torch.nn.Module, engine: OffloadEngine, every: int = 50) -> None:
        self.engine, self.every = engine, every
        self.samples: list[tuple[int, int]] = []  # (forward call, rss bytes)
        self.peak_cached = 0  # most experts any layer's cache held at a sample
        self._calls = 0
        self._hook = model.register_forward_hook(self._sample)

    def _sample(self, *_: Any) -> None:
        self._calls += 1
        if self._calls % self.every == 0:
            self.samples.append((self._calls, rss_bytes()))
            self.peak_cached = max(self.peak_cached, self.engine.most_cached())

    def close(self) -> None:
        self._hook.remove()

    def growth_after(self, warmup: int) -> float:
        """Largest RSS after ``warmup`` forward calls relative to the first sample after it."""
        after = [rss for call, rss in self.samples if call >= warmup]
        if len(after) < 2 or after[0] == 0:
            return 0.0
        return max(after) / after[0] - 1.0


# What a whole-process budget keeps beside the expert cache (``plan_memory``): the KV cache and
# activations of a generation (a few MiB a thousand tokens at these sizes) and the allocator's
# slack. Bytes; a round figure, not measured per model.
KV_RESERVE = 256 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """How ``--memory`` is spent: the process as it stands (``process_bytes``: interpreter,
    torch, the model's non-expert weights, the predictor), the reserve, the expert cache;
    bytes, and experts per layer."""

    memory: int
    process: int
    reserve: int  # KV cache and activations, read buffers, a long prompt's spare rows
    cache: int  # on a gpu tier: what the tier holds in host memory (``host``)
    per_layer: int
    # a gpu tier's: the GPU's plan (``DevicePlan`` as a dict: the expert slots are there)
    # and what the host holds for the tier (the pinned store, or the bounce buffers)
    device: dict[str, int] | None = None
    host: str = ""

    def describe(self) -> str:
        gib = 1 / 2**30
        if self.device is not None:
            return (f"{self.memory * gib:.2f} GiB for the process: {self.process * gib:.2f} "
                    f"GiB as loaded, {self.reserve * gib:.2f} GiB of read buffers, "
                    f"{self.cache * gib:.2f} GiB {self.host}; "
                    + DevicePlan(**self.device).describe())
        return (f"{self.memory * gib:.2f} GiB for the process: {self.process * gib:.2f} GiB as "
                f"loaded (interpreter, torch, non-expert weights, predictor), "
                f"{self.reserve * gib:.2f} GiB "
                f"reserved (KV cache, read buffers, a prompt's spare rows), expert cache "
                f"{self.cache * gib:.2f} GiB = {self.per_layer} experts per layer")


def plan_memory(memory: int, process: int, num_layers: int, num_experts: int, top_k: int,
                expert_bytes: int, workers: int, buffer_bytes: int | None = None) -> MemoryPlan:
    """The largest cache (experts per layer) that keeps the whole process within ``memory``
    bytes, page cache included: ``process`` (its RSS now), the KV reserve, one read buffer
    per thread, and the spare rows a prompt routing one layer to every expert pages in
    (N - C of them) beside L x C cached experts. Too little memory for top-K per layer is
    one clear error naming what would do. ``buffer_bytes``: each read buffer's (default
    ``expert_bytes``; reading in place needs one chunk more: ``tiers.buffer_bytes``)."""
    buffers = (workers + 1) * (buffer_bytes or expert_bytes)
    free = memory - process - KV_RESERVE - buffers
    if free >= num_layers * num_experts * expert_bytes:
        per_layer = num_experts
    elif num_layers > 1:  # L*C + (N - C) experts fit
        per_layer = (free - num_experts * expert_bytes) // ((num_layers - 1) * expert_bytes)
    else:
        per_layer = num_experts if free >= num_experts * expert_bytes else 0
    per_layer = int(min(per_layer, num_experts))
    if per_layer < top_k:
        need = (process + KV_RESERVE + buffers
                + ((num_layers - 1) * top_k + num_experts) * expert_bytes)
        raise OffloadError(f"--memory {memory / 2**30:.2f} GiB cannot hold this model's process "
                           f"({process / 2**30:.2f} GiB as loaded) and top-{top_k} experts per "
                           f"layer; give at least {_at_least(need)}")
    spare = (num_experts - per_layer) * expert_bytes
    cache = num_layers * per_layer * expert_bytes
    return MemoryPlan(memory, process, KV_RESERVE + buffers + spare, cache, per_layer)


def _at_least(need: int) -> str:
    """A minimum as a value ``--memory`` takes as it is: GiB, rounded up, beside the same in
    whole MiB (a user who reads "0.70 GiB" and types 0.70GB, 0.65 GiB, was refused again)."""
    return f"{need / 2**30:.2f} GiB (--memory {-(-need // 2**20)}MiB)"


# What a GPU's plan keeps beside the resident weights, the KV cache and the expert slots:
# activations, the CUDA context's own allocations, cuBLAS workspaces and the caching
# allocator's fragmentation. Bytes; a round figure, not measured per model.
DEVICE_RESERVE = 1 << 30


@dataclass(frozen=True)
class DevicePlan:
    """How a GPU's free memory is spent (``--memory`` on the gpu tiers): the resident
    weights, the KV cache, the reserve (with one layer's gathered copy), the expert slots."""

    free: int  # device memory free before the model moved there (``torch.cuda.mem_get_info``)
    resident: int
    kv: int
    reserve: int
    cache: int
    per_layer: int

    def describe(self) -> str:
        gib = 1 / 2**30
        return (f"{self.free * gib:.2f} GiB free on the GPU: {self.resident * gib:.2f} GiB "
                f"resident weights, {self.kv * gib:.2f} GiB KV cache, "
                f"{self.reserve * gib:.2f} GiB reserved (activations, a long prompt's "
                f"gathered experts), expert slots {self.cache * gib:.2f} GiB = "
                f"{self.per_layer} experts per layer")


def plan_device_memory(free: int, resident: int, kv: int, num_layers: int, num_experts: int,
                       top_k: int, expert_bytes: int,
                       reserve: int = DEVICE_RESERVE) -> DevicePlan:
    """The most expert slots per layer a GPU with ``free`` bytes holds beside ``resident``
    bytes of non-expert weights and a KV cache of ``kv`` bytes (``kv_cache_bytes``), a
    reserve, and the compact copy a long prompt's layer computes on (up to every expert of
    one layer, beyond the slots: on a GPU the needed experts are gathered). Fewer than
    top-K per layer is one clear error naming what would do."""
    gather = num_experts * expert_bytes
    room = free - resident - kv - reserve - gather
    per_layer = int(min(num_experts, max(room, 0) // max(num_layers * expert_bytes, 1)))
    if per_layer < top_k:
        need = resident + kv + reserve + gather + num_layers * top_k * expert_bytes
        raise OffloadError(f"the GPU has {free / 2**30:.2f} GiB free, too little for this "
                           f"model's resident weights ({resident / 2**30:.2f} GiB), KV cache "
                           f"({kv / 2**30:.2f} GiB) and top-{top_k} experts per layer; it "
                           f"needs at least {need / 2**30:.2f} GiB")
    return DevicePlan(free, resident, kv, reserve + gather, num_layers * per_layer * expert_bytes,
                      per_layer)


def plan_gpu_memory(memory: int, process: int, buffers: int, host: int, what: str,
                    device: DevicePlan) -> MemoryPlan:
    """``--memory`` on a gpu tier: the expert slots are the GPU's (``device``), and the host
    must hold the process as loaded, the read buffers and what the tier keeps there
    (``host`` bytes: the pinned store, or the bounce buffers, named by ``what``); too little
    is one clear error naming what would do."""
    need = process + buffers + host
    if need > memory:
        hint = ("; --tier gpu-disk keeps only a few bounce buffers in host memory"
                if "store" in what else "")
        raise OffloadError(f"--memory {memory / 2**30:.2f} GiB cannot hold this model's process "
                           f"({process / 2**30:.2f} GiB as loaded) and {what} "
                           f"({host / 2**30:.2f} GiB); give at least {_at_least(need)}{hint}")
    return MemoryPlan(memory, process, buffers, host, device.per_layer, asdict(device), what)


# The context a GPU plan keeps the KV cache of: one sequence of this many tokens.
KV_TOKENS = 4096


def model_kv_bytes(config: Any, dtype_bytes: int, tokens: int = KV_TOKENS) -> int:
    """``kv_cache_bytes`` of a transformers config (its text part): every decoder layer's
    keys and values, ``tokens`` positions of one sequence."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return kv_cache_bytes(int(text.num_hidden_layers), kv_heads, head_dim, tokens,
                          dtype_bytes=dtype_bytes)


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, batch: int = 1,
                   dtype_bytes: int = 2) -> int:
    """A standard attention KV cache's bytes: keys and values of every layer, head and
    token. (Latent or linear attention holds less: give its own figure to the plan.)"""
    return 2 * layers * kv_heads * head_dim * tokens * batch * dtype_bytes


def device_free_bytes(device: int | None = None) -> int:
    """Memory a CUDA device can give this process now: the driver's free memory
    (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds unused, which
    the driver counts as taken (an earlier model's, or a closed offload's, freed blocks)."""
    if not torch.cuda.is_available():
        raise OffloadError("planning GPU memory needs CUDA, and torch sees no GPU here")
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(torch.cuda.mem_get_info(device)[0]) + max(0, int(cached))
