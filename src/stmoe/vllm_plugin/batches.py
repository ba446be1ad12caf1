"""vLLM's batches as the engine's steps: which rows of a forward call are whose.

Why: vLLM's continuous batching runs every scheduled request's tokens in one flat batch
(``[tokens, hidden]``): decode requests one token each, prompts (or chunks of them) many,
mixed in one call. The engine's step is rows x length, each row a predictor slot. A call
of decode tokens only is exactly that (one row per request, its slot). Any other call is a
prompt step of one row (its routing streamed into the next layer's loads by the routers,
as stmoe does for a prompt); when it ends, the planner teaches each request's own tokens
to its own slot (``BatchPlanner.spans``) and predicts the next call's first layers for
those slots.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from stmoe.runtime.planning import PrefetchPlanner
from stmoe.runtime.step import Part, Step

SCRATCH = -1  # the predictor slot of a call whose rows are no request's (vLLM's dummy runs)


class Span(NamedTuple):
    """One request's tokens in a forward call: rows ``start:end`` of the flat batch, at
    positions ``computed`` on in its sequence; ``prompt``: its prompt's length. (A named
    tuple: made for every request at every step, a frozen dataclass's construction was
    1% of a decode step's time.)"""

    request: str
    slot: int
    start: int
    end: int
    computed: int
    prompt: int


class BatchPlanner(PrefetchPlanner):
    """``PrefetchPlanner`` for vLLM's flat batches: a prompt step's routing taught to each
    request's slot from its own rows (``spans``, set as each call starts)."""

    spans: tuple[Span, ...] = ()

    def forward_started(self) -> None:
        super().forward_started()  # (the scratch slot)
        if self.state.run.phase == "prefill":
            for span in self.spans:
                if span.computed == 0:  # its sequence starts here
                    self.predictor.reset(span.slot)

    def _replay_prefill(self) -> None:
        """Each request's rows taught to its slot in order (after its earlier tokens'), then
        the next call's rows are those requests'."""
        run = self.state.run
        if not self.spans:
            super()._replay_prefill()
            return
        routing = np.stack(run.prefill_routing, axis=1)  # [T, L, K]
        for span in self.spans:
            for t in range(span.start, span.end):
                for layer in range(self.state.num_layers):
                    self.predictor.update(layer, routing[t, layer], span.slot)
        run.slots = [span.slot for span in self.spans]  # what the next call is predicted for


class Requests:
    """The predictor slot of each running request: a small number, given on first sight
    and taken back (its history forgotten) when vLLM says the request finished."""

    def __init__(self) -> None:
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []

    def slot(self, request: str) -> int:
        if request not in self.slot_of:
            self.slot_of[request] = self._free.pop() if self._free else len(self.slot_of)
        return self.slot_of[request]

    def finish(self, request: str) -> int | None:
        """``request`` is over: its slot, now free (None: it never ran)."""
        slot = self.slot_of.pop(request, None)
        if slot is not None:
            self._free.append(slot)
        return slot


def spans_of(requests: Requests, ids: list[str], counts: list[int], computed: list[int],
             prompts: list[int]) -> tuple[Span, ...]:
    """The call's requests in batch order (vLLM's ``input_batch.req_ids``), each with its
    scheduled token count, tokens computed before and prompt length."""
    out, start = [], 0
    for request, n, done, prompt in zip(ids, counts, computed, prompts, strict=True):
        out.append(Span(request, requests.slot(request), start, start + n, done, prompt))
        start += n
    return tuple(out)


def step_of(spans: tuple[Span, ...], tokens: int, call: int) -> Step:
    """The engine's step for a call of ``tokens`` rows: decode rows (one per request, each
    its slot) where every request brings one generated token (past its prompt), else a
    prompt step of one row of ``tokens`` (the scratch slot; ``BatchPlanner`` teaches the
    spans). A prompt's last token alone (the rest in vLLM's prefix cache) is a prompt's."""
    decode = (bool(spans) and spans[-1].end == tokens
              and all(s.end - s.start == 1 and s.computed >= s.prompt > 0 for s in spans))
    if decode:
        return Step((Part(tuple(s.slot for s in spans), call),), 1, prefill=False)
    return Step((Part((SCRATCH,), call),), tokens, prefill=True)
