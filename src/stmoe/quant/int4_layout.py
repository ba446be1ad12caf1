"""int4 weights between layouts: the CPU kernel's packed bytes, the plain values (0..15),
and the nibble pairs CUDA's converter takes. Plain tensor operations, on any device.

Why: a store's int4 bytes are ``_convert_weight_to_int4pack_for_cpu``'s, which CUDA's
``_weight_int4pack_mm`` cannot read, and that CPU layout is not even one layout. torch
packs the rows of an ``[n, k]`` matrix in blocks of ``BLOCK_N`` rows (64 where it runs
AVX512 code, 32 with AVX2 or none), each block as ``[k, rows / 2]`` bytes; in a full block
a vectorised build pairs row ``d`` (low nibble) with row ``d + BLOCK_N / 2`` (high), the
plain build row ``2j`` with row ``2j + 1``, and every build packs a last, partial block
the plain way (aten/src/ATen/native/cpu/int4mm_kernel.cpp, ``weight_to_int4pack_kernel``;
checked against torch itself in tests/quant/test_int4_layout.py, the other builds through
``ATEN_CPU_CAPABILITY``). So the bytes depend on the CPU that packed them, and a store
packed on an AVX512 machine would compute other weights on an AVX2 one, so an int4 store's
index records the layout that packed it and a store made elsewhere is repacked as it is read
(``runtime.store.int4_store``). ``unpack_cpu_int4`` and ``pack_cpu_int4`` convert between
any of these layouts and the values; ``cuda_nibbles`` pairs values as CUDA's
``_convert_weight_to_int4pack`` reads them (byte ``i`` of a row: value ``2i`` high, ``2i + 1``
low: torch's own ``_group_quantize_tensor``).
"""

from __future__ import annotations

import torch

from stmoe.errors import OffloadError
from stmoe.quant.formats import INT4_LAYOUTS as LAYOUTS  # BLOCK_N of each CPU layout


def cpu_layout() -> str:
    """The layout this process's CPU kernels pack and read (torch's CPU capability: AVX512,
    AVX2, or anything else, which packs as the plain build does)."""
    name = torch.backends.cpu.get_cpu_capability().lower()
    return name if name in LAYOUTS else "default"


def _check(layout: str) -> int:
    if layout not in LAYOUTS:
        raise OffloadError(f"int4 layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return LAYOUTS[layout]


def unpack_cpu_int4(packed: torch.Tensor, layout: str | None = None) -> torch.Tensor:
    """The values (uint8, 0..15, ``[n, k]``) of a CPU-packed ``[n, k / 2]`` uint8 matrix in
    ``layout`` (default: this process's, which is what packed a store made here)."""
    layout = layout or cpu_layout()
    size = _check(layout)
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    full = n // size
    rows: list[torch.Tensor] = []
    if full:
        b = flat[: full * size * k // 2].reshape(full, k, size // 2)
        lo, hi = b & 15, b >> 4
        both = (torch.stack([lo, hi], dim=-1).reshape(full, k, size) if layout == "default"
                else torch.cat([lo, hi], dim=-1))
        rows.append(both.permute(0, 2, 1).reshape(full * size, k))
    tail = n - full * size
    if tail:
        b = flat[full * size * k // 2 :].reshape(k, tail // 2)
        rows.append(torch.stack([b & 15, b >> 4], dim=-1).reshape(k, tail).t())
    return torch.cat(rows).contiguous() if len(rows) > 1 else rows[0].contiguous()


def pack_cpu_int4(values: torch.Tensor, layout: str | None = None) -> torch.Tensor:
    """``values`` (``[n, k]``, 0..15, any integer dtype) packed as the CPU kernel of
    ``layout`` packs them: ``[n, k / 2]`` uint8 (n a multiple of 16, k even)."""
    layout = layout or cpu_layout()
    size = _check(layout)
    q = values.to(torch.uint8)
    n, k = q.shape
    full = n // size
    pieces: list[torch.Tensor] = []
    if full:
        r = q[: full * size].reshape(full, size, k).permute(0, 2, 1)  # [blocks, k, rows]
        lo, hi = ((r[..., 0::2], r[..., 1::2]) if layout == "default"
                  else (r[..., : size // 2], r[..., size // 2 :]))
        pieces.append(((hi << 4) | lo).reshape(-1))
    if n - full * size:
        r = q[full * size :].t()  # [k, rows]
        pieces.append(((r[:, 1::2] << 4) | r[:, 0::2]).reshape(-1))
    return torch.cat(pieces).reshape(n, k // 2)


def cuda_nibbles(values: torch.Tensor) -> torch.Tensor:
    """``values`` (``[n, k]``, 0..15) as CUDA's ``_convert_weight_to_int4pack`` takes them:
    ``[n, k / 2]`` uint8, value ``2i`` in the high nibble of byte ``i``, ``2i + 1`` low."""
    q = values.to(torch.uint8)
    return ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()


def from_cuda_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """``cuda_nibbles``' inverse: the values (uint8, 0..15, ``[n, k]``) of ``[n, k / 2]``
    nibble pairs as CUDA's converter takes them."""
    hi, lo = nibbles >> 4, nibbles & 15
    return torch.stack([hi, lo], dim=-1).reshape(nibbles.shape[0], -1).contiguous()


def dequantize_int4(values: torch.Tensor, qscale: torch.Tensor, group: int) -> torch.Tensor:
    """The matrix (float32, ``[n, k]``) of int4 ``values`` with scales and zeros ``qscale``
    (``[k / group, n, 2]``): ``(q - 8) x scale + zero``, the kernels' convention."""
    k = values.shape[1]
    sz = qscale.float().repeat_interleave(group, dim=0)[:k]  # [k, n, 2]
    return (values.float() - 8) * sz[..., 0].t() + sz[..., 1].t()
