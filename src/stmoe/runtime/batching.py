"""Step batching: several requests decode together, each exactly as it would alone.

Each request runs transformers' own greedy ``generate`` on a thread of its own (its
own KV cache). The batcher's thread (the engine's owner) runs *steps*, and at each MoE
layer serves the step's requests in ONE engine call (``step_layer``): the union of their
experts loaded once, the next layer's prefetch the union of their predictions
(``predictors.union``, each request its own predictor slot), each request's rows
computed on their own, side by side on the compute threads. What else a step shares
depends on the weights. bf16: each request runs its own forward, its experts calls
waiting at a gate; a batched bf16 matmul is not bit-identical to one row's on the CPU
(docs/serve.md), so the step shares the I/O. int8/int4 resident linears, whose kernels
are row for row the same at any row count: a decode step is ONE batched forward on the
batcher's thread (``step_forward``; the requests' decode calls wait for it), or where
that cannot hold, each request's own forward with its linears gathered (``step_rows``).

A request joins and leaves between steps. A prompt (prefill) is a step alone, so the
planner sees a prompt or a decode step of one token per request, as in a solo run.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.runtime.prompts import greedy_generate
from stmoe.runtime.requests import (
    Cancel,
    Cancelled,
    QueueFull,
    Request,
    Streamer,
    replay_request,
)
from stmoe.runtime.step_forward import StepForward, decode_call, step_caches
from stmoe.runtime.step_layer import begin_step, end_step, serve_calls
from stmoe.runtime.step_rows import StepRows

__all__ = ["Cancelled", "QueueFull", "Request", "StepBatcher", "replay_request"]


class StepBatcher:
    """Runs requests on an ``OffloadedModel`` in shared steps (see the module docstring).

    ``max_batch`` requests take part in steps at once; up to ``max_queue`` more wait
    for a place, and beyond that ``submit`` raises ``QueueFull``. ``share_rows``: with
    quantized resident linears, compute a step's rows of each in one call (False: each
    request's alone, as in bf16). ``batched``: where ``step_forward`` holds, a decode step
    is one batched forward (False: each request's own forward, its linears gathered).
    ``cold=False`` keeps the cache's experts (a warm run)."""

    def __init__(self, om: Any, max_batch: int = 4, max_queue: int = 16,
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
        # the step's requests' expert rows computed side by side (each alone: its own bits);
        # default: one thread per core, 1: one after the other
        threads = compute_threads or min(max_batch, os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(threads, "stmoe-compute") if threads > 1 else None
        self.cv = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.members: dict[int, Request] = {}  # slot -> request taking part in steps
        self.local = threading.local()
        self.rows = StepRows(self.model, self.cv, self.local, self.pool, threads)
        # rows together only where the kernels keep each row's bits (module docstring)
        self.share_rows = share_rows and self.rows.active
        self.step_forward = StepForward(self.model, self.pool, threads)
        self.batched = batched and self.share_rows and self.step_forward.why_not is None
        self.closed = False
        self.steps = 0
        self.started = 0  # requests started (names their threads)
        # the recent steps' (start time, prompt or not, members): a step lasts until the next
        self.step_log: deque[tuple[float, bool, int]] = deque(maxlen=4096)
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="stmoe-batcher", daemon=True)
        self.thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    # ---- clients ---------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue ``request`` (it starts at the next step with a free place)."""
        with self.cv:
            if self.closed:
                raise OffloadError("the batcher is closed")
            if len(self.members) >= self.max_batch and len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.members)} requests running and {len(self.waiting)} "
                                "queued, the most this server takes; retry later")
            self.waiting.append(request)
            self.cv.notify_all()
        return request

    def decode_sizes(self) -> list[int]:
        """The recent decode steps' member counts (from ``step_log``)."""
        return [n for _, prompt, n in list(self.step_log) if not prompt]

    def queue_depth(self) -> tuple[int, int]:
        """(requests running, requests queued)."""
        with self.cv:
            return len(self.members), len(self.waiting)

    def close(self) -> None:
        """Cancel every request, stop the batcher's thread, let the engine go."""
        with self.cv:
            self.closed = True
            for r in list(self.waiting) + list(self.members.values()):
                r.cancel()
            self.cv.notify_all()
        self.thread.join()
        if self.pool is not None:
            self.pool.shutdown()

    # ---- the engine's side (``LayerServer.serve`` and the forward hooks call these) ----
    def is_member(self) -> bool:
        """A request's thread, or this batcher's in a batched forward (it keeps the books)."""
        return getattr(self.local, "request", None) is not None or step_caches() is not None

    def submit_layer(self, layer: int, hidden: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        """A member's experts call: wait for the step's engine call, take its rows."""
        if step_caches() is not None:  # the batcher's own batched forward: a row per request
            live = self.local.step
            calls = [(layer, hidden[b:b + 1], index[b:b + 1], weights[b:b + 1])
                     for b in range(len(live))]
            return serve_calls(self.engine, self.pool, layer, live, calls)[0]
        r: Request = self.local.request
        with self.cv:
            r.arrival, r.result = (layer, hidden, index, weights), None
            self.cv.notify_all()
            return r.await_result(self.cv, lambda: self.error)

    # ---- the batcher's thread --------------------------------------------------------
    def _main(self) -> None:
        try:
            with self.om._exclusive():
                self.engine.reset(future={} if self.engine.predictor.sees_future else None,
                                  cold=self.cold)
                self.engine.state.gate = self
                if self.batched:
                    self.step_forward.install(self._member_forward)
                elif self.share_rows:
                    self.rows.install()
                self._ready.set()
                try:
                    self._loop()
                finally:
                    self.engine.state.gate = None
                    self.rows.remove()
                    self.step_forward.remove()
        except BaseException as exc:
            self._ready.set()
            with self.cv:
                self.error, self.closed = exc, True
                while self.waiting:  # never started: they end here
                    self._finish(self.waiting.popleft(), OffloadError(f"the batcher stopped: "
                                                                      f"{exc}"))
                for r in self.members.values():  # their threads raise at the gate
                    r.cancel()
                    r.in_step = False  # their next linears compute alone, then the gate raises
                    if r.row_call is not None or r.forward_call is not None:  # or waiting here
                        r.row_call, r.forward_call = None, None
                        r.result = OffloadError(f"the batcher stopped: {exc}")
                self.cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cv:
                self._admit()
                step = self._next_step()
                while step is None:
                    if self.closed and not self.members:
                        return
                    self.cv.wait(0.5)
                    self._admit()
                    step = self._next_step()
            try:
                self._run_step(step)
            except Exception as exc:  # the step's requests fail; the batcher goes on
                with self.cv:
                    waiting = [r for r in step if r.arrival is not None or r.row_call is not None
                               or r.forward_call is not None]
                self._fail(waiting, exc)

    def _admit(self) -> None:
        """(cv held) Start queued requests on free slots."""
        while self.waiting and len(self.members) < self.max_batch and not self.closed:
            r = self.waiting.popleft()
            if r.cancelled.is_set():
                self._finish(r, Cancelled("cancelled before it started"))
                continue
            r.slot = min(set(range(self.max_batch)) - set(self.members))
            self.members[r.slot] = r
            r.thread = threading.Thread(target=self._member, args=(r,), daemon=True,
                                        name=f"stmoe-request-{self.started}-slot{r.slot}")
            self.started += 1
            r.thread.start()

    def _next_step(self) -> list[Request] | None:
        """(cv held) The next step's members once every member waits at its first MoE
        layer or its batched decode call (or has finished): the oldest new prompt alone,
        else every decoding one."""
        members = self.members.values()
        if not members or any(r.arrival is None and r.forward_call is None for r in members):
            return None
        if any(r.arrival is not None and r.arrival[0] != 0 for r in members):
            bad = next(r for r in members if r.arrival is not None and r.arrival[0] != 0)
            bad.result = OffloadError("a request reached a step at a layer other than the first")
            self.cv.notify_all()
            return None
        prompts = [r for r in self.members.values() if r.calls == 0]
        if prompts:
            return [min(prompts, key=lambda r: r.submitted)]
        return sorted(self.members.values(), key=lambda r: r.slot)

    def _member(self, r: Request) -> None:
        from transformers import StoppingCriteriaList

        self.local.request = r
        try:
            greedy_generate(self.model, r.ids, r.max_new_tokens, r.ignore_eos, streamer=Streamer(r),
                            stopping_criteria=StoppingCriteriaList([Cancel(r)]))
            error = Cancelled("cancelled") if r.cancelled.is_set() else None
        except BaseException as exc:
            error = exc
        with self.cv:
            del self.members[r.slot]
            self._finish(r, error)
            self.cv.notify_all()

    def _finish(self, r: Request, error: BaseException | None) -> None:
        r.error = error
        r.done.set()
        r.emit(None)

    def _member_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on a request's thread: its prompt its own, each decode call
        handed to the step's batched forward (``_run_forward``), its row's output back."""
        r: Request | None = getattr(self.local, "request", None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if r is None or cache is None or cache.get_seq_length() == 0:  # not a decode call
            return self.step_forward.forward(*args, **kwargs)
        call = decode_call(args, kwargs)
        with self.cv:
            r.forward_call, r.result = call, None
            self.cv.notify_all()
            return r.await_result(self.cv, lambda: self.error)

    def _run_forward(self, step: list[Request]) -> None:
        """(a decode step, batched) The step's one forward, on this thread."""
        self.local.step = step
        try:
            outs: list[Any] = self.step_forward.run([r.forward_call for r in step])  # type: ignore[misc]
        except Exception as exc:  # every request of the step gets it (a BaseException
            outs = [exc] * len(step)  # stops the batcher: ``_main`` tells them)
        with self.cv:
            for r, out in zip(step, outs, strict=True):
                r.forward_call, r.result = None, out
            self.cv.notify_all()
        if isinstance(outs[0], BaseException):
            raise outs[0]

    def _run_step(self, step: list[Request]) -> None:
        """One forward call of each of ``step``'s requests, their MoE layers served together
        (or, batched, one forward call of them all)."""
        prompt = step[0].calls == 0
        self.step_log.append((time.perf_counter(), prompt, len(step)))
        begin_step(self.engine, step, prompt)
        if not prompt and self.batched:
            self._run_forward(step)
        elif not self._run_own_forwards(step, prompt):
            return  # a failed call: the step's requests have their error
        end_step(self.engine, step, prompt)
        self.steps += 1

    def _run_own_forwards(self, step: list[Request], prompt: bool) -> bool:
        """Each request's own forward, their MoE layers served together; False if failed."""
        live = list(step)
        with self.cv:  # from here to its lm_head a request's quantized linears gather
            for r in live:
                r.in_step = self.share_rows and not prompt and len(step) > 1
        for layer in range(self.engine.num_layers):
            live = self._serve_layer(layer, live)
            if not live:
                return False
        with self.cv:  # the linears after the last MoE layer, up to the lm_head
            self._wait(live, lambda: all(not r.in_step or r.slot not in self.members
                                         for r in live))
        return True

    def _serve_layer(self, layer: int, live: list[Request]) -> list[Request]:
        """Wait for the live members' calls at ``layer``, serve them in one engine call."""
        with self.cv:
            self._wait(live, lambda: not any(r.arrival is None and r.slot in self.members
                                             for r in live))
            live = [r for r in live if r.arrival is not None]
            wrong = [r for r in live if r.arrival[0] != layer]  # type: ignore[index]
            for r in wrong:
                r.arrival, r.result = None, OffloadError(
                    f"a request reached MoE layer {r.arrival[0]} where the step is at {layer}")  # type: ignore[index]
            live = [r for r in live if r not in wrong]
            calls = [r.arrival for r in live]
            self.cv.notify_all()
        try:
            out, segments = serve_calls(self.engine, self.pool, layer, live, calls)  # type: ignore[arg-type]
        except BaseException as exc:  # every request of the call gets it
            return self._fail(live, exc)
        with self.cv:
            for r, s in zip(live, segments, strict=True):
                r.arrival, r.result = None, out[s]
            self.cv.notify_all()
        return live

    def _wait(self, live: list[Request], done: Any) -> None:
        """(cv held) Until ``done()``, serving the step's gathered linears meanwhile."""
        while not done():
            if not self.rows.serve(live, self.members):
                self.cv.wait()

    def _fail(self, live: list[Request], error: BaseException) -> list[Request]:
        """The step's calls at this layer all end with ``error``; the step ends."""
        with self.cv:
            for r in live:
                r.arrival, r.result, r.in_step, r.forward_call = None, error, False, None
            self.cv.notify_all()
        return []
