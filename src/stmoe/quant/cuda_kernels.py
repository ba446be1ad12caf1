"""The weight-only formats on CUDA, behind ``kernels.qlinear``: the stored bytes, computed
by torch's CUDA kernels where they take them, else as the dequantized matrix.

- int4: CUDA's ``_weight_int4pack_mm`` (tinygemm) takes bf16 activations and the layout
  ``_convert_weight_to_int4pack(nibbles, inner_k_tiles)`` makes on the device,
  ``[n / 8, k / (16 t), 32, t / 2]`` int32: as many bytes as the stored ``[n, k / 2]``
  matrix, arranged otherwise. ``to_cuda_int4`` makes it from the stored (CPU-layout)
  bytes: unpacked to values and paired into nibbles on the device
  (``int4_layout``), then converted; the scales and zeros ``[k / group, n, 2]`` are the
  same tensor for both kernels. A stored matrix handed to ``qlinear`` on CUDA is converted
  per call (correct; converting once at load, ``device_weight``, is what a cache should do);
  activations other than bf16, or a width the kernel cannot tile (``k`` a multiple of 32),
  are computed as ``x @ dequantized.T`` in the activations' dtype.
- int8: ``_weight_int8pack_mm`` has a CUDA kernel in torch's native_functions.yaml (2.13
  here: ``CUDA: _weight_int8pack_mm_cuda``; it accumulates in float32); where the running
  torch has none, the dequantized matrix times x.

The bits differ from the CPU kernels' (other reduction orders); the lossless contract's
reference on a GPU is the GPU-resident model in the same format, computed here too.
"""

from __future__ import annotations

from functools import cache

import torch

from stmoe.errors import OffloadError
from stmoe.quant.formats import WeightFormat
from stmoe.quant.int4_layout import cuda_nibbles, dequantize_int4, unpack_cpu_int4


@cache
def has_cuda_kernel(op: str) -> bool:
    """Whether the running torch registers a CUDA kernel for ``aten::op``."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CUDA"))


def inner_k_tiles(k: int) -> int | None:
    """The largest tiling (8, 4, 2 k-tiles of 16) CUDA's int4 layout takes for width ``k``."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def int4_kernel_takes(k: int, dtype: torch.dtype) -> bool:
    """Whether ``_weight_int4pack_mm`` computes a width-``k`` matrix for ``dtype`` activations."""
    return (dtype == torch.bfloat16 and inner_k_tiles(k) is not None
            and has_cuda_kernel("_weight_int4pack_mm"))


def cuda_int4_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """The shape (int32) of an ``[n, k]`` int4 matrix in CUDA's kernel layout: the stored
    ``[n, k / 2]`` bytes' count, arranged as ``_convert_weight_to_int4pack`` makes them."""
    tiles = inner_k_tiles(k)
    if tiles is None or n % 8:
        raise OffloadError(f"an int4 matrix {n} x {k}: CUDA's int4 layout needs the rows a "
                           "multiple of 8 and the width a multiple of 32")
    return (n // 8, k // (16 * tiles), 32, tiles // 2)


def to_cuda_int4(qweight: torch.Tensor, layout: str | None = None,
                 device: torch.device | str = "cuda") -> torch.Tensor:
    """A stored int4 matrix (``[n, k / 2]`` uint8 in the CPU ``layout``: this process's by
    default) in CUDA's int4 kernel layout on ``device``."""
    k = qweight.shape[1] * 2
    tiles = inner_k_tiles(k)
    if tiles is None:
        raise OffloadError(f"an int4 matrix {k} wide: CUDA's int4 kernel needs the width a "
                           "multiple of 32")
    values = unpack_cpu_int4(qweight.to(device), layout)
    return torch.ops.aten._convert_weight_to_int4pack(cuda_nibbles(values), tiles)


def device_weight(qweight: torch.Tensor, qscale: torch.Tensor, fmt: WeightFormat,
                  device: torch.device | str) -> torch.Tensor:
    """``qweight`` as ``qlinear`` on ``device`` computes it fastest: int4 whose kernel takes
    its scales' dtype converted once to CUDA's layout, anything else moved as it is."""
    dev = torch.device(device)
    if (dev.type == "cuda" and fmt.name == "int4" and qweight.dim() == 2
            and int4_kernel_takes(qweight.shape[1] * 2, qscale.dtype)):
        return to_cuda_int4(qweight, device=dev)
    return qweight.to(dev)


def qlinear_cuda(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor,
                 fmt: WeightFormat) -> torch.Tensor:
    """``x @ w.T`` on CUDA (``x`` contiguous, in the scales' dtype: ``kernels.qlinear``)."""
    if fmt.name == "int8":
        if has_cuda_kernel("_weight_int8pack_mm"):
            return torch._weight_int8pack_mm(x, qweight, qscale)
        w = qweight.float() * qscale.float()[:, None]
        return torch.nn.functional.linear(x, w.to(x.dtype))
    assert fmt.group_size is not None
    if qweight.dim() == 4:  # already CUDA's layout (``device_weight``)
        return torch.ops.aten._weight_int4pack_mm(x, qweight, fmt.group_size, qscale)
    if int4_kernel_takes(x.shape[1], x.dtype):
        w4 = to_cuda_int4(qweight, device=x.device)
        return torch.ops.aten._weight_int4pack_mm(x, w4, fmt.group_size, qscale)
    return dequantized_linear(x, qweight, qscale, fmt)


def dequantized_linear(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor,
                       fmt: WeightFormat) -> torch.Tensor:
    """The fallback, on any device: ``x @ w.T`` with ``w`` the stored int4 matrix's values
    (unpacked from this process's CPU layout) dequantized, in ``x``'s dtype."""
    assert fmt.group_size is not None
    w = dequantize_int4(unpack_cpu_int4(qweight), qscale, fmt.group_size)
    return torch.nn.functional.linear(x, w.to(x.dtype))
