"""The offloading runtime's pipeline on a host CPU: a timing model of ``stmoe.runtime``.

The accelerator pipeline (``pipeline.py``) is the paper's; this one is what
``stmoe generate`` / ``OffloadedModel.force_routing`` does on this machine, step by
step, so that ``stmoe simulate --pipeline runtime`` with a ``stmoe calibrate``
preset predicts the runtime's measured decode time. One sequence: the prompt
in one forward call (its time is not counted: the runtime's decode time starts
when it ends), then one forward call per decode token. At every MoE layer:

1. the layer's non-expert work (``layer_s``: attention, norms, router, the
   runtime's bookkeeping) on the compute thread;
2. the layer begins: queued prefetches for it (or older) are now *stale* and
   dropped when a worker reaches them; the routed experts are pinned;
3. the planner: the predictor's set for the next layer (wrapping to the next
   token's layer 0) is queued, most confident first, the experts not cached yet;
   the set is protected from eviction until its layer begins; idle workers start
   its loads at once unless this layer stalls (step 4 pauses them first);
4. ensure (the *stall*): each routed expert READY is a hit; LOADING (a prefetch
   in flight) is a hit waited for; any other is a miss the compute thread loads
   itself, one after the other. While any routed expert is not READY the workers
   start no new read (``Prefetcher.pause``; reads in flight go on), so what the
   layer waits for shares the tier only with those; when ensure ends they
   resume, and the next layer's loads run during this layer's compute. An expert
   no slot can take (every slot pinned, protected or being read) is read into a
   spare row past the capacity, fresh memory each call: only such a read pays
   ``first_touch_s`` (its page faults), as the runtime faults the slots' memory
   in when it makes the cache (a prompt's extra experts; in decode only where
   the next call's set protects this very layer, a model of one MoE layer);
5. the experts compute (per routed token-expert pair); with policy ``none``
   every slot is then freed.

Prefetch workers (unless paused) take the most urgent request (forward call,
layer, rank), skip a stale one, claim a slot (the policy's victim among READY
experts neither pinned nor protected; none: the request is dropped) and read.
Reads share the tier as ``link`` models it. After the prompt, the
predictor's set for the first decode token's layer 0 is queued (the oracle's
sets start with decode). Cache victims come from ``stmoe.cache_policy`` with the
runtime's stamps (one step per layer call; a prefetch is stamped with the step
it is loaded for).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from stmoe import cache_policy as cp
from stmoe.sim.host.link import FifoLink, SharedLink
from stmoe.sim.specs import SpecError

_NO_FUTURE = np.zeros(0, dtype=np.int64)
ABSENT, LOADING, READY = 0, 1, 2


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


@dataclass(frozen=True)
class HostRun:
    """One sequence through the runtime: what it routes and what is predicted."""

    experts: np.ndarray  # [prefill + decode, L, K] int routing of the sequence's tokens
    prefill: int  # tokens of the prompt's forward call
    plan: tuple[np.ndarray, np.ndarray] | None  # (ptr, ids) of every (token, layer)'s set
    oracle: bool  # the sets are the routed experts themselves (decode only)
    capacity: int  # experts cached per layer
    policy: str  # lru, lfu or none


class _Sim:
    def __init__(self, run: HostRun, costs: HostCosts, num_experts: int) -> None:
        self.run, self.c = run, costs
        self.code = cp.policy_code(run.policy, cp.RUNTIME, SpecError)
        n_layers = run.experts.shape[1]
        shape = (n_layers, num_experts)
        self.state = np.zeros(shape, dtype=np.int8)
        self.prefetched = np.zeros(shape, dtype=np.bool_)
        self.used = np.zeros(shape, dtype=np.bool_)
        self.last_use = np.zeros(shape, dtype=np.int64)
        self.uses = np.zeros(shape, dtype=np.int64)
        self.pinned = np.zeros(shape, dtype=np.bool_)
        self.protected = np.zeros(shape, dtype=np.bool_)
        self.size = np.zeros(n_layers, dtype=np.int64)
        self.clock = np.zeros(n_layers, dtype=np.int64)
        self.link = FifoLink() if costs.fifo else SharedLink(costs.parallel)
        # reads in progress: id -> (layer, expert, by a worker, page faults after the device)
        self.reads: dict[int, tuple[int, int, bool, float]] = {}
        self.landing: list[tuple[float, int]] = []  # (when, id): device done, faults left
        self.started = 0
        self.queue: list[tuple[int, int, int, int]] = []  # (call, layer, rank, expert)
        self.idle = costs.workers
        self.paused = False  # the compute thread stalls: the workers start no new read
        self.pos = (-1, -1)
        self.t = 0.0
        self.count = {k: 0 for k in ("demanded", "hits", "late", "misses", "prefetch_loads",
                                     "stale", "wasted", "dropped", "moved", "spare")}
        self.counting = False
        self.stall = 0.0

    # ---- the tier and the workers ----------------------------------------------------
    def _read(self, layer: int, e: int, worker: bool, t: float, spare: bool) -> int:
        """Start a read; one into a spare row (``spare``: fresh memory each call) keeps the
        reading thread busy with its page faults after the device is done with it
        (``first_touch_s``), not the device. A slot's memory is faulted in already."""
        rid = self.started
        self.started += 1
        self.reads[rid] = (layer, e, worker, self.c.first_touch_s if spare else 0.0)
        self.count["moved"] += 1  # the whole run's, prompt included, as bytes_moved
        self.count["spare"] += spare and self.counting
        self.link.start(rid, t, self.c.read_s)
        return rid

    def _next(self) -> float:
        return min(self.link.next_done(), self.landing[0][0] if self.landing else math.inf)

    def _advance(self, until: float) -> None:
        """Every read landing by ``until`` lands; freed workers take the next job."""
        while self._next() <= until:
            if self.landing and self.landing[0][0] <= self.link.next_done():
                t, rid = heapq.heappop(self.landing)
            else:
                t, rid = self.link.pop()
                if self.reads[rid][3] > 0:  # its page faults still to come
                    heapq.heappush(self.landing, (t + self.reads[rid][3], rid))
                    continue
            layer, e, worker, _ = self.reads.pop(rid)
            if e >= 0:
                self.state[layer, e] = READY
            if worker:
                self.idle += 1
                self._dispatch(t)

    def _dispatch(self, t: float) -> None:
        while self.idle > 0 and self.queue and not self.paused:
            fwd, layer, _rank, e = heapq.heappop(self.queue)
            if (fwd, layer) <= self.pos:
                self.count["stale"] += self.counting
                continue
            if not self._claim(layer, e, prefetch=True):
                self.count["dropped"] += self.counting
                continue
            self.count["prefetch_loads"] += self.counting
            self.idle -= 1
            self._read(layer, e, True, t, spare=False)

    def _wait(self, rid: int | None = None) -> None:
        """The compute thread waits for its read ``rid``, or (None) for the next landing."""
        while rid is None or rid in self.reads:
            t = self._next()
            if math.isinf(t):
                raise SpecError("host pipeline: waiting for a load that never lands (a bug)")
            self._advance(t)
            self.t = max(self.t, t)
            if rid is None:
                return

    # ---- the cache ---------------------------------------------------------------------
    def _claim(self, layer: int, e: int, prefetch: bool) -> bool:
        """A slot for ``e``, now LOADING (True); False: no slot can take it."""
        st = self.state[layer]
        if st[e] != ABSENT:
            return False
        if self.size[layer] >= self.run.capacity:
            keep = self.pinned[layer] | self.protected[layer]
            v = cp.choose_victim(st == READY, keep, self.last_use[layer], self.uses[layer],
                                 _NO_FUTURE, self.code)
            if v < 0:
                return False
            self.count["wasted"] += bool(self.prefetched[layer, v] and not self.used[layer, v])
            st[v] = ABSENT
            self.size[layer] -= 1
        st[e] = LOADING
        self.size[layer] += 1
        self.prefetched[layer, e], self.used[layer, e] = prefetch, False
        if prefetch:
            self.last_use[layer, e] = self.clock[layer] + 1
        return True

    # ---- one MoE layer on the compute thread -----------------------------------------
    def layer(self, fwd: int, layer: int, rows: np.ndarray) -> None:
        c = self.c
        self.t += c.layer_s
        self._advance(self.t)
        needed = np.unique(rows)
        self.pos = (fwd, layer)
        self.protected[layer] = False
        self.pinned[layer] = False
        self.pinned[layer, needed] = True
        self.clock[layer] += 1
        st = self.state[layer]
        # the runtime pauses right after the planner queues (no time passes between): a
        # stalling layer's queued loads wait for its ensure to end
        self.paused = bool((st[needed] != READY).any())
        self._predict(fwd, layer)
        start = self.t
        self._ensure(layer, needed)
        if self.counting:
            self.stall += self.t - start
        self.last_use[layer, needed] = self.clock[layer]
        self.used[layer, needed] = True
        self.uses[layer, needed] += 1
        self.paused = False
        self._dispatch(self.t)  # the next layer's loads, during this layer's compute
        self.t += c.expert_s * rows.size
        self._advance(self.t)
        self.pinned[layer] = False
        if self.run.policy == "none":  # no reuse: every READY slot freed
            ready = st == READY
            self.count["wasted"] += int((ready & self.prefetched[layer] & ~self.used[layer]).sum())
            st[ready] = ABSENT
            self.size[layer] -= int(ready.sum())

    def _ensure(self, layer: int, needed: np.ndarray) -> None:
        st = self.state[layer]
        if self.counting:
            self.count["demanded"] += len(needed)
            self.count["hits"] += int((st[needed] != ABSENT).sum())
            self.count["late"] += int((st[needed] == LOADING).sum())
        todo = [int(e) for e in needed]
        while todo:
            progressed = False
            for e in list(todo):
                if st[e] == READY:
                    todo.remove(e)
                    progressed = True
                    continue
                if st[e] == LOADING:
                    continue
                claimed = self._claim(layer, e, prefetch=False)
                if not claimed and (st[~self.pinned[layer]] == LOADING).any():
                    continue  # a worker is filling a slot that can be taken next
                self.count["misses"] += self.counting
                # no slot: a spare row past the capacity, paged in for this call
                rid = self._read(layer, e if claimed else -1, False, self.t, not claimed)
                self._wait(rid)
                todo.remove(e)
                progressed = True
            if todo and not progressed:
                self._wait()

    def _predict(self, fwd: int, layer: int) -> None:
        """Queue the prediction for the next layer (wrapping to the next call's layer 0)."""
        n_layers = self.run.experts.shape[1]
        target = (fwd, layer + 1) if layer + 1 < n_layers else (fwd + 1, 0)
        if fwd == 0 and (target[0] != 0 or not self.run.oracle):
            # the prompt's own layers are predicted from an empty history (not modelled) but
            # by the oracle; the first decode token's layer 0 once the prompt is learnt
            return
        self.queue_set(*target, self.predicted(*target))

    def predicted(self, fwd: int, layer: int) -> np.ndarray:
        run = self.run
        token = fwd - 1 + run.prefill if fwd > 0 else -1
        if token >= run.experts.shape[0] or (fwd == 0 and not run.oracle):
            return np.zeros(0, dtype=np.int64)
        if run.oracle:
            rows = run.experts[: run.prefill, layer] if fwd == 0 else run.experts[token, layer]
            return np.unique(rows)[: run.capacity]
        if run.plan is None:
            return np.zeros(0, dtype=np.int64)
        ptr, ids = run.plan
        i = token * run.experts.shape[1] + layer
        return ids[ptr[i] : ptr[i + 1]][: run.capacity].astype(np.int64)

    def queue_set(self, fwd: int, layer: int, experts: np.ndarray) -> None:
        if not len(experts):
            return
        self.protected[layer] = False
        self.protected[layer, experts] = True
        loads = [int(e) for e in experts if self.state[layer, e] == ABSENT][: self.run.capacity]
        for rank, e in enumerate(loads):
            heapq.heappush(self.queue, (fwd, layer, rank, e))
        self._dispatch(self.t)


