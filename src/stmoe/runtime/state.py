"""What the offload engine's parts share: one lock, the caches, and the current run.

The engine is split by concern (``hf_glue``: the model's hooks and phase;
``serve``: the compute thread's path through a MoE layer; ``planning``: what to
prefetch for which layer, and when; ``prefetch``: the worker threads). They meet
here, in one ``EngineState``: its lock guards the caches and the run, the compute
thread waits on ``cv`` for slots and the workers on their own condition of the same
lock. ``EngineSettings`` are the engine's knobs. ``RunState`` is one measured
run's progress; ``reset`` replaces it whole, so nothing of a run is carried into
the next.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stmoe.runtime.cache import LayerCache
from stmoe.runtime.stats import RuntimeStats
from stmoe.runtime.store import Block, ExpertStore
from stmoe.runtime.tiers import padded


@dataclass(frozen=True)
class EngineSettings:
    """How an engine serves a model's experts (``stmoe.offload`` resolves them)."""

    capacity: int  # experts cached per MoE layer
    policy: str = "lru"  # which cached expert a load evicts (stmoe.cache_policy)
    workers: int = 2  # prefetch threads (0: every expert loads on demand)
    device: torch.device | None = None  # where the caches live; default: the resident weights'
    max_loads: int | None = None  # loads one prediction may start per layer; default: capacity


Future = dict[tuple[int, int], tuple[int, ...]]  # (forward call, layer) -> the experts it needs


@dataclass(eq=False)
class RunState:
    """One measured run so far (guarded by the engine's lock where workers read it)."""

    stats: RuntimeStats
    future: Future | None  # the oracle's routing, known in advance; {}: its recording pass
    num_layers: int
    fwd: int = -1  # the model's forward call in progress (0: the prompt)
    pos: tuple[int, int] = (-1, -1)  # (call, layer) the compute thread reached: older is stale
    batch: tuple[int, int] = (1, 1)  # this call's (rows, tokens per row)
    phase: str = "prefill"  # "prefill" (the prompt) or "decode" (one token per row)
    # per layer, the (call, experts) last predicted for it: the prediction counted there
    pending: list[tuple[int, frozenset[int]] | None] = field(init=False)
    routing_log: Future = field(default_factory=dict)  # what the recording pass saw
    forward_ends: list[float] = field(default_factory=list)  # perf_counter at each call's end
    started: float = field(default_factory=time.perf_counter)
    prefill_routing: list[np.ndarray] = field(default_factory=list)  # the prompt's, per layer
    mask: np.ndarray | None = None  # [B, S] real (not padding) positions of this call

    def __post_init__(self) -> None:
        self.pending = [None] * self.num_layers


class EngineState:
    """The lock, the per-layer caches, the store and how to read it, and the run."""

    def __init__(self, caches: list[LayerCache], store: ExpertStore,
                 fetch: Callable[[Block, Any], torch.Tensor],
                 device: torch.device) -> None:  # fmt: skip
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)  # the compute thread waits here for slots
        self.caches = caches
        self.store = store
        self.fetch = fetch  # a block's bytes through the engine's tier, refused unless complete
        self.device = device
        self.num_layers = len(caches)
        self.num_experts = int(store.model["num_experts"])
        self.expert_bytes = store.blocks[(0, 0)].nbytes
        self.max_block = max(padded(b) for b in store.blocks.values())  # read buffers' size
        self.closed = False
        self.run = RunState(RuntimeStats(self.num_layers, self.expert_bytes), None,
                            self.num_layers)  # fmt: skip
