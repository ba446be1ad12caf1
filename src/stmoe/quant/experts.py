"""A transformers experts module in a quantized format: its weights, and its forward.

Every MoE family stmoe runs keeps its routed experts as ``gate_up_proj`` (or ``up_proj``)
and ``down_proj``, ``[N, out, in]`` (``[N, in, out]`` where the module says
``is_transposed``, as GPT-OSS does), with optional per-expert biases. In a quantized format
each such matrix becomes two per-expert parameters, ``NAME_qweight`` and ``NAME_qscale``
(``kernels``), always ``[out, in]``; biases stay as they are. Being parameters whose first
axis is the experts, they are what a store's block holds and what offloading releases,
exactly as the native weights are.

``quantized_experts_forward`` is registered in transformers' ``ExpertsInterface`` as
``stmoe_quantized``. It computes each expert's tokens with the kernels and sums each
token's top-k outputs in routing order, as ``batched_mm`` does: the result does not
depend on how experts are numbered (each expert's group of rows is the same whatever its
number), so the offload engine may compute on its cache's slots in place and give the
same bits as the resident model quantized in memory (``quantize_model``) - the reference
of the lossless contract in a quantized format.
"""

from __future__ import annotations

from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.hf.layout import expert_params
from stmoe.quant.formats import NATIVE, WeightFormat
from stmoe.quant.kernels import check_quantizable, qlinear, quantize_matrix

IMPL_NAME = "stmoe_quantized"
MATRICES = ("down_proj", "gate_up_proj", "up_proj")  # what batched_mm multiplies by
FORMAT_ATTR = "_stmoe_format"


def format_of(module: Any) -> WeightFormat:
    """The format an experts module (or a model: its first experts module) holds."""
    return getattr(module, FORMAT_ATTR, NATIVE)


def input_widths(layers: list[tuple[list[tuple[str, tuple[int, ...]]], bool]]) -> list[int]:
    """Every expert matrix's input width, from each layer's (per-expert (name, shape) list,
    transposed): what int4's group size must divide (``WeightFormat.resolved``)."""
    return [shape[0] if transposed else shape[1]
            for params, transposed in layers for name, shape in params if name in MATRICES]


def resolved_for(modules: list[torch.nn.Module], fmt: WeightFormat) -> WeightFormat:
    """``fmt`` with int4's group size chosen for these experts modules' matrices."""
    layers = [([(n, tuple(p.shape[1:])) for n, p in expert_params(m, int(m.num_experts))],
               bool(getattr(m, "is_transposed", False))) for m in modules]
    return fmt.resolved(input_widths(layers))