def simulate_host(run: HostRun, costs: HostCosts, num_experts: int) -> dict[str, float]:
    """Decode time and counters of ``run`` on a host with ``costs`` (module docstring)."""
    if run.capacity < run.experts.shape[2]:
        raise SpecError(f"capacity {run.capacity} is below top-{run.experts.shape[2]}")
    sim = _Sim(run, costs, num_experts)
    n_layers = run.experts.shape[1]
    decode = run.experts.shape[0] - run.prefill
    for layer in range(n_layers):  # the prompt, in one forward call
        sim.layer(0, layer, run.experts[: run.prefill, layer])
    sim.t += costs.token_s
    sim.queue_set(1, 0, sim.predicted(1, 0) if not run.oracle else np.zeros(0, np.int64))
    start, sim.counting = sim.t, True
    for fwd in range(1, decode + 1):
        for layer in range(n_layers):
            sim.layer(fwd, layer, run.experts[run.prefill + fwd - 1, layer])
        sim.t += costs.token_s
    out = {"time": sim.t - start, "stall": sim.stall, "tokens": decode, **sim.count}
    out["wasted"] += int((sim.prefetched & sim.state.astype(bool) & ~sim.used).sum())
    out["compute"] = out["time"] - out["stall"]
    return {k: float(v) for k, v in out.items()}
