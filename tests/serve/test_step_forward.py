"""A decode step as one batched forward, each request keeping its solo bits.

With quantized experts and resident linears the step batcher runs a decode step's
requests through the model in ONE forward (runtime/batcher/step_forward.py): quantized linears
over all rows, routers, native linears, attention and routed experts row by row. Every
request's logits must equal its solo run on the resident model in that format, in every
family where the batched forward is used; where it cannot hold (eager attention, sliding
or linear-attention layers, bf16) the batcher keeps each request's own forward, and says
why. A failing batched forward fails its step's requests, not the server.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_step_rows import FORMATS, native, quantized  # noqa: E402

from staggered_requests import (  # noqa: E402
    LENGTHS,
    PROMPTS,
    ForwardLog,
    OnCuda,
    Stop,
    errors_when_the_batcher_stops,
    solo,
    submit_staggered,
)
from stmoe.errors import OffloadError  # noqa: E402
from stmoe.quant.linears import QuantizedLinear  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.batcher import Request, StepBatcher  # noqa: E402
from stmoe.runtime.batcher.step_forward import decode_call, why_not  # noqa: E402
from stmoe.runtime.store import pack  # noqa: E402
from tiny_moe import FAMILIES  # noqa: E402

NOT_BATCHED = {"gpt_oss": "eager", "qwen3_next": "linear_attention"}  # why, in why_not's words


def offloaded(name: str, fmt: str, tmp_path, **kw):
    store = pack(native(name), tmp_path / "store", weights=FORMATS[fmt])
    return offload(native(name), store, capacity=3, quantize_resident=fmt,
                   predictor="ondemand", **kw)


def staggered_against_solo(name: str, fmt: str, tmp_path, **batcher_options) -> StepBatcher:
    """PROMPTS joining and leaving a batcher; each request's tokens and every logit equal
    to its solo run on the resident model in ``fmt``. The batcher, closed."""
    resident = quantized(name, fmt)
    log = ForwardLog(resident)
    want = [(solo(resident, p, n), log.take()) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    with offloaded(name, fmt, tmp_path) as om:
        logs = ForwardLog(om.model)
        batcher = StepBatcher(om, max_batch=3, **batcher_options)
        try:
            reqs, got = submit_staggered(batcher)
        finally:
            batcher.close()
        assert "forward" not in om.model.__dict__  # the batcher's routing is taken off
        assert all(m.gather is None for m in om.model.modules() if isinstance(m, QuantizedLinear))
    for i, (r, (tokens, logits)) in enumerate(zip(reqs, want, strict=True)):
        assert got[i] == tokens, (name, i)
        mine = logs.take(r.thread_name)
        assert len(mine) == len(logits)
        assert all(torch.equal(a, b) for a, b in zip(mine, logits, strict=True)), (name, i)
    return batcher


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_batched_forward_keeps_every_requests_solo_bits(name, tmp_path):
    batcher = staggered_against_solo(name, "int4", tmp_path)
    if name in NOT_BATCHED:
        assert not batcher.batched and NOT_BATCHED[name] in batcher.step_forward.why_not
        assert batcher.step_forward.steps == 0 and batcher.rows.calls > 0  # rows gathered
    else:
        assert batcher.batched and batcher.step_forward.why_not is None
        # every decode step of the run was one forward (the prompts ran alone)
        assert batcher.step_forward.steps == len(batcher.decode_sizes()) > 0
        assert batcher.rows.calls == 0


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_int8_batched_forward_keeps_solo_bits(name, tmp_path):
    assert staggered_against_solo(name, "int8", tmp_path).step_forward.steps > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CI has none")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_on_cuda_one_batched_forward_keeps_every_requests_solo_tokens(fmt, tmp_path):
    """`stmoe serve --tier gpu` with quantized experts and resident linears: a decode step's
    requests in one forward on the GPU, each getting its tokens alone on the same model."""
    def bf16() -> torch.nn.Module:
        return native("qwen3_moe").to(torch.bfloat16)

    store = pack(bf16(), tmp_path / "store", weights=FORMATS[fmt])
    with offload(bf16(), store, capacity=3, quantize_resident=fmt, predictor="ondemand",
                 tier="gpu") as om:
        want = [solo(OnCuda(om.model), p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
        batcher = StepBatcher(om, max_batch=3)
        try:
            _, got = submit_staggered(batcher)
        finally:
            batcher.close()
        assert batcher.batched and batcher.step_forward.steps > 0
    assert got == want


def test_batched_false_keeps_each_requests_own_forward(tmp_path):
    batcher = staggered_against_solo("qwen2_moe", "int4", tmp_path, batched=False)
    assert not batcher.batched and batcher.step_forward.steps == 0 and batcher.rows.calls > 0


def test_bf16_is_never_batched():
    model = native("qwen2_moe")
    assert "lm_head is not quantized" in why_not(model)
    with offload(model, capacity=3, predictor="ondemand") as om:
        batcher = StepBatcher(om, max_batch=2)
        try:
            assert not batcher.batched
            reqs = [batcher.submit(Request(torch.tensor([p]), 3)) for p in PROMPTS[:2]]
            [r.wait(60) for r in reqs]
            assert batcher.step_forward.steps == 0
        finally:
            batcher.close()


def test_a_failed_batched_forward_fails_its_step_and_the_batcher_goes_on(tmp_path, monkeypatch):
    with offloaded("qwen2_moe", "int4", tmp_path) as om:
        batcher = StepBatcher(om, max_batch=2)
        real_run = batcher.step_forward.run
        broken = [True]

        def run(calls):
            if broken[0]:
                raise RuntimeError("a kernel failed")
            return real_run(calls)

        monkeypatch.setattr(batcher.step_forward, "run", run)
        try:
            reqs = [batcher.submit(Request(torch.tensor([p]), 4)) for p in PROMPTS[:2]]
            for r in reqs:
                with pytest.raises(RuntimeError, match="a kernel failed"):
                    r.wait(60)
            broken[0] = False
            after = batcher.submit(Request(torch.tensor([PROMPTS[2]]), 3))
            assert len(after.wait(60)) == 3  # the next request is served
        finally:
            batcher.close()


def test_requests_waiting_for_a_batched_forward_end_when_the_batcher_stops(tmp_path,
                                                                          monkeypatch):
    with offloaded("qwen2_moe", "int4", tmp_path) as om:
        batcher = StepBatcher(om, max_batch=2)

        def run(calls):
            raise Stop()

        monkeypatch.setattr(batcher.step_forward, "run", run)
        try:
            errors = errors_when_the_batcher_stops(batcher)
            assert any("the batcher stopped" in e for e in errors), errors
        finally:
            batcher.close()


def test_a_decode_call_is_checked():
    cache = object()
    ok = decode_call((), {"input_ids": torch.tensor([[3]]), "cache": cache, "use_cache": True})
    assert ok["cache"] is cache
    with pytest.raises(OffloadError, match="one token with its KV cache"):
        decode_call((), {"input_ids": torch.tensor([[3, 4]]), "cache": cache})
    with pytest.raises(OffloadError, match="one token with its KV cache"):
        decode_call((torch.tensor([[3]]),), {})
    with pytest.raises(OffloadError, match="does not take"):
        decode_call((), {"input_ids": torch.tensor([[3]]), "cache": cache,
                         "inputs_embeds": torch.zeros(1, 1, 4)})


def test_a_decode_call_before_the_prompt_steps_books_are_closed_is_batched(tmp_path,
                                                                           monkeypatch):
    """A request's first decode call can come while the batcher is still closing its
    prompt step's books: it is a decode call by its cache, whatever the books say."""
    import time

    with offloaded("qwen2_moe", "int4", tmp_path) as om:
        batcher = StepBatcher(om, max_batch=2)
        planner = batcher.engine.planner
        real_end = planner.forward_ended

        def slow_end():
            time.sleep(0.1)  # the request's thread posts its next call meanwhile
            real_end()

        monkeypatch.setattr(planner, "forward_ended", slow_end)
        try:
            reqs = [batcher.submit(Request(torch.tensor([p]), 3)) for p in PROMPTS[:2]]
            assert [len(r.wait(60)) for r in reqs] == [3, 3]
            assert batcher.step_forward.steps > 0
        finally:
            batcher.close()


def test_the_serve_start_line_says_what_a_step_computes_together():
    from types import SimpleNamespace

    from stmoe.cli.serve import _step_mode

    def batcher(batched, share_rows, why=None):
        return SimpleNamespace(batched=batched, share_rows=share_rows,
                               step_forward=SimpleNamespace(why_not=why))

    assert "one batched forward" in _step_mode(batcher(True, True))
    line = _step_mode(batcher(False, True, "its attention is 'eager', not sdpa"))
    assert "each request's own forward" in line and "eager" in line
    assert "computed alone" in _step_mode(batcher(False, False))
