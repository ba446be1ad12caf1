"""The per-layer timing model of docs/method.md's pipeline, compiled (numba).

One *step* is one token of each of B sequences decoding together (B = 1: one
token). For every step and MoE layer l, on two resources, the compute unit and
the off-chip link:

1. attention, then gating (the router's MAC array);
2. verify at the end of gating: routed experts already resident or prefetched
   are hits; prefetches that are not needed and have not started are cancelled
   (stale requests are dropped), those already moving finish (wasted bytes);
3. missed loading: the missing experts load on demand, after the verify latency
   when a prediction was checked, behind whatever the link is still moving;
4. expert compute starts when every routed expert of the layer is on chip; its
   PE-array time uses, per expert, the dataflow that suits the number of tokens
   it serves (or one fixed dataflow), plus the shared experts and the EMU's
   permutation-network latency;
5. when layer l's gating is known (after the EPU's lookup latency for predictors)
   the prefetch for layer l+1 is queued on the link, most confident first,
   behind layer l's misses: it overlaps layer l's expert compute and layer l+1's
   attention. Layer 0's prefetch is issued at the start of the step.

The critical path is compute + stall (waiting for weights); link time that
overlaps compute is hidden. A per-layer cache keeps up to C experts resident
across steps (LRU; C = 0: the buffer holds only experts in use and prefetched).
"""

from __future__ import annotations

import numpy as np

from stmoe._numba import njit

# Indices into the parameter vector handed to the kernel.
P_PE, P_ROUTER, P_BW, P_LAT, P_EPU, P_VERIFY, P_EMU = 0, 1, 2, 3, 4, 5, 6
P_EXPERT_MACS, P_EXPERT_BYTES, P_SHARED_MACS, P_ROUTER_MACS, P_ATTN_FIXED, P_ATTN_CTX = (
    7, 8, 9, 10, 11, 12,
)  # fmt: skip
N_PARAMS = 13

# Indices into the counter vector the kernel returns.
(C_TIME, C_COMPUTE, C_STALL, C_LINK, C_EPU, C_MACS, C_SRAM, C_LOADED, C_PREFETCHED,
 C_WASTED, C_DEMANDED, C_HITS, C_PREDICTED_HITS) = range(13)  # fmt: skip
N_COUNTERS = 13


@njit(cache=True)
def _util(n, peak, half, fixed):  # pragma: no cover - compiled
    """Best PE-array utilisation for n tokens (reconfigurable), or the fixed dataflow's."""
    if fixed >= 0:
        return peak[fixed] * n / (n + half[fixed])
    best = 0.0
    for d in range(peak.shape[0]):
        u = peak[d] * n / (n + half[d])
        if u > best:
            best = u
    return best


