"""int8 and int4 on CUDA (run where a GPU is; skipped on CI, which has none): the stored
bytes through torch's CUDA kernels compute the dequantized matrix, the per-call and the
converted-once int4 give the same bits, and a quantized model runs on the GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from stmoe.quant import parse_format  # noqa: E402
from stmoe.quant.cuda_kernels import device_weight, has_cuda_kernel  # noqa: E402
from stmoe.quant.kernels import dequantize, qlinear, quantize_matrix  # noqa: E402

cuda = [pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CI has none")]


def _apply(marks):
    def wrap(f):
        for m in marks:
            f = m(f)
        return f
    return wrap


@_apply(cuda)
@pytest.mark.parametrize("fmt", [parse_format("int8"), parse_format("int4", 32),
                                 parse_format("int4", 128)], ids=lambda f: f.short)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_stored_bytes_compute_the_dequantized_matrix_on_cuda(fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=gen).to(dtype)
    m = quantize_matrix(w, fmt)  # on the CPU, as a store is packed
    ref = dequantize(*m, fmt)  # the CPU kernel's own matrix
    qw, qs = m.qweight.cuda(), m.qscale.cuda()
    back = dequantize(qw, qs, fmt).cpu()  # the values, unpacked on the GPU
    assert torch.allclose(back, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    for rows in (1, 5, 64):
        x = torch.randn(rows, 512, generator=gen).to(dtype)
        got = qlinear(x.cuda(), qw, qs, fmt).float().cpu()
        want = x.float() @ ref.t()
        tol = 1e-3 if dtype == torch.float32 else 0.02 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol, rows


@_apply(cuda)
def test_int4_converted_once_is_the_per_call_conversion_bit_for_bit():
    fmt = parse_format("int4", 64)
    gen = torch.Generator().manual_seed(1)
    m = quantize_matrix(torch.randn(128, 256, generator=gen).bfloat16(), fmt)
    qw, qs = m.qweight.cuda(), m.qscale.cuda()
    once = device_weight(qw, qs, fmt, "cuda")
    assert once.dim() == 4 and once.dtype == torch.int32 and has_cuda_kernel("_weight_int4pack_mm")
    assert once.numel() * 4 == m.qweight.numel()  # the same bytes, arranged for the kernel
    x = torch.randn(3, 256, generator=gen).bfloat16().cuda()
    assert torch.equal(qlinear(x, qw, qs, fmt), qlinear(x, once, qs, fmt))


@_apply(cuda)
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_quantized_model_runs_on_the_gpu_and_repeats_its_bits(name):
    pytest.importorskip("transformers")
    from stmoe.quant.experts import quantize_model
    from tiny_moe import tiny_model

    model, _ = tiny_model("olmoe")  # expert matrices int4 in groups of 32 takes
    model = quantize_model(model.to(torch.bfloat16), parse_format(name)).cuda()
    ids = torch.tensor([[1, 5, 9, 2, 7]], device="cuda")
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)


def _grouped(x, w, offs):
    """The grouped GEMM transformers' ``grouped_mm`` experts call on CUDA."""
    f = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return f(x, w, offs=offs)


@_apply(cuda)
@pytest.mark.parametrize("k, n", [(2048, 1024), (512, 2048)], ids=["gate_up", "down"])
def test_grouped_mm_gives_each_row_the_same_bits_whatever_the_number_of_groups(k, n):
    """An offloaded layer's call of several tokens (a prompt) passes its slots, or the
    needed experts, where the resident model passes every expert: fewer groups for the same
    rows. torch's sm90 grouped GEMM chooses its tile shape from the rows per group (128 or
    fewer: one, more: another), so a long prompt can take the other kernel offloaded than
    resident (here 160 rows per group over 64 groups, 40 over 256: Qwen3.6-35B-A3B's
    matrices). Lossless needs the same bits from both."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        pytest.skip("this torch has no grouped GEMM")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch's grouped GEMM kernel needs sm90 or later")
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, used, per = 256, 64, 160
    w = (torch.randn(experts, n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(used * per, k, generator=gen, device="cuda").to(torch.bfloat16)
    counts = torch.zeros(experts, dtype=torch.int32, device="cuda")
    counts[:used] = per
    every = _grouped(x, w.transpose(-2, -1), torch.cumsum(counts, 0, dtype=torch.int32))
    fewer = _grouped(x, w[:used].transpose(-2, -1),
                     torch.cumsum(counts[:used], 0, dtype=torch.int32))
    assert torch.equal(every, fewer)
