"""What the offload engine's parts share: one lock, the caches, and the current run.

The engine is split by concern (``hf_glue``: the model's hooks and phase;
``serve``: the compute thread's path through a MoE layer; ``planning``: what to
prefetch for which layer, and when; ``prefetch``: the worker threads). They meet
here, in one ``EngineState``: its lock guards the caches and the run, the compute
thread waits on ``cv`` for slots and the workers on their own condition of the same
lock. ``EngineSettings`` are the engine's knobs. ``RunState`` is one measured
run's progress; ``reset`` replaces it whole, so nothing of a run is carried into
the next.

One engine serves one caller at a time: its caches, read buffer and run state
are one computation's. ``EngineState.owner`` is the thread it serves now, for a
measured run (``OffloadedModel.generate``/``measure``) or one forward call; any
other thread that reaches it meanwhile gets ``busy_error`` (one line) instead of
mixing the two.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from stmoe import cache_policy as cp
from stmoe.admission import Admission
from stmoe.errors import OffloadError
from stmoe.runtime.cache import READY, LayerCache
from stmoe.runtime.device_timing import DeviceTimeline
from stmoe.runtime.forced_routing import RoutingSource
from stmoe.runtime.slot_events import SlotEvents
from stmoe.runtime.stats import RuntimeStats
from stmoe.runtime.step import Step
from stmoe.runtime.store import ExpertStore
from stmoe.runtime.store.device_ops import CopyEvent, CopySpan, DeviceOps
from stmoe.runtime.store.index import Block
from stmoe.runtime.store.loader import Loader
from stmoe.runtime.store.tiers import Between, buffer_bytes


@dataclass(frozen=True)
class EngineSettings:
    """How an engine serves a model's experts (``stmoe.offload`` resolves them)."""

    capacity: int | tuple[int, ...]  # experts cached per MoE layer: every layer's, or each's
    policy: str  # which cached expert a load evicts (stmoe.cache_policy)
    workers: int  # prefetch threads (0: every expert loads on demand)
    device: torch.device | None  # where the caches live; None: the resident weights'
    max_loads: int | None  # loads one prediction may start per layer; None: capacity
    admission: bool  # decide per layer whether prefetch pays (stmoe.admission)


Future = dict[tuple[int, int], tuple[int, ...]]  # (forward call, layer) -> the experts it needs


@dataclass
class CallEnds:
    """When a run's forward calls ended (``perf_counter``): the first, the last, how many.
    Why not each: a server's run lasts as long as the server."""

    first: float = 0.0
    last: float = 0.0
    count: int = 0

    def add(self, t: float) -> None:
        if not self.count:
            self.first = t
        self.last, self.count = t, self.count + 1


@dataclass(eq=False)
class RunState:
    """One measured run so far (guarded by the engine's lock where workers read it)."""

    stats: RuntimeStats
    future: Future | None  # the oracle's routing, known in advance; {}: its recording pass
    num_layers: int
    fwd: int = -1  # the forward call (step) in progress (0: the prompt)
    pos: tuple[int, int] = (-1, -1)  # (call, layer) the compute thread reached: older is stale
    batch: tuple[int, int] = (1, 1)  # this call's (rows, tokens per row)
    phase: str = "prefill"  # "prefill" (the prompt) or "decode" (one token per row)
    # per layer, the (call, experts) last predicted for it: the prediction counted there
    pending: list[tuple[int, frozenset[int]] | None] = field(init=False)
    routing_log: Future = field(default_factory=dict)  # what the recording pass saw
    forward_ends: CallEnds = field(default_factory=CallEnds)  # the calls' ends
    started: float = field(default_factory=time.perf_counter)
    prefill_routing: list[np.ndarray] = field(default_factory=list)  # the prompt's, per layer
    mask: np.ndarray | None = None  # [B, S] real (not padding) positions of this call
    admission: Admission | None = None  # per-layer prefetch admission (None: every load)
    # the predictor's slot of each row of this call (None: row i is slot i); a server's
    # step batches requests that keep their slots while others join and leave
    slots: list[int] | None = None
    step: Step | None = None  # the step in progress (``OffloadEngine.begin_step``)
    step_open: bool = False  # begun, not yet ended: failed if left so (``leave_step``)
    # a device cache's copies and waits, timed by the device (``device_timing``)
    timeline: DeviceTimeline | None = None

    def __post_init__(self) -> None:
        self.pending = [None] * self.num_layers

    def slot_ids(self) -> list[int]:
        """The predictor's slot of each row of this call, in row order."""
        return self.slots if self.slots is not None else list(range(self.batch[0]))


