"""The capture's rows per request (stmoe.vllm_plugin.capture): by position in the sequence,
a prompt whose start vLLM's prefix cache held included, and a preempted request's
recomputed rows. Needs no vLLM."""

from __future__ import annotations

import numpy as np
import torch

from stmoe.trace import load_trace
from stmoe.vllm_plugin.batches import Span
from stmoe.vllm_plugin.capture import Capture

LAYERS, K = 2, 2


def _call(cap: Capture, spans: list[Span], tokens: list[int]) -> None:
    """One forward call: token t routed to experts (t, t+1) at every layer."""
    cap.start_call()
    ids = torch.tensor([[t % 8, (t + 1) % 8] for t in tokens])
    for layer in range(LAYERS):
        cap.layer(layer, ids, torch.full((len(tokens), K), 0.5))
    cap.end_call(tuple(spans), torch.tensor(tokens))


def test_a_prompt_from_the_prefix_cache_starts_where_it_ran_its_decode_marked(tmp_path):
    """Prompt of 6 tokens, the first 4 in vLLM's prefix cache: positions 4-5 run in one call,
    then two decode tokens. The trace: 4 rows, the last two decode (before: 4 prompt rows,
    no decode token, which `stmoe profile` took as they were)."""
    cap = Capture(tmp_path, LAYERS, 8, "m")
    _call(cap, [Span("a", 0, 0, 2, 4, 6)], [14, 15])
    _call(cap, [Span("a", 0, 0, 1, 6, 6)], [16])
    _call(cap, [Span("a", 0, 0, 1, 7, 6)], [17])
    trace = load_trace(cap.finish("a"))
    assert trace.num_tokens == 4 and list(trace.is_decode) == [False, False, True, True]
    assert list(trace.token_ids) == [14, 15, 16, 17]
    assert trace.meta.extra["cached_prompt_tokens"] == 4
    assert trace.meta.extra["prompt_tokens"] == 6


def test_a_whole_prompt_run_has_no_cached_tokens_and_recomputed_rows_replace_theirs(tmp_path):
    """A request run from position 0, preempted after 5 rows and recomputed from position 3
    (vLLM keeps 3): its rows 3-4 are the recomputed ones, once."""
    cap = Capture(tmp_path, LAYERS, 8, "m")
    _call(cap, [Span("b", 0, 0, 4, 0, 4)], [0, 1, 2, 3])
    _call(cap, [Span("b", 0, 0, 1, 4, 4)], [4])
    _call(cap, [Span("b", 0, 0, 2, 3, 4)], [3, 4])  # recomputed from 3
    _call(cap, [Span("b", 0, 0, 1, 5, 4)], [5])
    trace = load_trace(cap.finish("b"))
    assert list(trace.token_ids) == [0, 1, 2, 3, 4, 5]
    assert list(trace.is_decode) == [False] * 4 + [True] * 2
    assert "cached_prompt_tokens" not in trace.meta.extra
    assert np.array_equal(np.asarray(trace.experts)[:, 0, 0], [0, 1, 2, 3, 4, 5])
