"""Step batching: several requests decode together, each exactly as it would alone.

Each request runs transformers' own ``generate`` on a thread of its own (its own KV cache;
greedy, or sampled with its own generator: ``sampling``), driven by the batcher
(``runtime.step.driven_by``). The batcher's thread (the engine's owner) runs *steps*
through the step API (``begin_step``, ``serve_layer``, ``end_step``); at each MoE layer
ONE engine call serves the step's requests: the union of their experts loaded once, the
next layer's prefetch the union of their predictions (``predictors.union``, each request
its own predictor slot), each request's rows computed on their own, side by side on the
compute threads. What else a step shares depends on the weights. bf16: each request runs
its own forward, its experts calls waiting for the step's layer; a batched bf16 matmul is
not bit-identical to one row's on the CPU (docs/serve.md), so the step shares the I/O.
int8/int4 resident linears, whose kernels are row for row the same at any row count: a
decode step is ONE batched forward on the batcher's thread (``step_forward``), or where
that cannot hold, each request's own forward with its linears gathered (``step_rows``).

A request joins and leaves between steps. A prompt (prefill) is a step alone, so the
planner sees a prompt or a decode step of one token per request, as in a solo run.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from stmoe.errors import BlockError, OffloadError
from stmoe.runtime.api import OffloadedModel
from stmoe.runtime.batcher.member import (
    Member,
    charge,
    drop_cancelled,
    finish,
    generate_extra,
    next_step,
    spread,
)
from stmoe.runtime.batcher.requests import Cancelled, QueueFull, Request
from stmoe.runtime.batcher.step_forward import StepForward, decode_call, step_caches
from stmoe.runtime.batcher.step_rows import StepRows
from stmoe.runtime.prompts import greedy_generate
from stmoe.runtime.step import Step, driven_by

Calls = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # each member's experts call


class StepBatcher:
    """Runs requests on an ``OffloadedModel`` in shared steps (see the module docstring).

    ``max_batch`` requests take part in steps at once; up to ``max_queue`` more wait
    for a place, and beyond that ``submit`` raises ``QueueFull`` (counted at once, whether
    or not the batcher's thread has moved queued requests into the batch yet). ``share_rows``: with
    quantized resident linears, compute a step's rows of each in one call (False: each
    request's alone, as in bf16). ``batched``: where ``step_forward`` holds, a decode step
    is one batched forward (False: each request's own forward, its linears gathered).
    ``cold=False`` keeps the cache's experts (a warm run)."""

    def __init__(self, om: OffloadedModel, max_batch: int = 4, max_queue: int = 16,
                 compute_threads: int | None = None, share_rows: bool = True,
                 cold: bool = True, batched: bool = True) -> None:
        if max_batch < 1 or max_queue < 0:
            raise OffloadError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} "
                               f"and {max_queue}")
        engine = om.engine
        if engine.planner.late is not None:
            raise OffloadError("the late gate lookahead predicts from each decoder layer's input "
                               "as it starts, which a step of several requests does not give; "
                               "serve with --lookahead early")
        self.om, self.engine, self.model = om, engine, om.model
        self.max_batch, self.max_queue, self.cold = max_batch, max_queue, cold
        self.capacity = max_batch + max_queue  # requests running and waiting, at most
        # the step's requests' expert rows computed side by side (each alone: its own bits);
        # default: one thread per core, 1: one after the other
        threads = compute_threads or min(max_batch, os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(threads, "stmoe-compute") if threads > 1 else None
        self.cv = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.members: dict[int, Member] = {}  # slot -> request taking part in steps
        self.local = threading.local()
        self.rows = StepRows(self.model, self.cv, self.local, self.pool, threads)
        # rows together only where the kernels keep each row's bits (module docstring)
        self.share_rows = share_rows and self.rows.active
        self.step_forward = StepForward(self.model, self.pool, threads)
        self.batched = batched and self.share_rows and self.step_forward.why_not is None
        self.closed, self.steps, self.started = False, 0, 0  # started: names their threads
        # the recent steps' (start time, prompt or not, members): a step lasts until the next
        self.step_log: deque[tuple[float, bool, int]] = deque(maxlen=4096)
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="stmoe-batcher", daemon=True)
        om.attach(self)
        self.thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    # ---- clients ---------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue ``request`` (it starts at the next step with a free place)."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[Request]) -> list[Request]:
        """Queue ``requests`` together, all or none (a request's ``n`` choices)."""
        with self.cv:
            if self.closed:
                raise OffloadError("the batcher is closed")
            drop_cancelled(self.waiting)
            if len(self.members) + len(self.waiting) + len(requests) > self.capacity:
                raise QueueFull(f"{len(self.members)} requests running and {len(self.waiting)} "
                                "queued, the most this server takes; retry later")
            self.waiting.extend(requests)
            self.cv.notify_all()
        return requests

    def decode_sizes(self) -> list[int]:
        """The recent decode steps' member counts (from ``step_log``)."""
        return [n for _, prompt, n in list(self.step_log) if not prompt]

    def queue_depth(self) -> tuple[int, int]:
        """(requests running, requests queued)."""
        with self.cv:
            drop_cancelled(self.waiting)
            return len(self.members), len(self.waiting)

    def close(self) -> None:
        """Cancel every request, stop the batcher's thread, let the engine go."""
        with self.cv:
            self.closed = True
            for r in list(self.waiting) + [m.request for m in self.members.values()]:
                r.cancel()
            self.cv.notify_all()
        self.thread.join()
        if self.pool is not None:
            self.pool.shutdown()

    # ---- the driver of its members' forwards (``runtime.step.StepDriver``) -------------
    def experts_call(self, layer: int, hidden: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        """A driven forward's experts call: in the batcher's batched forward, served at once
        (a row per member); on a member's thread, posted and waited for (the step's layer)."""
        if step_caches() is not None:  # the batcher's own batched forward: a row per member
            step: list[Member] = self.local.step
            failed = self.local.failed  # (a member failed at an earlier layer: its row left)
            rows = [b for b, m in enumerate(step) if m.slot not in failed]
            if not rows:  # every member failed at an earlier layer: the forward runs out
                return torch.zeros_like(hidden)
            out, _, lost = self._serve_layer(layer, [step[b] for b in rows], [
                (hidden[b:b + 1], index[b:b + 1], weights[b:b + 1]) for b in rows])
            failed.update(lost)
            return spread(out, rows, len(step))
        m: Member = self.local.member
        with self.cv:
            m.arrival, m.result = (layer, hidden, index, weights), None
            self.cv.notify_all()
            return m.await_result(self.cv, lambda: self.error)

    def _serve_layer(self, layer: int, live: list[Member], calls: Calls
                     ) -> tuple[torch.Tensor, list[slice], dict[int, BlockError]]:
        """``live``'s calls at ``layer`` in ONE engine call, each member's usage charged;
        the members (by slot) failed by a block that did not read (the others go on)."""
        out, segments, tally = self.engine.serve_layer(layer, [m.part() for m in live], calls,
                                                       self.pool, partial=True)
        charge(live, tally)
        return out, segments, {live[i].slot: exc for i, exc in tally.failed.items()}

    # ---- the batcher's thread --------------------------------------------------------
    def _main(self) -> None:
        try:
            with self.om.exclusive():
                self.engine.reset(future={} if self.engine.predictor.sees_future else None,
                                  cold=self.cold)
                if self.batched:
                    self.step_forward.install(self._member_forward)
                elif self.share_rows:
                    self.rows.install()
                self._ready.set()
                try:
                    self._loop()
                finally:
                    self.rows.remove()
                    self.step_forward.remove()
        except BaseException as exc:
            self._ready.set()
            with self.cv:
                self.error, self.closed = exc, True
                while self.waiting:  # never started: they end here
                    finish(self.waiting.popleft(), OffloadError(f"the batcher stopped: {exc}"))
                for m in self.members.values():  # their threads raise at their next call
                    m.request.cancel()
                    m.in_step = False  # their next linears compute alone, then the call raises
                    if m.row_call is not None or m.forward_call is not None:  # or waiting here
                        m.row_call, m.forward_call = None, None
                        m.result = OffloadError(f"the batcher stopped: {exc}")
                self.cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cv:
                self._admit()
                step = next_step(list(self.members.values()), self.cv)
                while step is None:
                    if self.closed and not self.members:
                        return
                    self.cv.wait(0.5)
                    self._admit()
                    step = next_step(list(self.members.values()), self.cv)
            try:
                self._run_step(step)
            except Exception as exc:  # the step's requests fail; the batcher goes on
                with self.cv:
                    waiting = [m for m in step if m.waiting()]
                self._fail(waiting, exc)

    def _admit(self) -> None:
        """(cv held) Start queued requests on free slots."""
        drop_cancelled(self.waiting)
        while self.waiting and len(self.members) < self.max_batch and not self.closed:
            r = self.waiting.popleft()
            m = Member(r, min(set(range(self.max_batch)) - set(self.members)))
            self.members[m.slot] = m
            r.thread_name = f"stmoe-request-{self.started}-slot{m.slot}"
            m.thread = threading.Thread(target=self._member, args=(m,), daemon=True,
                                        name=r.thread_name)
            self.started += 1
            m.thread.start()

    def _member(self, m: Member) -> None:
        self.local.member, r = m, m.request
        try:
            with driven_by(self):  # greedy, or sampled by the request's own ``Sampler``
                greedy_generate(self.model, r.ids, r.max_new_tokens, r.ignore_eos,
                                **generate_extra(r))
            error = Cancelled("cancelled") if r.cancelled.is_set() else None
        except BaseException as exc:
            error = exc
        with self.cv:
            del self.members[m.slot]
            finish(r, error)
            self.cv.notify_all()

    def _member_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on a request's thread: its prompt its own, each decode call
        handed to the step's batched forward (``_run_forward``), its row's output back."""
        m: Member | None = getattr(self.local, "member", None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if m is None or cache is None or cache.get_seq_length() == 0:  # not a decode call
            return self.step_forward.forward(*args, **kwargs)
        call = decode_call(args, kwargs)
        with self.cv:
            m.forward_call, m.result = call, None
            self.cv.notify_all()
            return m.await_result(self.cv, lambda: self.error)

    def _run_forward(self, step: list[Member]) -> None:
        """(a decode step, batched) The step's one forward, on this thread."""
        self.local.step, self.local.failed = step, {}
        error = None
        try:
            with driven_by(self):
                outs: list[Any] = self.step_forward.run([m.forward_call for m in step])  # type: ignore[misc]
        except Exception as exc:  # every request of the step gets it (a BaseException
            outs, error = [exc] * len(step), exc  # stops the batcher: ``_main`` tells them)
        with self.cv:
            for m, out in zip(step, outs, strict=True):  # (a failed row: its own error)
                m.forward_call, m.result = None, self.local.failed.get(m.slot, out)
            self.cv.notify_all()
        if error is not None:
            raise error

    def _run_step(self, members: list[Member]) -> None:
        """One forward call of each of the step's members, their MoE layers served together
        (or, batched, one forward call of them all): a step of the engine's step API."""
        prompt = members[0].calls == 0
        self.step_log.append((time.perf_counter(), prompt, len(members)))
        length = int(members[0].request.ids.shape[1]) if prompt else 1
        step = Step(tuple(m.part() for m in members), length, prefill=prompt)
        self.engine.begin_step(step)
        try:
            if not prompt and self.batched:
                self._run_forward(members)
            elif not self._run_own_forwards(members, prompt):
                return  # a failed call: the step's requests have their error
            self.engine.end_step(step)
        finally:
            self.engine.leave_step()  # (a failed step's loads end with it)
        for m in members:
            m.calls += 1
            m.request.usage.steps += 1
            m.request.usage.batch_sum += 0 if prompt else len(members)
        self.steps += 1

    def _run_own_forwards(self, step: list[Member], prompt: bool) -> bool:
        """Each member's own forward, their MoE layers served together; False if failed."""
        live = list(step)
        with self.cv:  # from here to its lm_head a request's quantized linears gather
            for m in live:
                m.in_step = self.share_rows and not prompt and len(step) > 1
        for layer in range(self.engine.num_layers):
            live = self._layer_of_own_forwards(layer, live)
            if not live:
                return False
        with self.cv:  # the linears after the last MoE layer, up to the lm_head
            self._wait(live, lambda: all(not m.in_step or m.slot not in self.members
                                         for m in live))
        return True

    def _layer_of_own_forwards(self, layer: int, live: list[Member]) -> list[Member]:
        """Wait for the live members' calls at ``layer``, serve them in one engine call."""
        with self.cv:
            self._wait(live, lambda: not any(m.arrival is None and m.slot in self.members
                                             for m in live))
            arrived = [(m, m.arrival) for m in live if m.arrival is not None]
            for m, call in arrived:
                if call[0] != layer:
                    m.arrival, m.result = None, OffloadError(
                        f"a request reached MoE layer {call[0]} where the step is at {layer}")
            live = [m for m, call in arrived if call[0] == layer]
            calls = [call[1:] for _, call in arrived if call[0] == layer]
            self.cv.notify_all()
        try:
            out, segments, failed = self._serve_layer(layer, live, calls)
        except BaseException as exc:  # every request of the call gets it
            return self._fail(live, exc)
        with self.cv:  # a failed member's step ends here (as ``_fail``), the others' go on
            for m, s in zip(live, segments, strict=True):
                m.arrival, m.result = None, failed.get(m.slot, out[s])
                m.in_step = m.in_step and m.slot not in failed
            self.cv.notify_all()
        return [m for m in live if m.slot not in failed]

    def _wait(self, live: list[Member], done: Callable[[], bool]) -> None:
        """(cv held) Until ``done()``, computing the step's gathered linears meanwhile."""
        while not done():
            if not self.rows.compute(live, self.members):
                self.cv.wait()

    def _fail(self, live: list[Member], error: BaseException) -> list[Member]:
        """The step's calls at this layer all end with ``error``; the step ends."""
        with self.cv:
            for m in live:
                m.arrival, m.result, m.in_step, m.forward_call = None, error, False, None
            self.cv.notify_all()
        return []