@njit(cache=True)
def simulate_steps(
    experts,
    pos,
    step_ptr,
    step_tok,
    plan_ptr,
    plan_ids,
    params,
    peak,
    half,
    fixed,
    cache_cap,
    use_predictor,
    num_experts,
    warm,
):  # pragma: no cover - compiled
    """Run every step through every layer; returns the counters (see ``C_*``).

    ``warm``: the cache starts full (every expert resident when the capacity allows).
    """
    n_layers = experts.shape[1]
    n = num_experts
    out = np.zeros(N_COUNTERS)
    resident = np.zeros((n_layers, n), dtype=np.bool_)
    last_use = np.zeros((n_layers, n))
    n_res = np.zeros(n_layers, dtype=np.int64)
    if warm:  # the first min(C, N) experts of each layer start resident
        resident[:, : min(cache_cap, n)] = True
        n_res[:] = min(cache_cap, n)
    in_u = np.zeros(n, dtype=np.int64)  # tokens of this step routed to each expert
    in_p = np.zeros(n, dtype=np.bool_)
    avail = np.zeros(n)  # when each routed expert is on chip
    q_e = np.zeros(n, dtype=np.int64)  # the prefetch queue for the next layer
    q_n = 0
    q_start = 0.0
    u_list = np.zeros(n, dtype=np.int64)
    xfer = params[P_LAT] + params[P_EXPERT_BYTES] / params[P_BW]
    t_c = 0.0
    link_free = 0.0
    clock = 0.0
    for s in range(step_ptr.shape[0] - 1):
        toks = step_tok[step_ptr[s] : step_ptr[s + 1]]
        b = toks.shape[0]
        # Layer 0's prefetch is issued when the step starts (HT[0], docs/method.md).
        issue = t_c + (params[P_EPU] if use_predictor else 0.0)
        out[C_EPU] += params[P_EPU] if use_predictor else 0.0
        free_before = link_free
        q_n, q_start, link_free, n_pred = _queue(toks, 0, plan_ptr, plan_ids, n_layers, resident,
                                                 in_p, q_e, issue, link_free, xfer)  # fmt: skip
        for layer in range(n_layers):
            clock += 1.0
            attn = 0.0
            for t in toks:
                attn += params[P_ATTN_FIXED] + params[P_ATTN_CTX] * pos[t]
            t_att = attn / (params[P_PE] * _util(b, peak, half, fixed))
            t_gate = t_c + t_att + params[P_ROUTER_MACS] * b / params[P_ROUTER]
            # Union of the step's routed experts, with tokens per expert.
            n_u = 0
            for t in toks:
                for e in experts[t, layer]:
                    if e < 0:
                        continue
                    if in_u[e] == 0:
                        u_list[n_u] = e
                        n_u += 1
                    in_u[e] += 1
            out[C_DEMANDED] += n_u
            for i in range(n_u):
                avail[u_list[i]] = -1.0
                if resident[layer, u_list[i]]:
                    avail[u_list[i]] = t_gate
                    out[C_HITS] += 1
            # Verify: walk the prefetch queue in order. A transfer that started before the
            # check completes (used or wasted); of the rest, unneeded ones are cancelled.
            checked = use_predictor and n_pred > 0
            verify_end = t_gate + (params[P_VERIFY] if checked else 0.0)
            r = q_start
            kept = 0
            started = True
            for i in range(q_n):
                e = q_e[i]
                needed = in_u[e] > 0
                if started and r >= verify_end:
                    # The rest had not started: unneeded ones are cancelled, needed ones
                    # go on right after verify, no later than misses would.
                    started = False
                    r = max(verify_end, r if kept > 0 else free_before)
                if started or needed:
                    kept += 1
                    r += xfer
                    out[C_LOADED] += 1
                    out[C_PREFETCHED] += 1
                    out[C_LINK] += xfer
                    if needed:
                        avail[e] = r
                        out[C_HITS] += 1
                        out[C_PREDICTED_HITS] += 1
                    else:
                        out[C_WASTED] += 1
                        _insert(layer, e, resident, last_use, n_res, in_u, cache_cap, clock - 0.5)
                in_p[e] = False
            # Cancelled transfers give their link time back.
            link_free = r if kept > 0 else free_before
            q_n = 0
            # Missed loading, behind the link's queue, after verify when one ran.
            start = max(verify_end, link_free)
            for i in range(n_u):
                e = u_list[i]
                if avail[e] < 0.0:
                    start += xfer
                    avail[e] = start
                    out[C_LOADED] += 1
                    out[C_LINK] += xfer
            link_free = max(link_free, start)
            ready = t_gate
            for i in range(n_u):
                if avail[u_list[i]] > ready:
                    ready = avail[u_list[i]]
            # Expert compute on the PE array: per-expert dataflow, shared experts, EMU.
            comp = params[P_EMU]
            for i in range(n_u):
                e = u_list[i]
                rate = params[P_PE] * _util(in_u[e], peak, half, fixed)
                comp += params[P_EXPERT_MACS] * in_u[e] / rate
                out[C_MACS] += params[P_EXPERT_MACS] * in_u[e]
                out[C_SRAM] += params[P_EXPERT_BYTES]
            if params[P_SHARED_MACS] > 0:
                comp += params[P_SHARED_MACS] * b / (params[P_PE] * _util(b, peak, half, fixed))
            out[C_MACS] += params[P_SHARED_MACS] * b + attn + params[P_ROUTER_MACS] * b
            out[C_COMPUTE] += (t_gate - t_c) + comp
            out[C_STALL] += ready - t_gate
            t_c = ready + comp
            # The used experts stay resident (LRU) while the cache has room.
            for i in range(n_u):
                _insert(layer, u_list[i], resident, last_use, n_res, in_u, cache_cap, clock)
            for i in range(n_u):
                in_u[u_list[i]] = 0
            # Prefetch for the next layer, once this layer's gating is known.
            if layer + 1 < n_layers:
                issue = t_gate + (params[P_EPU] if use_predictor else 0.0)
                out[C_EPU] += params[P_EPU] if use_predictor else 0.0
                free_before = link_free
                q_n, q_start, link_free, n_pred = _queue(
                    toks,
                    layer + 1,
                    plan_ptr,
                    plan_ids,
                    n_layers,
                    resident,
                    in_p,
                    q_e,
                    issue,
                    link_free,
                    xfer,
                )
    out[C_TIME] = t_c
    return out


@njit(cache=True)
def _queue(
    toks, layer, plan_ptr, plan_ids, n_layers, resident, in_p, q_e, issue, link_free, xfer
):  # pragma: no cover - compiled
    """Queue the step's prefetch for ``layer``: the union of its tokens' sets, rank by
    rank (most confident first), minus what is resident.
    Returns (queued, start, tentative link end, predicted experts incl. resident ones)."""
    n_q = 0
    n_pred = 0
    longest = 0
    for t in toks:
        size = plan_ptr[t * n_layers + layer + 1] - plan_ptr[t * n_layers + layer]
        if size > longest:
            longest = size
    for rank in range(longest):
        for t in toks:
            a = plan_ptr[t * n_layers + layer]
            if a + rank < plan_ptr[t * n_layers + layer + 1]:
                e = plan_ids[a + rank]
                n_pred += 1
                if not in_p[e] and not resident[layer, e]:
                    in_p[e] = True
                    q_e[n_q] = e
                    n_q += 1
    start = max(issue, link_free)
    return n_q, start, start + n_q * xfer if n_q else link_free, n_pred


@njit(cache=True)
def _insert(layer, e, resident, last_use, n_res, in_use, cap, stamp):  # pragma: no cover
    """Keep ``e`` resident at ``layer`` if the cache has (or can make, by LRU) room."""
    if cap <= 0:
        return
    if resident[layer, e]:
        last_use[layer, e] = stamp
        return
    if n_res[layer] >= cap:
        victim = -1
        for x in range(resident.shape[1]):
            older = victim < 0 or last_use[layer, x] < last_use[layer, victim]
            if resident[layer, x] and in_use[x] == 0 and older:
                victim = x
        if victim < 0:
            return
        resident[layer, victim] = False
        n_res[layer] -= 1
    resident[layer, e] = True
    last_use[layer, e] = stamp
    n_res[layer] += 1