def quantize_expert(tensors: list[tuple[str, torch.Tensor]], fmt: WeightFormat,
                    transposed: bool, where: str = "") -> list[tuple[str, torch.Tensor]]:
    """One expert's native tensors (sorted by name, as a block holds them) in ``fmt``,
    sorted by name. ``transposed``: the module stores matrices ``[in, out]``."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors:
        if name in MATRICES:
            w = t.t() if transposed else t
            q = quantize_matrix(w, fmt, f"{where}{name}")
            out += [(f"{name}_qweight", q.qweight), (f"{name}_qscale", q.qscale)]
        elif t.dim() == 1:  # a bias: kept in the model's dtype
            out.append((name, t))
        else:
            raise OffloadError(f"{where}{name}: an expert tensor {tuple(t.shape)} that is not "
                               f"one of {', '.join(MATRICES)} or a bias; this family cannot be "
                               "quantized, use --format native")
    return sorted(out, key=lambda item: item[0])


def quantized_meta(name: str, p: torch.Tensor, fmt: WeightFormat, transposed: bool,
                   where: str = "") -> list[tuple[str, torch.Tensor]]:
    """What ``quantize_expert`` makes of per-expert parameter ``p`` ([N, ...]), as storage-
    free meta tensors [N, ...]: the shapes a quantized store's blocks must hold."""
    n = p.shape[0]
    if name not in MATRICES:
        if p.dim() != 2:
            raise OffloadError(f"{where}{name}: an expert tensor {tuple(p.shape[1:])} that is "
                               "not a matrix or a bias; use --format native")
        return [(name, torch.empty(p.shape, dtype=p.dtype, device="meta"))]
    rows, cols = (p.shape[2], p.shape[1]) if transposed else (p.shape[1], p.shape[2])
    check_quantizable((rows, cols), fmt, f"{where}{name}")
    if fmt.name == "int8":
        shapes = [((n, rows, cols), torch.int8), ((n, rows), p.dtype)]
    else:
        assert fmt.group_size is not None
        shapes = [((n, rows, cols // 2), torch.uint8),
                  ((n, cols // fmt.group_size, rows, 2), p.dtype)]
    (wshape, wdtype), (sshape, sdtype) = shapes
    return [(f"{name}_qweight", torch.empty(wshape, dtype=wdtype, device="meta")),
            (f"{name}_qscale", torch.empty(sshape, dtype=sdtype, device="meta"))]


def quantized_params(module: torch.nn.Module, fmt: WeightFormat, num_experts: int,
                     where: str = "") -> list[tuple[str, torch.Tensor]]:
    """A native experts module's per-expert parameters in ``fmt``, sorted by name, made but
    not installed (meta where the module's are on meta: the layout, no bytes)."""
    if format_of(module).quantized:
        raise OffloadError(f"{where}already quantized ({format_of(module).label})")
    if getattr(module, "_is_expert_parallel", False):
        raise OffloadError(f"{where}expert-parallel experts cannot be quantized here")
    transposed = bool(getattr(module, "is_transposed", False))
    params = expert_params(module, num_experts)
    if any(p.is_meta for _, p in params):
        return sorted((item for name, p in params
                       for item in quantized_meta(name, p, fmt, transposed, where)),
                      key=lambda item: item[0])
    # expert by expert, as a packer quantizes a block: the same bytes by construction
    rows = [quantize_expert([(n, p.detach()[e]) for n, p in params], fmt, transposed, where)
            for e in range(num_experts)]
    return [(name, torch.stack([row[i][1] for row in rows]))
            for i, (name, _) in enumerate(rows[0])]


def install(module: torch.nn.Module, params: list[tuple[str, torch.Tensor]], fmt: WeightFormat,
            num_experts: int) -> None:
    """Replace the module's native per-expert parameters with ``params`` (``fmt``'s)."""
    for name, _ in expert_params(module, num_experts):
        del module._parameters[name]
    for name, t in params:
        module._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    setattr(module, FORMAT_ATTR, fmt)


def register() -> None:
    """Make ``stmoe_quantized`` a valid ``config._experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, quantized_experts_forward)


def quantized_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """batched_mm's arithmetic with each expert's matrices through ``fmt``'s kernel: [T, H]."""
    fmt = format_of(self)
    if not fmt.quantized:
        raise OffloadError(f"{type(self).__name__} uses {IMPL_NAME!r} but holds native weights")
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    # group the (token, pick) pairs by expert, each group in pair order whatever its number
    order = torch.argsort(flat, stable=True)
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    x = hidden_states[order // k]
    up_name = "gate_up_proj" if self.has_gate else "up_proj"
    up_w, up_s = getattr(self, f"{up_name}_qweight"), getattr(self, f"{up_name}_qscale")
    down_w, down_s = self.down_proj_qweight, self.down_proj_qscale
    outs = []
    start = 0
    for e, c in zip(ids.tolist(), counts.tolist(), strict=True):
        h = qlinear(x[start:start + c], up_w[e], up_s[e], fmt).to(hidden_states.dtype)
        if self.has_bias:
            h = h + getattr(self, f"{up_name}_bias")[e]
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        y = qlinear(h, down_w[e], down_s[e], fmt).to(hidden_states.dtype)
        if self.has_bias:
            y = y + self.down_proj_bias[e]
        outs.append(y)
        start += c
    grouped = torch.cat(outs) if len(outs) > 1 else outs[0]
    out = torch.empty_like(grouped)
    out[order] = grouped
    if getattr(self, "has_post_expert_norm", False):  # (transformers 5.17 has no such flag)
        out = self.post_expert_norm(out)
    weighted = out * top_k_weights.reshape(-1, 1)  # promoted as batched_mm's is
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def quantize_model(model: torch.nn.Module, fmt: WeightFormat) -> torch.nn.Module:
    """Quantize every routed-experts module of ``model`` in place (the resident model in
    ``fmt``) and select ``stmoe_quantized``; returns ``model``."""
    from stmoe.hf.layout import experts_modules

    modules = [m for _, m in experts_modules(model)]
    if not modules:
        raise OffloadError(f"{type(model).__name__} has no routed-experts modules to quantize")
    fmt = resolved_for(modules, fmt)
    select(model, modules, plan_format(modules, fmt, fmt, "the model"), fmt)
    return model


def plan_format(modules: list[torch.nn.Module], weights: WeightFormat,
                wanted: WeightFormat | None, store: str) -> list[list[Any]] | None:
    """Each module's parameters in ``store``'s format ``weights``, made, not installed (so the
    store's checks run on them before the model changes; ``select`` installs them), or None
    when the modules already hold it. A store in another format than ``wanted``, a model in
    another quantized format, or a model without experts is refused."""
    if wanted is not None and not wanted.accepts(weights):
        raise OffloadError(f"{store}: holds {weights.label} experts, not {wanted.label}; "
                           f"pack one with `stmoe pack {wanted.pack_options}`")
    if not modules:
        raise OffloadError("the model has no routed-experts modules")
    held = format_of(modules[0])
    if held == weights:
        return None
    if held.quantized:
        raise OffloadError(f"{store}: holds {weights.label} experts, the model {held.label}; "
                           "pack this model's own store")
    impl = getattr(modules[0].config, "_experts_implementation", None)
    if impl not in (None, "eager", "grouped_mm", "batched_mm"):
        raise OffloadError(f"the model runs experts implementation {impl!r}; quantize a "
                           "freshly loaded model")
    return [quantized_params(m, weights, int(m.num_experts), f"MoE layer {layer}: ")
            for layer, m in enumerate(modules)]


def select(model: torch.nn.Module, modules: list[torch.nn.Module],
           planned: list[list[Any]] | None, fmt: WeightFormat) -> None:
    """Install ``plan_format``'s parameters and select ``stmoe_quantized`` for the model
    (nothing to do for None: the modules hold the format)."""
    if planned is None:
        return
    for module, params in zip(modules, planned, strict=True):
        install(module, params, fmt, int(module.num_experts))
    register()
    model.set_experts_implementation(IMPL_NAME)
