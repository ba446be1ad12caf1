"""One matrix quantized, and multiplied, with the weight-only kernels torch ships for the CPU.

Why these kernels: at Qwen1.5-MoE's expert size (a 2816 x 2048 gate/up matrix, one decode
token) torch's bf16 ``linear`` takes 0.77 ms here, ``_weight_int8pack_mm`` 0.33 ms and
``_weight_int4pack_mm_for_cpu`` 0.30 ms (1 thread, medians of 5 x 200 calls, this 2-core
machine). The weights are stored as the kernels consume them, so a cache slot is
computed in place: no dequantized copy per call.

- int8: symmetric, one scale per output row: ``w ~ q * scale``, q in [-127, 127];
- int4: asymmetric, one scale and zero per group of input weights of a row, in torch's
  convention ``w ~ (q - 8) * scale + zero``, q in [0, 15]; the packed bytes are
  ``_convert_weight_to_int4pack_for_cpu``'s layout (``[out, in / 2]`` uint8) and the
  scales and zeros one ``[in / group, out, 2]`` tensor. The kernel needs ``out`` a
  multiple of 16 and the group size 32, 64, 128 or 256 dividing ``in``.

Scales (and zeros) are kept in the model's dtype, as the kernels take them, and are
rounded to it before the weights are rounded, so what is stored is what is computed.
Quantization is deterministic: the same matrix gives the same bytes on any machine of the
same CPU capability (int4's packed layout is the CPU's: ``int4_layout``). On CUDA tensors
``qlinear`` and ``dequantize`` take the same stored bytes to torch's CUDA kernels
(``cuda_kernels``): callers do not change.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from stmoe.errors import OffloadError
from stmoe.quant.cuda_kernels import qlinear_cuda
from stmoe.quant.formats import WeightFormat
from stmoe.quant.int4_layout import dequantize_int4, unpack_cpu_int4


class QuantizedMatrix(NamedTuple):
    qweight: torch.Tensor  # int8 [out, in], or int4 packed uint8 [out, in / 2]
    qscale: torch.Tensor  # int8: [out]; int4: [in / group, out, 2] (scale, zero); model dtype


def check_quantizable(shape: tuple[int, ...], fmt: WeightFormat, what: str) -> None:
    """Refuse, naming the matrix, a shape the format's kernel cannot take."""
    if len(shape) != 2:
        raise OffloadError(f"{what}: a {len(shape)}-d tensor, expected a matrix to quantize")
    out, inner = shape
    if fmt.name == "int4":
        assert fmt.group_size is not None
        if out % 16 or inner % fmt.group_size:
            raise OffloadError(
                f"{what}: {out} x {inner} (out x in) cannot be int4 in groups of "
                f"{fmt.group_size}: the kernel needs out a multiple of 16 and in a multiple of "
                "the group size; try --group-size 32 or --format int8")


def quantize_matrix(w: torch.Tensor, fmt: WeightFormat, what: str = "a matrix") -> QuantizedMatrix:
    """``w`` ([out, in], any float dtype) in ``fmt``, scales in ``w``'s dtype."""
    check_quantizable(tuple(w.shape), fmt, what)
    dtype = w.dtype
    wf = w.detach().to("cpu", torch.float32)
    if fmt.name == "int8":
        amax = wf.abs().amax(dim=1)
        scale = (amax / 127).clamp(min=torch.finfo(dtype).tiny).to(dtype)
        q = torch.round(wf / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedMatrix(q.contiguous(), scale.contiguous())
    if fmt.name == "int4":
        assert fmt.group_size is not None
        out, inner = wf.shape
        g = wf.reshape(out, inner // fmt.group_size, fmt.group_size)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(dtype).tiny).to(dtype)
        zero = (lo + 8 * scale.float()).to(dtype)  # the value of q = 8
        q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + 8)
        q = q.clamp(0, 15).to(torch.int32).reshape(out, inner)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in/g, out, 2]
        return QuantizedMatrix(packed.contiguous(), sz)
    raise OffloadError(f"{fmt.name}: not a quantized format")


def qlinear(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor,
            fmt: WeightFormat) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [M, in] with ``w`` stored in ``fmt`` (``x`` cast to the scales'
    dtype, as the kernels need)."""
    if x.dtype != qscale.dtype:
        x = x.to(qscale.dtype)
    x = x.contiguous()  # both kernels need it (a no-op when it is)
    if x.is_cuda:
        return qlinear_cuda(x, qweight, qscale, fmt)
    if fmt.name == "int4":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, fmt.group_size, qscale)
    return torch._weight_int8pack_mm(x, qweight, qscale)


def dequantize(qweight: torch.Tensor, qscale: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """The matrix ``fmt`` computes with, in float32 ([out, in]): what quality is measured
    against, never used on the compute path. int4's packed layout is the kernel's own, so
    its values are read through the kernel (an identity input gives them exactly)."""
    if fmt.name == "int8":
        return qweight.float() * qscale.float()[:, None]
    assert fmt.group_size is not None
    if qweight.device.type != "cpu":  # the values, unpacked: no CPU kernel there
        return dequantize_int4(unpack_cpu_int4(qweight), qscale, fmt.group_size)
    inner = qweight.shape[1] * 2
    eye = torch.eye(inner, dtype=torch.float32)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, qweight, fmt.group_size,
                                                      qscale.float()).t().contiguous()
