"""A step's rows computed together in the quantized formats, each request keeping its bits.

torch's int8/int4 weight-only kernels give M rows in one call exactly the M one-row calls'
bits (checked here at the shapes of a real model's linears); so with quantized experts
and resident linears the batcher computes a step's experts call and its linears for all
its requests at once (runtime/batcher/step_rows.py; here with each request's own forward,
``batched=False``: the batched forward is tests/serve/test_step_forward.py), and every
request's logits must still equal its solo run on the resident model in that format, in
every family. In bf16 nothing is gathered. Requests reaching different calls fail with a
clear error, not a hang.
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staggered_requests import (  # noqa: E402
    LENGTHS,
    PROMPTS,
    LogitLog,
    OnCuda,
    Stop,
    errors_when_the_batcher_stops,
    solo,
    submit_staggered,
)
from stmoe.errors import OffloadError  # noqa: E402
from stmoe.quant import parse_format  # noqa: E402
from stmoe.quant.experts import quantize_model  # noqa: E402
from stmoe.quant.kernels import qlinear, quantize_matrix  # noqa: E402
from stmoe.quant.linears import QuantizedLinear, quantize_linears  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.batcher import Request, StepBatcher  # noqa: E402
from stmoe.runtime.batcher.member import Member  # noqa: E402
from stmoe.runtime.batcher.step_rows import StepRows  # noqa: E402
from stmoe.runtime.store import pack  # noqa: E402
from tiny_moe import FAMILIES, tiny_model  # noqa: E402

FORMATS = {"int8": parse_format("int8"), "int4": parse_format("int4", 32)}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("out_in", [(2048, 2048), (2816, 2048), (2048, 1408), (4096, 2048)])
def test_quantized_kernels_give_each_row_its_one_row_bits(fmt, out_in, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(1)
        f = parse_format(fmt).resolved([out_in[1]])
        q = quantize_matrix(torch.randn(*out_in, dtype=torch.bfloat16) * 0.02, f)
        x = torch.randn(16, out_in[1], dtype=torch.bfloat16)
        solo = torch.cat([qlinear(x[i:i + 1], q.qweight, q.qscale, f) for i in range(16)])
        for m in (2, 3, 4, 8, 16):
            assert torch.equal(qlinear(x[:m], q.qweight, q.qscale, f), solo[:m]), m
    finally:
        torch.set_num_threads(before)


def quantized(name: str, fmt: str) -> torch.nn.Module:
    changes = {"moe_intermediate_size": 32} if "moe_intermediate_size" in FAMILIES[name][1] else {}
    model = quantize_model(tiny_model(name, **changes)[0], FORMATS[fmt])
    quantize_linears(model, parse_format(fmt))
    return model


def native(name: str) -> torch.nn.Module:
    changes = {"moe_intermediate_size": 32} if "moe_intermediate_size" in FAMILIES[name][1] else {}
    return tiny_model(name, **changes)[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rows_together_keep_every_requests_solo_bits(name, tmp_path):
    fmt = "int4"
    resident = quantized(name, fmt)
    log = LogitLog(resident)
    want = [(solo(resident, p, n), log.take()) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    store = pack(native(name), tmp_path / "store", weights=FORMATS[fmt])
    with offload(native(name), store, capacity=3, quantize_resident=fmt,
                 predictor="ondemand") as om:
        logs = LogitLog(om.model)
        gathered = isinstance(om.model.get_output_embeddings(), QuantizedLinear)
        batcher = StepBatcher(om, max_batch=3, batched=False)  # each request's forward
        try:
            assert batcher.share_rows == gathered
            reqs, got = submit_staggered(batcher)
            if gathered:
                assert batcher.rows.calls > 0  # the step's linears were computed together
        finally:
            batcher.close()
        assert all(m.gather is None for m in om.model.modules()
                   if isinstance(m, QuantizedLinear))  # taken off when the batcher closes
    for i, (r, (tokens, logits)) in enumerate(zip(reqs, want, strict=True)):
        assert got[i] == tokens, (name, i)
        mine = logs.take(r.thread_name)
        assert len(mine) == len(logits)
        assert all(torch.equal(a, b) for a, b in zip(mine, logits, strict=True)), (name, i)


def test_bf16_never_gathers(tmp_path):
    with offload(native("qwen2_moe"), capacity=3, predictor="ondemand") as om:
        batcher = StepBatcher(om, max_batch=2)
        try:
            assert not batcher.share_rows
            reqs = [batcher.submit(Request(torch.tensor([p]), 4)) for p in PROMPTS[:2]]
            [r.wait(60) for r in reqs]
            assert batcher.rows.calls == 0
        finally:
            batcher.close()


def test_requests_at_different_calls_fail_clearly():
    model = quantized("qwen2_moe", "int8")
    cv = threading.Condition()
    rows = StepRows(model, cv, threading.local())
    a, b = (Member(Request(torch.tensor([[1]]), 1), slot) for slot in range(2))
    linears = rows.linears
    x = torch.zeros(1, 1, linears[0].in_features)
    for r, m in ((a, linears[0]), (b, linears[1])):
        r.in_step, r.row_call = True, (m, x)
    with cv:
        assert rows.compute([a, b], {0: a, 1: b})
    for r in (a, b):
        assert isinstance(r.result, OffloadError) and "different" in str(r.result)
        assert not r.in_step and r.row_call is None


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_wide_product_split_over_threads_keeps_each_rows_bits(fmt):
    """The lm_head-wide products are split by output columns over the compute threads."""
    from concurrent.futures import ThreadPoolExecutor

    from stmoe.runtime.batcher.step_rows import SPLIT_COLUMNS, split_rows

    torch.manual_seed(2)
    linear = torch.nn.Linear(64, SPLIT_COLUMNS + 48, bias=True).to(torch.bfloat16)
    module = QuantizedLinear(linear, parse_format(fmt).resolved([64]), "wide")
    xs = [torch.randn(1, 1, 64, dtype=torch.bfloat16) for _ in range(3)]
    with ThreadPoolExecutor(2) as pool:
        for workers in (2, 3):
            got = split_rows(module, xs, pool, workers)
            assert module._columns  # it was split
            for x, y in zip(xs, got, strict=True):
                assert y.shape == (1, 1, SPLIT_COLUMNS + 48)
                assert torch.equal(y, module.rows(x)), workers


def test_requests_at_a_gathered_linear_end_when_the_batcher_stops(tmp_path, monkeypatch):
    store = pack(native("qwen2_moe"), tmp_path / "store", weights=FORMATS["int4"])
    with offload(native("qwen2_moe"), store, capacity=3, quantize_resident="int4",
                 predictor="ondemand") as om:
        batcher = StepBatcher(om, max_batch=2, batched=False)
        real_compute = batcher.rows.compute

        def compute(live, members):
            if any(m.row_call is not None for m in live):
                raise Stop()
            return real_compute(live, members)

        monkeypatch.setattr(batcher.rows, "compute", compute)
        try:
            errors = errors_when_the_batcher_stops(batcher)
            # the one waiting at the linear is told why; another may end cancelled
            assert any("the batcher stopped" in e for e in errors), errors
        finally:
            batcher.close()


def test_a_product_in_cudas_int4_layout_is_one_product_not_split():
    """On a gpu tier ``device_linears`` leaves int4 weights in CUDA's 4-D layout, lm_head's
    too: there are no columns to cut (and one CUDA kernel spans the device), so the wide
    product is one call. Before, every step that reached lm_head failed for each request
    with 'columns of a matrix in CUDA's int4 layout' (found by reading: no GPU here)."""
    from concurrent.futures import ThreadPoolExecutor

    from stmoe.quant.cuda_kernels import cuda_int4_shape
    from stmoe.runtime.batcher.step_rows import SPLIT_COLUMNS, split_rows

    linear = torch.nn.Linear(256, SPLIT_COLUMNS, bias=False).to(torch.bfloat16)
    module = QuantizedLinear(linear, parse_format("int4", 128), "lm_head")
    module.qweight = torch.nn.Parameter(  # the layout's shape (the CPU cannot compute it)
        torch.zeros(cuda_int4_shape(SPLIT_COLUMNS, 256), dtype=torch.int32), requires_grad=False)
    seen = []

    def rows(flat: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(flat.shape))
        return torch.zeros(flat.shape[0], SPLIT_COLUMNS, dtype=flat.dtype)

    module.rows = rows
    xs = [torch.randn(1, 2, 256, dtype=torch.bfloat16), torch.randn(1, 1, 256,
                                                                    dtype=torch.bfloat16)]
    with ThreadPoolExecutor(2) as pool:
        got = split_rows(module, xs, pool, 2)
    assert seen == [(3, 256)] and not module._columns
    assert [tuple(y.shape) for y in got] == [(1, 2, SPLIT_COLUMNS), (1, 1, SPLIT_COLUMNS)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CI has none")
@pytest.mark.parametrize("resident", ["int8", "int4"])
def test_on_cuda_a_steps_gathered_rows_keep_every_requests_solo_tokens(resident, tmp_path):
    """`stmoe serve --tier gpu --quantize-resident`: the step batcher gathers the resident
    linears' rows of its requests into one product (each request its own forward). Each
    request gets its tokens alone on the same offloaded GPU model, lm_head's 4096-wide
    product included (int4: CUDA's layout, one product, never split by columns)."""
    from stmoe.runtime.batcher.step_rows import SPLIT_COLUMNS

    def bf16() -> torch.nn.Module:
        return tiny_model("qwen3_moe", vocab_size=SPLIT_COLUMNS,
                          moe_intermediate_size=32)[0].to(torch.bfloat16)

    store = pack(bf16(), tmp_path / "store", weights=FORMATS["int4"])
    with offload(bf16(), store, capacity=3, quantize_resident=resident, predictor="ondemand",
                 tier="gpu") as om:
        want = [solo(OnCuda(om.model), p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
        batcher = StepBatcher(om, max_batch=3, batched=False)
        try:
            assert batcher.share_rows
            _, got = submit_staggered(batcher)
            assert batcher.rows.calls > 0
        finally:
            batcher.close()
    assert got == want
