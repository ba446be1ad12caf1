"""The resident (non-expert) linears in a quantized format: attention, shared experts, lm_head.

Why: once the routed experts are quantized, what a decode step reads most is resident: at
Qwen1.5-MoE's vocabulary lm_head alone is 151936 x 2048 (622 MB in bf16, read every token),
and a shared expert is as large as four routed ones. ``stmoe generate --quantize-resident
int8|int4`` (``offload(quantize_resident=...)``) replaces each ``torch.nn.Linear`` outside
the routed experts with a ``QuantizedLinear`` computing through the same kernels
(``kernels.qlinear``). Left native, and listed: routers and gates (``*.gate``,
``*_gate``, ``*router*``: they choose the experts, and are tiny), and any matrix the
kernel cannot take (int4: out a multiple of 16, in a multiple of 32). Embeddings are not
linears and stay native. int4 takes, per matrix, the largest of 128, 64, 32 dividing its
input width (or the size given).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stmoe.errors import OffloadError
from stmoe.quant.cuda_kernels import device_weight
from stmoe.quant.formats import WeightFormat
from stmoe.quant.kernels import check_quantizable, qlinear, quantize_matrix


class QuantizedLinear(torch.nn.Module):
    """``torch.nn.Linear``'s forward with its weight stored in ``fmt`` (bias kept)."""

    def __init__(self, linear: torch.nn.Linear, fmt: WeightFormat, name: str) -> None:
        super().__init__()
        q = quantize_matrix(linear.weight.detach(), fmt, name)
        self.fmt, self.in_features, self.out_features = fmt, linear.in_features, linear.out_features
        self.qweight = torch.nn.Parameter(q.qweight, requires_grad=False)
        self.qscale = torch.nn.Parameter(q.qscale, requires_grad=False)
        self.bias = linear.bias
        # set by the step batcher: the call waits for the step's other requests' rows
        # (runtime/batcher/step_rows.py); None: computed here
        self.gather: Callable[[QuantizedLinear, torch.Tensor], torch.Tensor] | None = None
        self._columns: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather is not None:
            return self.gather(self, x)
        return self.rows(x)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The product itself, for any number of rows (each row's bits the same whatever
        the count: kernels.qlinear)."""
        flat = x.reshape(-1, x.shape[-1])
        y = qlinear(flat, self.qweight, self.qscale, self.fmt).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def to_device_layout(self) -> None:
        """Where it computes fastest from (``cuda_kernels.device_weight``: on CUDA, int4 in
        the CUDA kernel's layout, converted once here instead of at every call); the same
        bits either way."""
        weight = device_weight(self.qweight, self.qscale, self.fmt, self.qweight.device)
        if weight is not self.qweight:
            self.qweight = torch.nn.Parameter(weight, requires_grad=False)
            self._columns.clear()

    def columns(self, flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Output features ``start:stop`` of ``flat`` [M, in] (bias not added): the same
        bits as those columns of the whole product (each column is its own dot products),
        so a product can be split over threads (int4: ``start`` a multiple of 64). The
        slice's scales are kept (int4's are strided: a copy, ``in / group x (stop - start)
        x 2`` values)."""
        if (start, stop) not in self._columns:
            if self.qweight.dim() != 2:
                raise OffloadError("columns of a matrix in CUDA's int4 layout: split the "
                                   "product on the CPU's")
            if self.fmt.name == "int4" and start % 64:
                raise OffloadError(f"int4 columns start at a multiple of 64 (the kernel's "
                                   f"packing), not {start}")
            scale = self.qscale[start:stop] if self.fmt.name == "int8" else \
                self.qscale[:, start:stop].contiguous()
            self._columns[(start, stop)] = (self.qweight[start:stop], scale)
        weight, scale = self._columns[(start, stop)]
        return qlinear(flat, weight, scale, self.fmt).to(flat.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt.label}"


def device_linears(model: torch.nn.Module) -> int:
    """Every ``QuantizedLinear`` of ``model`` (moved to its device) in the layout its
    device computes fastest from; how many changed layout."""
    changed = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            before = m.qweight
            m.to_device_layout()
            changed += m.qweight is not before
    return changed


def is_gate(name: str) -> bool:
    """A router or gate: chooses experts (or weighs a shared one), so it stays native."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "gate" or leaf.endswith("_gate") or "router" in name


def quantize_linears(model: torch.nn.Module, fmt: WeightFormat) -> list[str]:
    """Replace every non-gate ``Linear`` of ``model`` (the routed experts are not linears)
    with a ``QuantizedLinear`` in ``fmt``; returns the names left native, with why."""
    if not fmt.quantized:
        return []
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise OffloadError("the model's resident linears are already quantized")
    kept: list[str] = []
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for name, linear in targets:
        if is_gate(name):
            kept.append(f"{name} (a gate)")
            continue
        if linear.weight.is_meta:
            raise OffloadError(f"{name}: its weight is not loaded; quantize a loaded model")
        one = fmt.resolved([linear.in_features])
        try:
            check_quantizable((linear.out_features, linear.in_features), one, name)
        except OffloadError:
            kept.append(f"{name} ({linear.out_features} x {linear.in_features}: not {fmt.name})")
            continue
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, QuantizedLinear(linear, one, name))
    return kept
