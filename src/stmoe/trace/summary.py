"""One-glance facts about a trace: what ``stmoe info`` prints."""

from __future__ import annotations

from typing import Any

import numpy as np

from stmoe.trace.ranks import is_ranked
from stmoe.trace.schema import _CHUNK_TOKENS, RoutingTrace


def expert_load(trace: RoutingTrace) -> np.ndarray:
    """[L, N] int64, how many tokens routed to each expert at each layer.

    Walks the trace in chunks, so a memory-mapped trace is never loaded whole.
    """
    n, layers = trace.num_experts, trace.num_layers
    counts = np.zeros(layers * n, dtype=np.int64)
    offsets = (np.arange(layers, dtype=np.int64) * n)[None, :, None]
    for a in range(0, trace.num_tokens, _CHUNK_TOKENS):
        block = np.asarray(trace.experts[a : a + _CHUNK_TOKENS], dtype=np.int64)
        valid = block >= 0
        counts += np.bincount((block + offsets)[valid], minlength=layers * n)
    return counts.reshape(layers, n)


def summarize(trace: RoutingTrace) -> dict[str, Any]:
    """A JSON-ready summary; key names are a contract (``stmoe info --json``)."""
    load = expert_load(trace)
    mean = load.mean(axis=1)
    balance = np.divide(load.max(axis=1), mean, out=np.zeros(len(mean)), where=mean > 0)
    seq_of_domain: dict[str, dict[str, int]] = {}
    lengths = trace.seq_lengths
    decode = np.asarray(trace.is_decode)
    for s, sl in trace.sequences():
        entry = seq_of_domain.setdefault(
            trace.domains[s], {"sequences": 0, "tokens": 0, "decode_tokens": 0}
        )
        entry["sequences"] += 1
        entry["tokens"] += int(lengths[s])
        entry["decode_tokens"] += int(np.count_nonzero(decode[sl]))
    n_decode = int(np.count_nonzero(decode))
    return {
        "model": trace.meta.model,
        "source": trace.meta.source,
        "synthetic": trace.meta.synthetic,
        "tokens": trace.num_tokens,
        "layers": trace.num_layers,
        "top_k": trace.top_k,
        "num_experts": trace.num_experts,
        "sequences": trace.num_sequences,
        "prefill_tokens": trace.num_tokens - n_decode,
        "decode_tokens": n_decode,
        "has_weights": trace.weights is not None,
        # False where the source does not keep the router's rank inside a row (vLLM)
        "rank_order": is_ranked(trace),
        "domains": seq_of_domain,
        "empty_slots": int(trace.num_tokens * trace.num_layers * trace.top_k - load.sum()),
        "load_balance_max_over_mean": [round(float(x), 4) for x in balance],
        "experts_unused_per_layer": [int(x) for x in (load == 0).sum(axis=1)],
    }