class EngineState:
    """The lock, the per-layer caches, the store and its loader, and the run."""

    def __init__(self, caches: list[LayerCache], store: ExpertStore, loader: Loader,
                 device: torch.device) -> None:
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)  # the compute thread waits here for slots
        self.caches = caches
        self.store = store
        # the one way bytes enter a slot: the compute thread and the workers call
        # ``loader.fill`` (or ``fetch``) holding the slot LOADING and not the lock
        self.loader = loader
        self.device = device
        self.num_layers = len(caches)
        self.num_experts = int(store.model["num_experts"])
        self.expert_bytes = store.blocks[(0, 0)].nbytes
        self.max_block = max(buffer_bytes(b) for b in store.blocks.values())  # read buffers
        self.closed = False  # new calls refused (``begin_close``)
        self.tearing_down = False  # the caches and the tier going (after close's wait)
        self.close_lock = threading.RLock()  # a second close waits for the first's end
        self._run = RunState(RuntimeStats(self.num_layers, self.expert_bytes), None,
                             self.num_layers)
        self.owner: threading.Thread | None = None  # the thread the engine serves now
        self.owner_run = False  # its claim is a measured run (else forward calls)
        self.depth = 0  # forward calls in progress under a forward claim
        # a trace's routing replacing the router's (``OffloadedModel.force_routing``): the
        # next solo steps' (``OffloadEngine.solo_step``)
        self.forced_routing: RoutingSource | None = None
        # per layer, the slots' ready/free events where the tier's copies run asynchronously
        # (a device cache: ``slot_events``); None where a fill has landed when it returns
        self.events: list[SlotEvents] | None = None
        self.demand_stream: object = None  # the compute thread's copies (``use_tier_events``)

    @property
    def run(self) -> RunState:
        """The current run (replaced whole by ``OffloadEngine.reset``)."""
        return self._run

    @run.setter
    def run(self, run: RunState) -> None:
        """A new run: on a device cache its timeline starts now, the device between runs."""
        ops = self.device_ops()
        run.timeline = DeviceTimeline(ops) if ops is not None else None
        self._run = run

    def device_times(self, stats: RuntimeStats) -> None:
        """(the run is over: ``finish`` done) The device's times of the run's copies and
        waits into ``stats``' phases (nothing without a device cache)."""
        if self._run.timeline is not None:
            for phase, figures in self._run.timeline.resolve().items():
                stats.phases[phase].device = figures

    def _waited(self, before: CopyEvent, after: CopyEvent) -> None:
        """The compute stream waited for copies from ``before`` to ``after``."""
        if self._run.timeline is not None:
            self._run.timeline.wait(self._run.phase, before, after)

    def use_tier_events(self) -> None:
        """The slot protocol for the loader's tier: events where its copies to the device
        run asynchronously (``to_device``), none where a fill lands before it returns; the
        compute thread's own copy stream for its demands (served first where it can)."""
        ops = self.device_ops()
        self.events = None if ops is None else [SlotEvents(c.capacity, ops, self._waited)
                                                for c in self.caches]
        self.demand_stream = self.copy_stream(priority=-1)

    def device_ops(self) -> DeviceOps | None:
        """The tier's device ops where its copies to the device are asynchronous."""
        tier = self.loader.tier
        return getattr(tier, "ops", None) if getattr(tier, "to_device", False) else None

    def copy_stream(self, priority: int = 0) -> object:
        """A loading thread's stream: one of the tier's device's own, a CUDA stream for a
        CUDA cache, or None (copies on the CPU land as they are made)."""
        ops = self.device_ops()
        if ops is not None:
            return ops.new_stream(priority)
        return (torch.cuda.Stream(device=self.device, priority=priority)
                if self.device.type == "cuda" else None)

    def fill(self, cache: LayerCache, slot: int, block: Block, buf: object, stream: object,
             between: Between = None) -> CopyEvent | None:
        """(lock not held; ``slot`` LOADING by the calling thread) ``block``'s copy into
        ``slot`` queued after the slot's last readers (its ``free`` event); its ``ready``
        event (None: landed already). The one way a loader fills a cache slot."""
        events = self.events[cache.layer] if self.events is not None else None
        if events is None:  # the copy has landed when ``fill`` returns
            return self.loader.fill(cache, slot, block, buf, stream, between)
        events.before_write(slot, stream)
        ops = self.device_ops()
        timeline, phase = self._run.timeline, self._run.phase  # the run the copy starts in
        marker = None  # before the copies: nothing they may overlap folds while they queue
        if timeline is not None and ops is not None:
            marker = ops.record(stream)
            timeline.opening(phase, marker)
        try:
            copied = ready = self.loader.fill(cache, slot, block, buf, stream, between,
                                              wait=False)
            if cache.layouts and ready is not None and ops is not None:  # the slot's own
                ops.launch(stream, lambda: cache.convert(slot))  # layout, on its stream
                end = ops.record(stream)
                ready = CopySpan(ready.start, end, ready.nbytes) \
                    if isinstance(ready, CopySpan) else end
        except BaseException:  # copies queued before the failure land before the slot's
            if timeline is not None and marker is not None:
                timeline.closing(phase, marker)
            if ops is not None:  # next write (its loader waits on this, then)
                with self.cv:
                    events.landing(slot, ops.record(stream))
            raise
        if timeline is not None and isinstance(copied, CopySpan):
            timeline.copy(phase, copied, marker)  # the copy, not a conversion
        elif timeline is not None and marker is not None:
            timeline.closing(phase, marker)
        return ready

    def filled(self, cache: LayerCache, slot: int, ready: CopyEvent | None) -> None:
        """(lock held) ``slot``'s copy is queued (or landed): READY for the compute, which
        waits on ``ready`` first (``SlotEvents.before_read``)."""
        cache.filled(slot)
        if self.events is not None:
            self.events[cache.layer].landing(slot, ready)

    def forget_cached(self) -> None:
        """(lock held) A cold run: no expert stays cached, no use counted (lfu's counts are
        the run's: none carried into it), no prediction's scores kept (score's)."""
        for cache in self.caches:
            for s in range(cache.capacity):
                if cache.state[s] == READY:
                    cache.abandon(s)
            cache.uses[:] = 0
            cache.scores = cp.NO_SCORES

    def release(self) -> None:
        """(the engine closed) The caches' memory given back."""
        with self.cv:
            for cache in self.caches:
                cache.release()

    def slot_events(self, cache: LayerCache) -> SlotEvents | None:
        return self.events[cache.layer] if self.events is not None else None

    # ---- who the engine serves (every method: lock held) -------------------------------
    def enter_run(self) -> None:
        """Claim the engine for the calling thread's measured run."""
        me = threading.current_thread()
        self.refuse_nested()
        self._refuse_others(me)
        self.owner, self.owner_run, self.depth = me, True, 0

    def refuse_nested(self) -> None:
        """A measured run inside the thread's own run or forward call is an error (it
        would reset the run in progress, or wait for itself)."""
        if self.owner is threading.current_thread():
            raise OffloadError("OffloadedModel.generate or measure was called inside a measured "
                               "run (or a forward call) of this model on the same thread; "
                               "call them one after the other")

    def leave_run(self) -> None:
        if self.owner is threading.current_thread():
            self.owner, self.owner_run = None, False

    def enter_forward(self) -> None:
        """Claim the engine for one forward call (nested calls and calls inside the
        thread's measured run share its claim)."""
        me = threading.current_thread()
        if self.owner is not me:
            self._refuse_others(me)
            self.owner, self.owner_run, self.depth = me, False, 0
        if not self.owner_run:
            self.depth += 1

    def leave_forward(self) -> None:
        """The calling thread's forward call ended (or failed); a no-op for any other
        thread, so a refused call cannot release the claim it was refused by."""
        if self.owner is threading.current_thread() and not self.owner_run:
            self.depth -= 1
            if self.depth <= 0:
                self.owner, self.depth = None, 0

    def begin_close(self, limit_s: float) -> bool:
        """(lock held) False where closed already; else new calls are refused from now, and
        once no other thread's forward or run holds the engine (at most ``limit_s``: one
        that never lets go does not hold up a close), the caller tears it down."""
        if self.closed:
            return False
        self.closed = True
        deadline, me = time.monotonic() + limit_s, threading.current_thread()
        while (self.owner not in (None, me) and self.owner.is_alive()
               and time.monotonic() < deadline):
            self.cv.wait(timeout=0.05)
        self.tearing_down = True
        return True

    def _refuse_others(self, me: threading.Thread) -> None:
        owner = self.owner
        if owner is not None and owner is not me and owner.is_alive():  # a dead one lets go
            raise busy_error(owner, self.owner_run)


