"""What one host-pipeline simulation takes: the host's costs and the run (``pipeline.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stmoe.sim.specs import SpecError
from stmoe.util.units import layer_capacities


@dataclass(frozen=True)
class HostCosts:
    """Seconds on this host (``host_costs`` derives them from a hardware spec)."""

    layer_s: float  # non-expert work per MoE layer and token
    token_s: float  # per forward call outside the MoE layers
    expert_s: float  # one routed expert for one token
    read_s: float  # one expert read alone (latency + bytes / bandwidth)
    # extra for a read into a spare row past the capacity (its page faults); never for a
    # read into a slot: the runtime faults the slots in when it makes the cache
    first_touch_s: float
    parallel: float  # the tier's speed with >= 2 readers, relative to one reader
    workers: int
    fifo: bool  # one serial link (emulated) rather than a shared device (disk)
    chunks: int = 1  # pieces of a worker's read (the compute thread's reads are whole)
    chunk_s: float = 0.0  # one piece alone (0: read_s / chunks)
    free_waste: bool = False  # a wasted read costs admission no saved read (a GPU's copies)
    # a predicting system's own work on the compute thread per decode layer call
    # (``[host.predictors]``; 0: no predictor, or not measured): the planner's but the
    # predictor's answer, the answer (not where admission has the layer's prefetch off),
    # admission's look at the layer's last set (where admission is on)
    learn_s: float = 0.0
    predict_s: float = 0.0
    admission_s: float = 0.0


@dataclass(frozen=True)
class HostRun:
    """One sequence through the runtime: what it routes and what is predicted."""

    experts: np.ndarray  # [prefill + decode, L, K] int routing of the sequence's tokens
    prefill: int  # tokens of the prompt's forward call
    plan: tuple[np.ndarray, np.ndarray] | None  # (ptr, ids) of every (token, layer)'s set
    oracle: bool  # the sets are the routed experts themselves (decode only)
    capacity: int | tuple[int, ...]  # experts cached per layer: alike, or each layer's
    policy: str  # lru, lfu, none or score
    admission: bool = False  # the runtime's per-layer prefetch admission (stmoe.admission)
    horizon: int = 1  # layers ahead the predictor's sets are for (admission's budget)
    # [T*L, N] the scores each set was ranked from (``Predictor.scored_plan``): policy score
    scores: np.ndarray | None = None


def host_capacities(capacity: object, num_experts: int, top_k: int,
                    num_layers: int) -> tuple[int, ...]:
    """Each layer's cache from a run's ``capacity``: one count for every layer, or one count
    per layer, each checked (``layer_capacities``: top-k to N, as many as the layers); any
    other form (a share, a string) refused, never read as something else."""
    if isinstance(capacity, (int, np.integer)) and not isinstance(capacity, bool):
        counts: list[int] = [int(capacity)] * num_layers
    elif isinstance(capacity, (tuple, list)) and all(
            isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in capacity):
        counts = [int(c) for c in capacity]
    else:
        raise SpecError(f"capacity {capacity!r}: the host pipeline takes a count of experts "
                        "per layer, or one count per MoE layer")
    caps = layer_capacities(counts, num_experts, top_k, num_layers=num_layers, error=SpecError)
    assert caps is not None  # (counts: never a byte budget)
    return caps
