"""What a cache slot holds: each per-expert parameter's place in a store block
(``ParamSpec``), and the parameters a slot on a device holds in another layout
(``SlotLayout``).

Why another layout: a store's int4 bytes are the CPU kernel's layout; CUDA's
``_weight_int4pack_mm`` reads another, with the same number of bytes. Converting per call
(``quant.cuda_kernels.qlinear_cuda`` does, for a matrix handed over as stored) costs an
unpack and a convert at every layer call; converting once as the expert lands in its slot
costs it once per load. So on CUDA a slot's int4 matrices (``NAME_qweight``, where the
kernel takes their scales' dtype and width) live in the kernel's layout: the copy brings
the stored bytes, then ``LayerCache.convert`` rewrites them in place on the same stream,
before the slot's ready event. The bits are the same as the per-call conversion's, so the
offloaded model equals the GPU-resident one in the same format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stmoe.quant.cuda_kernels import cuda_int4_shape, int4_kernel_takes, to_cuda_int4
from stmoe.runtime.store import Block


@dataclass(frozen=True)
class ParamSpec:
    """One per-expert parameter: where its bytes sit inside a store block."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown tensor dtype {name!r} in the store")
    return dtype


def param_specs(block: Block) -> list[ParamSpec]:
    specs = []
    for t in block.tensors:
        dtype = torch_dtype(t.dtype)
        count = 1
        for d in t.shape:
            count *= d
        specs.append(ParamSpec(t.name, dtype, t.shape, t.offset, count * dtype.itemsize))
    return specs


@dataclass(frozen=True)
class SlotLayout:
    """A parameter a slot holds otherwise than the store: its per-expert ``shape`` and
    ``dtype`` there (as many bytes as stored), and ``convert``: the stored tensor (its
    dtype and shape, on the device) to it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    convert: Callable[[torch.Tensor], torch.Tensor]


def device_layouts(params: list[ParamSpec], device: torch.device) -> dict[str, SlotLayout]:
    """The parameters a cache on ``device`` holds in another layout: on CUDA, each int4
    matrix (uint8 ``[n, k / 2]`` ``NAME_qweight``) whose kernel takes its scales' dtype
    and width, in that kernel's layout; elsewhere none."""
    if device.type != "cuda":
        return {}
    dtypes = {p.name: p.dtype for p in params}
    out = {}
    for p in params:
        stem = p.name.removesuffix("_qweight")
        scale = dtypes.get(f"{stem}_qscale")
        if (stem != p.name and p.dtype == torch.uint8 and len(p.shape) == 2
                and scale is not None and int4_kernel_takes(2 * p.shape[1], scale)):
            out[p.name] = SlotLayout(cuda_int4_shape(p.shape[0], 2 * p.shape[1]), torch.int32,
                                     _to_cuda_int4)
    return out


def _to_cuda_int4(stored: torch.Tensor) -> torch.Tensor:
    """A stored int4 matrix, on its CUDA device, in the kernel's layout there."""
    return to_cuda_int4(stored, device=stored.device)