CLOSED = "this offloaded model was closed; offload it again to run it"
Run = TypeVar("Run", bound=Callable[..., Any])


def closed_errors(run: Run) -> Run:
    """An experts call its model was torn down under (a forward still running after close's
    wait) fails with the closed line, not with what its freed caches or its closed tier
    raise (a KeyError, a short read that reads as a damaged store). An error during the
    wait is the call's own (a damaged block stays one)."""
    @functools.wraps(run)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return run(self, *args, **kwargs)
        except Exception as exc:
            if self.state.tearing_down and str(exc) != CLOSED:
                raise OffloadError(CLOSED) from exc
            raise
    return guarded  # type: ignore[return-value]


def busy_error(owner: threading.Thread, run: bool) -> OffloadError:
    what = "a measured run (OffloadedModel.generate or measure)" if run else "a forward call"
    return OffloadError(f"this offloaded model is busy: thread {owner.name!r} is running {what}; "
                        "one offloaded model serves one call at a time: use "
                        "OffloadedModel.generate or measure, which wait for each other, or give "
                        "each thread its own offloaded model")


def check_cache_device(device: torch.device, tier: object) -> None:
    """Caches on a GPU only behind a tier that copies to it asynchronously, under the slot
    protocol (``to_device``): a host tier's blocking copies into GPU slots have no event
    a later copy waits on before overwriting a slot its queued kernels still read."""
    if device.type == "cuda" and not getattr(tier, "to_device", False):
        raise OffloadError(f"the model is on {device}, and tier {getattr(tier, 'name', '')!r} "
                           "fills its caches from the host with no slot protocol: use --tier "
                           "gpu or gpu-disk (or the model on the CPU)")
