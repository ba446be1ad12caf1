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
3. the planner, on the compute thread (after admission's look at the layer's last
   set, ``admission_s``): the predictor is taught the layer's routing (``learn_s``) and
   asked for the next layer's set (``predict_s``, only where admission asks; the three
   a preset's measured ``[host.predictors]``, else 0), which
   (wrapping to the next token's layer 0) is queued, most confident first, the
   experts not cached yet;
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
experts neither pinned nor protected; none: the request is dropped) and read,
in ``chunks`` pieces (``CHUNK_BYTES``): between two, a worker whose read is for
another layer than the one the compute thread stalls at waits until the stall
ends (demand first, ``Prefetcher._between``). Reads share the tier as ``link``
models it. With ``admission`` the sets pass through the runtime's own
``Admission``, fed the simulated timings as the runtime measures them
(docs/simulator.md); the oracle is exempt. After the prompt, the predictor's set for
the first decode token's layer 0 is queued (the oracle, which knows the routing,
prefetches the prompt's layers too, and the first decode token's layer 0 as the prompt's
last layer ends, as the runtime's does). Cache victims come from ``stmoe.cache_policy``
with the runtime's stamps (one step per layer call; a prefetch is stamped with the step
it is loaded for) and, for ``score``, the scores of the layer's latest prediction.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from stmoe import cache_policy as cp
from stmoe.admission import Admission
from stmoe.sim.host.inputs import HostCosts, HostRun, host_capacities
from stmoe.sim.host.tier import Tier
from stmoe.sim.specs import SpecError

