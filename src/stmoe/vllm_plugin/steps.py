"""Each vLLM forward call as a step of stmoe's engine, and each MoE layer's call through
stmoe's experts path.

Why these seams: vLLM's model runner calls its model once per engine step with every
scheduled request's tokens flat; the model's forward pre/post hooks open and close the
engine's step (``begin_step`` / ``end_step`` / ``leave_step``, as transformers' hooks do
in ``runtime.hf_glue``), and each routed-experts layer's ``forward_modular`` (the call
after vLLM's router, before its kernel) is replaced, on the instance, by the engine's
``ExpertsPath.run``: the experts made sure of in the layer's cache, the ids renumbered to
slots, vLLM's own kernel run on them. The runner's ``execute_model`` tells which rows are
whose (``batches``) and which requests finished (their slots freed, their routing written).
A block that does not read (``BlockError``) fails the whole step, since vLLM computes every
request of it together: its error says how to get the block back (``remedy``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stmoe.errors import BlockError, StmoeError
from stmoe.runtime.step import Step
from stmoe.vllm_plugin.batches import Requests, Span, spans_of, step_of
from stmoe.vllm_plugin.capture import Capture
from stmoe.vllm_plugin.engine import VllmEngine
from stmoe.vllm_plugin.forced import ForcedRouting
from stmoe.vllm_plugin.kernel_store import problem

log = logging.getLogger("vllm.stmoe")  # under vLLM's logger: its handler and format


class TablesWatch:
    """Reloads the predictor when its tables file changes on disk (checked as each call
    starts: one ``stat``), so prediction follows the traffic profiled while serving."""

    def __init__(self, path: Path | None, build: Callable[[], Any]) -> None:
        self.path, self.build = path, build
        self.seen = self._mtime()
        self.reloads = 0

    def _mtime(self) -> int | None:
        try:
            return self.path.stat().st_mtime_ns if self.path is not None else None
        except OSError:
            return None

    def changed(self) -> Any | None:
        """A predictor from the changed tables, or None (unchanged, or unreadable now:
        said in the log, the tables in use kept)."""
        now = self._mtime()
        if now is None or now == self.seen:
            return None
        self.seen = now
        try:
            predictor = self.build()
        except (StmoeError, OSError, ValueError) as exc:
            log.warning("stmoe: %s changed but cannot be read (%s); the tables in use stay",
                        self.path, exc)
            return None
        self.reloads += 1
        log.info("stmoe: tables reloaded from %s (reload %d)", self.path, self.reloads)
        return predictor


class Steps:
    """The plugin at run time for one vLLM model runner."""

    def __init__(self, runner: Any, engine: VllmEngine, capture: Capture | None,
                 tables: TablesWatch, forced: ForcedRouting | None = None) -> None:
        self.runner, self.engine, self.capture, self.tables = runner, engine, capture, tables
        self.forced = forced  # a trace's routing in place of the router's (measurement only)
        self.requests = Requests()
        self.scheduled: Any = None  # the scheduler's output of the call in progress
        self.calls = 0
        self._said = False  # the summary logged (``flush``)
        self._open: list[tuple[Step, tuple[Span, ...], torch.Tensor | None] | None] = []

    def install(self, model: torch.nn.Module) -> None:
        for m in self.engine.layers:
            m.module.forward_modular = self._layer_call(m.index)
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after)
        model.register_forward_hook(self._done, always_call=True)
        runner, original = self.runner, self.runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            for request in getattr(scheduler_output, "finished_req_ids", ()) or ():
                self.finish(request)
            self.scheduled = scheduler_output
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                self.scheduled = None

        runner.execute_model = execute_model

    def finish(self, request: str) -> None:
        """vLLM finished ``request``: its slot freed, its routing written."""
        slot = self.requests.finish(request)
        if slot is not None:
            self.engine.predictor.reset(slot)
        if self.capture is not None:
            self.capture.finish(request)
        if self.forced is not None:
            self.forced.finish(request)

    def flush(self) -> None:
        """The worker stops: every request still held is written, and what the engine did
        said in vLLM's log (decode steps: hit rate, stall, prefetch precision; bytes read)."""
        if self.capture is not None:
            for request in list(self.capture.rows):
                self.capture.finish(request)
        if self.calls and not self._said:
            self._said = True  # (the worker's shutdown, then the process's exit)
            d, moved, wasted = self.engine.counters()
            log.info("stmoe: %d forward calls; decode: hit rate %.3f over %d expert uses, "
                     "stall %.2f s, %s demand reads, %s prefetch reads, prefetch precision "
                     "%s; %.1f MiB read (%.1f MiB prefetched and never used)", self.calls,
                     d.get("hit_rate", 0.0), d.get("needed", 0), d.get("stall_s", 0.0),
                     d.get("demand_reads", 0), d.get("prefetch_reads", 0),
                     f"{d.get('prefetch_precision', 0.0):.3f}", moved / 2**20,
                     wasted / 2**20)

    # ---- the model's forward -------------------------------------------------------
    def _spans(self, tokens: int) -> tuple[Span, ...]:
        """Whose rows the call's are (none for vLLM's dummy and profiling runs)."""
        sched = self.scheduled
        if sched is None or not getattr(sched, "total_num_scheduled_tokens", 0):
            return ()
        batch = self.runner.input_batch
        n = batch.num_reqs
        ids = list(batch.req_ids[:n])
        counts = [int(sched.num_scheduled_tokens[r]) for r in ids]
        spans = spans_of(self.requests, ids, counts,
                         [int(x) for x in batch.num_computed_tokens_cpu[:n]],
                         [int(x) for x in batch.num_prompt_tokens[:n]])
        return spans if sum(counts) <= tokens else ()

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions")
        rows = ids if ids is not None else positions
        tokens = int(rows.shape[0]) if rows is not None else 0
        if (predictor := self.tables.changed()) is not None:
            self.engine.use_predictor(predictor)
        spans = self._spans(tokens)
        if self.forced is not None:
            batch = self.runner.input_batch
            self.forced.begin_call(spans, lambda i: batch.token_ids_cpu[
                i, :int(batch.num_prompt_tokens[i])])
        step = step_of(spans, tokens, self.calls)
        self.calls += 1
        self.engine.batches.spans = spans if step.prefill else ()
        self.engine.begin_step(step)
        self._open.append((step, spans, ids))
        if self.capture is not None:
            self.capture.start_call()

    def _after(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._open and self._open[-1] is not None:
            step, spans, ids = self._open[-1]
            self.engine.end_step(step)
            if self.capture is not None:
                self.capture.end_call(spans, ids)

    def _done(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._open and self._open.pop() is not None:
            self.engine.leave_step()

    def _layer_call(self, layer: int) -> Callable[..., torch.Tensor]:
        path, capture, forced = self.engine.path, self.capture, self.forced

        def forward_modular(x: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, shared_experts: Any = None,
                            shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
            if forced is not None:
                topk_ids, topk_weights = forced.force(layer, topk_ids, topk_weights)
            if capture is not None:
                capture.layer(layer, topk_ids, topk_weights)
            try:
                return path.run(layer, x, topk_ids, topk_weights, shared_experts=shared_experts,
                                shared_experts_input=shared_experts_input)[0]
            except BlockError as exc:
                raise remedy(exc, self.engine.state.store.path,
                             self.engine.state.store.in_place) from exc

        return forward_modular


def remedy(exc: BlockError, store: Path, in_place: bool) -> BlockError:
    """``exc`` with what a vLLM user does about it: vLLM's step, which computes every
    request together, fails with it (and vLLM's engine stops), and the plugin packs (or
    indexes) a removed store again at its next start."""
    again = ("indexes the checkpoint again at its next start (a checkpoint file damaged "
             "since: download it again first)" if in_place
             else "packs it again at its next start")
    return BlockError(f"{problem(exc)}. Inside vLLM the step's requests are computed "
                      f"together, so the step fails with it: remove {store} and the plugin "
                      f"{again}", exc.layer, exc.expert)
