"""Counting a trace's routing for the probabilistic predictors (stmoe-plus, hybrid).

Profiling (``profiling.profile``) and stmoe-plus's fit both count pairs of layers
up to ``D_MAX`` apart and consecutive tokens; the counting lives here, apart from
both, so neither imports the other to share it.
"""

from __future__ import annotations

import numpy as np

from stmoe.trace.schema import RoutingTrace
from stmoe.util.jit import njit

D_MAX = 4  # farthest layer distance counted: l -> l+4 (second order at horizon 3)


@njit(cache=True)
def count_pairs(experts, seq_id, n, d_max):  # pragma: no cover - compiled
    """Profiling counts of a trace: (co [D, L-1, N, N], tt [L, N, N]) as float64:
    co[d-1, l, e, f] tokens with e at layer l and f at l+d; tt[l, e, f] consecutive
    tokens of a sequence, e at l, then f at l."""
    t_len, n_layers, k = experts.shape
    co = np.zeros((d_max, max(n_layers - 1, 1), n, n), dtype=np.float64)
    tt = np.zeros((n_layers, n, n), dtype=np.float64)
    for t in range(t_len):
        follows = t > 0 and seq_id[t] == seq_id[t - 1]
        for layer in range(n_layers):
            for d in range(1, d_max + 1):
                if layer + d >= n_layers:
                    break
                for a in range(k):
                    e = experts[t, layer, a]
                    if e < 0:
                        continue
                    for b in range(k):
                        f = experts[t, layer + d, b]
                        if f >= 0:
                            co[d - 1, layer, e, f] += 1.0
            if follows:
                for a in range(k):
                    e = experts[t - 1, layer, a]
                    if e < 0:
                        continue
                    for b in range(k):
                        f = experts[t, layer, b]
                        if f >= 0:
                            tt[layer, e, f] += 1.0
    return co, tt


def pair_counts(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """(pairs [D, L-1, N, N], temporal [L, N, N]) float64 counts of ``trace``."""
    seq_id = np.repeat(np.arange(trace.num_sequences), np.diff(
        np.append(np.asarray(trace.seq_starts), trace.num_tokens)))
    return count_pairs(np.ascontiguousarray(trace.experts, dtype=np.int16),
                       seq_id.astype(np.int64), trace.num_experts, D_MAX)


def layer_tokens(trace: RoutingTrace) -> np.ndarray:
    """[L] int64: tokens with at least one expert at each layer."""
    return (np.asarray(trace.experts) >= 0).any(axis=2).sum(axis=0).astype(np.int64)