_NO_FUTURE = np.zeros(0, dtype=np.int64)
ABSENT, LOADING, READY = 0, 1, 2


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
        # per layer, the scores of its latest prediction (policy score; none yet: as LRU)
        self.score = [cp.NO_SCORES] * n_layers
        self.tier = Tier(costs)
        self.caps = host_capacities(run.capacity, num_experts, run.experts.shape[2], n_layers)
        # admission as the runtime's: sized by the largest layer's cache
        self.adm = (Admission(n_layers, max(self.caps), run.horizon, serial=costs.fifo,
                              free_waste=costs.free_waste)
                    if run.admission and not run.oracle else None)
        self.decode_read_s = 0.0  # decode reads' seconds and count (what admission is told)
        self.decode_reads = 0
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
        """Start a read (``tier.Tier.start``), counted."""
        self.count["moved"] += 1  # the whole run's, prompt included, as bytes_moved
        self.count["spare"] += spare and self.counting
        return self.tier.start(layer, e, worker, t, spare)

    def _advance(self, until: float) -> None:
        """Every read landing by ``until`` lands; freed workers take the next job."""
        stalled = self.pos[1] if self.paused else None
        while (done := self.tier.land(until, stalled)) is not None:
            t, layer, e, worker, took = done
            if self.counting:  # the read's seconds as the runtime times them (waits included)
                self.decode_read_s += took
                self.decode_reads += 1
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
        while rid is None or rid in self.tier.reads:
            t = self.tier.next_event()
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
        if self.size[layer] >= self.caps[layer]:
            keep = self.pinned[layer] | self.protected[layer]
            v = cp.choose_victim(st == READY, keep, self.last_use[layer], self.uses[layer],
                                 _NO_FUTURE, self.score[layer], self.code)
            if v < 0:
                return False
            wasted = bool(self.prefetched[layer, v] and not self.used[layer, v])
            self.count["wasted"] += wasted
            if prefetch and self.adm is not None:
                if wasted:
                    self.adm.wasted_read(layer)
                else:  # a cached expert LRU would have kept
                    self.adm.evicted(layer, int(v))
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
        # the runtime pauses as the layer begins, before its planner: a stalling layer's
        # queued loads wait for its ensure to end
        self.paused = bool((st[needed] != READY).any())
        if self.adm is not None and self.counting:
            self._record(fwd, layer, needed)
            self._host(c.admission_s)  # (its clock reading is taken as it begins)
        self._predict(fwd, layer)
        start = self.t
        self._ensure(layer, needed)
        if self.counting:
            self.stall += self.t - start
        self.last_use[layer, needed] = self.clock[layer]
        self.used[layer, needed] = True
        self.uses[layer, needed] += 1
        self.paused = False
        self.tier.resume(self.t)
        self._dispatch(self.t)  # the next layer's loads, during this layer's compute
        self.t += c.expert_s * rows.size
        self._advance(self.t)
        self.pinned[layer] = False
        if self.run.policy == "none":  # no reuse: every READY slot freed
            ready = st == READY
            wasted = int((ready & self.prefetched[layer] & ~self.used[layer]).sum())
            self.count["wasted"] += wasted
            for _ in range(wasted if self.adm is not None else 0):
                self.adm.wasted_read(layer)
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
        if fwd == 0 and not self.run.oracle:
            # the prompt's own layers are predicted from an empty history (not modelled); the
            # first decode token's layer 0 once the prompt is learnt (``simulate_host``). The
            # oracle knows them all, its next call's layer 0 too, as the runtime's does
            return
        self._host(self.c.learn_s)  # the predictor taught this layer's routing
        self.plan_set(*target)

    def _host(self, seconds: float) -> None:
        """The compute thread's own work (the predictor's): time passes, reads land."""
        if seconds > 0:
            self.t += seconds
            self._advance(self.t)

    def plan_set(self, fwd: int, layer: int) -> None:
        """The planner for (``fwd``, ``layer``): the predictor's set, through admission."""
        if self.adm is None:
            self._host(self.c.predict_s)
            self.queue_set(fwd, layer, self.predicted(fwd, layer))
            return
        if not self.adm.wants(layer):  # no prediction: score's victims as LRU until one
            self.score[layer] = cp.NO_SCORES
            ranked = []
        else:  # (the predictor is asked only here: its time too)
            self._host(self.c.predict_s)
            ranked = self.predicted(fwd, layer).tolist()
        self.queue_set(fwd, layer, np.asarray(self.adm.admit(fwd, layer, ranked), np.int64))

    def _record(self, fwd: int, layer: int, needed: np.ndarray) -> None:
        """``admission.record_call``'s figures for this decode layer call, told to it."""
        st, e = self.state[layer], needed
        hits = int(((st[e] != ABSENT) & self.prefetched[layer, e] & ~self.used[layer, e]).sum())
        misses = {int(x) for x in e[st[e] == ABSENT]}
        self.adm.observe(fwd, layer, {int(x) for x in e}, hits, misses, self.t, self.decode_read_s,
                         self.decode_reads)

    def predicted(self, fwd: int, layer: int) -> np.ndarray:
        run = self.run
        token = fwd - 1 + run.prefill if fwd > 0 else -1
        if token >= run.experts.shape[0] or (fwd == 0 and not run.oracle):
            return np.zeros(0, dtype=np.int64)
        if run.oracle:
            rows = run.experts[: run.prefill, layer] if fwd == 0 else run.experts[token, layer]
            return np.unique(rows)[: self.caps[layer]]
        if run.plan is None:
            return np.zeros(0, dtype=np.int64)
        ptr, ids = run.plan
        i = token * run.experts.shape[1] + layer
        if run.scores is not None:  # the planner hands the cache what the set was ranked from
            self.score[layer] = run.scores[i]
        return ids[ptr[i] : ptr[i + 1]][: self.caps[layer]].astype(np.int64)

    def queue_set(self, fwd: int, layer: int, experts: np.ndarray) -> None:
        if not len(experts):
            return
        self.protected[layer] = False
        self.protected[layer, experts] = True
        loads = [int(e) for e in experts if self.state[layer, e] == ABSENT][: self.caps[layer]]
        for rank, e in enumerate(loads):
            heapq.heappush(self.queue, (fwd, layer, rank, e))
        self._dispatch(self.t)


def simulate_host(run: HostRun, costs: HostCosts, num_experts: int) -> dict[str, float]:
    """Decode time and counters of ``run`` on a host with ``costs`` (module docstring)."""
    sim = _Sim(run, costs, num_experts)  # (its capacities checked: host_capacities)
    n_layers = run.experts.shape[1]
    decode = run.experts.shape[0] - run.prefill
    for layer in range(n_layers):  # the prompt, in one forward call
        sim.layer(0, layer, run.experts[: run.prefill, layer])
    sim.t += costs.token_s
    if not run.oracle:
        sim.plan_set(1, 0)
    start, sim.counting = sim.t, True
    for fwd in range(1, decode + 1):
        for layer in range(n_layers):
            sim.layer(fwd, layer, run.experts[run.prefill + fwd - 1, layer])
        sim.t += costs.token_s
    out = {"time": sim.t - start, "stall": sim.stall, "tokens": decode, **sim.count}
    out["wasted"] += int((sim.prefetched & sim.state.astype(bool) & ~sim.used).sum())
    out["compute"] = out["time"] - out["stall"]
    if sim.adm is not None:
        s = sim.adm.summary()
        out["layers_off"] = len(s["layers_off"])  # type: ignore[arg-type]
        out["off_calls"] = sum(s["off_calls"])  # type: ignore[arg-type]
        out["turned_off"], out["probes"] = s["turned_off"], s["probes"]
    return {k: float(v) for k, v in out.items()}
