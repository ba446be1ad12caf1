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
   the prefetch for layer l+1 is queued on the link, behind layer l's misses: it
   overlaps layer l's expert compute and layer l+1's attention. Layer 0's
   prefetch is issued at the start of the step. With several tokens in a step the
   queue is the union of their sets by the batch rule of ``stmoe.predictors.union``
   (experts more tokens predict first, then by best rank, then by id).

The critical path is compute + stall (waiting for weights); link time that
overlaps compute is hidden. A per-layer cache keeps up to C experts resident
across steps (C = 0: the buffer holds only experts in use and prefetched); its
victims are chosen by a policy of ``stmoe.cache_policy`` (``lru`` or ``lfu``),
never among the step's routed experts. Used experts are kept, then prefetched
ones that went unused (stamped just before the step's use).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from stmoe import cache_policy as cp
from stmoe.predictors.union import vote_union
from stmoe.util.jit import njit

# Indices into the parameter vector handed to the kernel.
P_PE, P_ROUTER, P_BW, P_LAT, P_EPU, P_VERIFY, P_EMU = 0, 1, 2, 3, 4, 5, 6
P_EXPERT_MACS, P_EXPERT_BYTES, P_SHARED_MACS, P_ROUTER_MACS, P_ATTN_FIXED, P_ATTN_CTX = (
    7, 8, 9, 10, 11, 12,
)
N_PARAMS = 13

# Indices into the counter vector the kernel returns.
(C_TIME, C_COMPUTE, C_STALL, C_LINK, C_EPU, C_MACS, C_SRAM, C_LOADED, C_PREFETCHED,
 C_WASTED, C_DEMANDED, C_HITS, C_PREDICTED_HITS) = range(13)
N_COUNTERS = 13
_NO_FUTURE = np.zeros(0, dtype=np.int64)  # next uses: belady is not simulated (cache_policy)
_NO_SCORES = cp.NO_SCORES  # nor score eviction


# What ``simulate_steps`` takes, in four groups (built once per run, so NamedTuples).
class Steps(NamedTuple):
    """What runs: the routing, and the tokens of each step."""

    experts: np.ndarray  # [T, L, K] int16: the routed experts (-1 empty)
    pos: np.ndarray  # [T] int64: each token's position in its sequence (attention context)
    ptr: np.ndarray  # [S+1] int64: step s holds tok[ptr[s]:ptr[s+1]]
    tok: np.ndarray  # int64 token indices


class Prefetch(NamedTuple):
    """What is prefetched: every (token, layer)'s ranked set, as PrefetchPlan's CSR."""

    ptr: np.ndarray  # [T*L+1] int64
    ids: np.ndarray  # int16
    use_predictor: bool  # a prediction unit sits in the pipeline (EPU lookup, verify)


class Machine(NamedTuple):
    """The model on the hardware: costs and the PE array's dataflows."""

    params: np.ndarray  # [N_PARAMS] float: see ``P_*``
    peak: np.ndarray  # [D] each dataflow's peak utilisation
    half: np.ndarray  # [D] tokens at which each reaches half its peak
    fixed: int  # the one dataflow used, or -1: the best for each expert (reconfigurable)
    num_experts: int  # N, experts per layer


class Cache(NamedTuple):
    """The per-layer expert cache."""

    capacity: int  # experts kept per layer (0: only those in use and prefetched)
    policy: int  # ``cache_policy`` code
    warm: bool  # starts full: the first min(C, N) experts of each layer resident


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
def simulate_steps(steps, prefetch, machine, cache):  # pragma: no cover - compiled
    """Run every step through every layer; returns the counters (see ``C_*``).

    ``steps``, ``prefetch``, ``machine``, ``cache``: a ``Steps``, ``Prefetch``,
    ``Machine`` and ``Cache``.
    """
    experts, pos, step_ptr, step_tok = steps
    plan_ptr, plan_ids, use_predictor = prefetch
    params, peak, half, fixed, n = machine
    cache_cap, policy, warm = cache
    n_layers = experts.shape[1]
    out = np.zeros(N_COUNTERS)
    resident = np.zeros((n_layers, n), dtype=np.bool_)
    last_use = np.zeros((n_layers, n))
    uses = np.zeros((n_layers, n))
    n_res = np.zeros(n_layers, dtype=np.int64)
    state = (resident, last_use, uses, n_res, cache_cap, policy)
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
        order, n_pred = _step_union(toks, 0, plan_ptr, plan_ids, n_layers)
        q_n, q_start, link_free = _queue(order, resident[0], in_p, q_e, issue, link_free, xfer)
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
                        _insert(layer, e, clock - 0.5, state, in_u)
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
            # The used experts stay resident while the cache has (or can make) room.
            for i in range(n_u):
                uses[layer, u_list[i]] += 1
                _insert(layer, u_list[i], clock, state, in_u)
            for i in range(n_u):
                in_u[u_list[i]] = 0
            # Prefetch for the next layer, once this layer's gating is known.
            if layer + 1 < n_layers:
                issue = t_gate + (params[P_EPU] if use_predictor else 0.0)
                out[C_EPU] += params[P_EPU] if use_predictor else 0.0
                free_before = link_free
                order, n_pred = _step_union(toks, layer + 1, plan_ptr, plan_ids, n_layers)
                q_n, q_start, link_free = _queue(order, resident[layer + 1], in_p, q_e, issue,
                                                 link_free, xfer)
    out[C_TIME] = t_c
    return out


@njit(cache=True)
def _step_union(toks, layer, plan_ptr, plan_ids, n_layers):  # pragma: no cover - compiled
    """The step's prefetch for ``layer``: the union of its tokens' sets by the batch
    rule (one vote per predicted expert). Returns (ids in order, predictions made)."""
    sets = toks * n_layers + layer
    n_pred = 0
    for i in sets:
        n_pred += plan_ptr[i + 1] - plan_ptr[i]
    return vote_union(plan_ids, plan_ptr, sets), n_pred


@njit(cache=True)
def _queue(order, resident, in_p, q_e, issue, link_free, xfer):  # pragma: no cover - compiled
    """Queue ``order`` minus what is resident at the layer (``resident``) on the link.
    Returns (queued, start, tentative link end)."""
    n_q = 0
    for e in order:
        if not in_p[e] and not resident[e]:
            in_p[e] = True
            q_e[n_q] = e
            n_q += 1
    start = max(issue, link_free)
    return n_q, start, start + n_q * xfer if n_q else link_free


@njit(cache=True)
def _insert(layer, e, stamp, state, in_use):  # pragma: no cover - compiled
    """Keep ``e`` resident at ``layer`` if the cache has (or its policy can make) room.

    ``state``: (resident, last_use, uses, resident count per layer, capacity, policy);
    the step's routed experts (``in_use`` > 0) are never victims."""
    resident, last_use, uses, n_res, cap, policy = state
    if cap <= 0:
        return
    if resident[layer, e]:
        last_use[layer, e] = stamp
        return
    if n_res[layer] >= cap:
        victim = cp.choose_victim(resident[layer], in_use, last_use[layer], uses[layer],
                                  _NO_FUTURE, _NO_SCORES, policy)
        if victim < 0:
            return
        resident[layer, victim] = False
        n_res[layer] -= 1
    resident[layer, e] = True
    last_use[layer, e] = stamp
    n_res[layer] += 1
