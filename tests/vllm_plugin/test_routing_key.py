"""``routing=TRACE`` (``vllm_plugin.forced``): each request's rows take a recorded trace's
routing by position, from a start its prompt decides (the same prompt, the same stretch),
rows of no request keep the router's, and a trace that cannot drive the model is refused by
name. Needs no vLLM."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from stmoe.trace import save_trace, synthesize
from stmoe.vllm_plugin.batches import Span
from stmoe.vllm_plugin.config import PluginConfigError, parse
from stmoe.vllm_plugin.forced import ForcedRouting

L, N, K, T = 4, 16, 4, 100


@pytest.fixture
def trace_file(tmp_path):
    trace = synthesize(tokens=T, layers=L + 2, experts=N, top_k=K, sequences=2, seed=1)
    return trace, save_trace(trace, tmp_path / "routing.npz")


def _router(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((rows, K), 99, dtype=torch.int32), torch.zeros(rows, K)


PROMPTS = {"a": np.array([5, 6, 7]), "b": np.array([9, 1])}


def _start(request: str) -> int:
    return zlib.crc32(PROMPTS[request].astype(np.int64).tobytes()) % T


def _call(forced: ForcedRouting, spans: tuple[Span, ...]) -> None:
    forced.begin_call(spans, lambda i: PROMPTS[spans[i].request])


def test_each_requests_rows_take_the_trace_by_position(trace_file):
    trace, path = trace_file
    forced = ForcedRouting(path, L, N, K)
    a, b = _start("a"), _start("b")
    assert a != b
    # a prompt of 3 tokens (request a), then a decode row each for a and b (b's 6th token)
    _call(forced, (Span("a", 0, 0, 3, 0, 3),))
    ids, w = forced.force(2, *_router(3))
    rows = [(a + p) % T for p in range(3)]
    assert ids.dtype == torch.int32 and np.array_equal(ids.numpy(), trace.experts[rows, 2])
    np.testing.assert_array_equal(w.numpy(), trace.weights[rows, 2])
    _call(forced, (Span("a", 0, 0, 1, 3, 3), Span("b", 1, 1, 2, 5, 2)))
    ids, _ = forced.force(1, *_router(3))  # a third row: no request's (a padded batch)
    assert np.array_equal(ids[0].numpy(), trace.experts[(a + 3) % T, 1])
    assert np.array_equal(ids[1].numpy(), trace.experts[(b + 5) % T, 1])
    assert (ids[2] == 99).all()
    _call(forced, (Span("b", 1, 0, 1, T - b, 2),))  # past the end: wraps around
    assert np.array_equal(forced.force(0, *_router(1))[0][0].numpy(), trace.experts[0, 0])
    forced.begin_call((), lambda i: np.array([]))  # vLLM's dummy run: the router's own
    assert (forced.force(0, *_router(2))[0] == 99).all()


def test_the_same_prompt_replays_the_same_stretch_in_another_engine(trace_file):
    """Whatever vLLM calls the request and whatever ran before it."""
    _, path = trace_file
    one, two = ForcedRouting(path, L, N, K), ForcedRouting(path, L, N, K)
    _call(one, (Span("b", 0, 0, 2, 0, 2),))  # another request first
    _call(one, (Span("a", 1, 0, 3, 0, 3),))
    first = one.force(0, *_router(3))[0]
    two.begin_call((Span("r7", 0, 0, 3, 0, 3),), lambda i: PROMPTS["a"])
    assert torch.equal(two.force(0, *_router(3))[0], first)
    two.finish("r7")  # its start forgotten: a new request of that name starts afresh
    two.begin_call((Span("r7", 0, 0, 2, 0, 2),), lambda i: PROMPTS["b"])
    assert two._start == {"r7": _start("b")}


@pytest.mark.parametrize(("shape", "says"), [
    ((L + 3, N, K), "routing of 6 MoE layers, top-4 of 16 experts cannot drive a model of 7"),
    ((L, N, 2), "top-4 of 16 experts cannot drive a model of 4 layers, top-2"),
    ((L, 8, K), "cannot drive a model of 4 layers, top-4 of 8"),
])
def test_a_trace_that_cannot_drive_the_model_is_refused(trace_file, shape, says):
    _, path = trace_file
    with pytest.raises(PluginConfigError, match="routing=") as err:
        ForcedRouting(path, *shape)
    assert says in str(err.value)


def test_an_unreadable_trace_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a trace")
    with pytest.raises(PluginConfigError, match=f"routing={bad}"):
        ForcedRouting(bad, L, N, K)


def test_the_key_is_read_and_refused_beside_capture():
    assert str(parse("routing=~/r.npz").routing).endswith("r.npz")
    with pytest.raises(PluginConfigError, match="capture= would record that trace"):
        parse("routing=r.npz,capture=caps")
