"""Experts read in place from the checkpoint's safetensors inside vLLM (``experts=in-place``).

Why: a store, packed or streamed, is a second copy of the experts on disk (28.6 GB for
Qwen1.5-MoE-A2.7B's), and a checkpoint bigger than RAM is big on disk too. In place, no
store is written: stmoe's in-place index (``runtime.store.in_place_index``: where each
expert's bytes lie in the shards, with each expert's CRC-32C, made once) is read by its
disk tier, and vLLM never loads the experts (as with ``experts=stream``). The checkpoint's
layout is not the kernel's: vLLM's CPU kernel reads its weights prepacked. So each expert
is converted as it lands in its slot (``SlotLayout``: ``cpu_prepack_moe_weight`` on the
one expert, what vLLM's processing does to each row of a layer), and before serving the
conversion of expert 0 is checked against vLLM's own processing of that expert, bit for
bit (``streamed.kernel_layout``); a layout that processing would pad or reshape, or a
dtype vLLM casts to, is refused in one line (pack a store instead: ``experts=stream``).
A miss costs its read plus the conversion (docs/vllm.md gives the figure).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from stmoe.runtime.cache import param_specs
from stmoe.runtime.slot_layout import SlotLayout
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.in_place_index import make_in_place
from stmoe.runtime.store.tiers import Tier, aligned_buffer, buffer_bytes
from stmoe.vllm_plugin.config import PluginConfigError
from stmoe.vllm_plugin.layers import WEIGHTS, MoeLayer
from stmoe.vllm_plugin.streamed import TO_VLLM, kernel_layout


def open_or_index(path: Path, layers: list[MoeLayer], model_dir: Path) -> tuple[ExpertStore, bool]:
    """The in-place index of ``model_dir`` at ``path``, made there first when it has none
    (every expert read once for its checksum); (store, made now). It must be an in-place
    index of these very files, for a model of the layers vLLM built."""
    made = not (path / "index.json").exists()
    if made:
        make_in_place(model_dir, path)
    store = ExpertStore(path)
    if not store.in_place:
        raise PluginConfigError(f"stmoe: {path} is a packed store, not an in-place index; give "
                                "another store= for experts=in-place")
    store.check_source(model_dir)  # its files, and every extent derived again
    n = int(layers[0].module.global_num_experts)
    if (int(store.model["moe_layers"]), int(store.model["num_experts"])) != (len(layers), n):
        raise PluginConfigError(f"stmoe: {path} indexes {store.model['moe_layers']} MoE layers "
                                f"of {store.model['num_experts']} experts, vLLM's model has "
                                f"{len(layers)} of {n}")
    return store, made


def slot_layouts(layers: list[MoeLayer], store: ExpertStore,
                 tier: Tier) -> tuple[dict[str, SlotLayout], tuple[str, str]]:
    """What the slots hold in the kernel's layout, each converted as it lands, and the
    store's names of vLLM's (w13, w2); checked on expert (0, 0) against vLLM's own
    processing, bit for bit."""
    module = layers[0].module
    fused = module.quant_method.moe_kernel.fused_experts
    dtype = module.w13_weight.dtype
    specs = param_specs(store.blocks[(0, 0)])
    to_store = {TO_VLLM.get(p.name): p.name for p in specs}
    if set(to_store) != set(WEIGHTS):
        raise PluginConfigError(f"stmoe: {store.path}'s experts hold {[p.name for p in specs]}; "
                                "experts=in-place reads gate_up_proj and down_proj")
    for p in specs:
        if p.dtype != dtype:
            raise PluginConfigError(f"stmoe: the checkpoint's experts are "
                                    f"{str(p.dtype).removeprefix('torch.')} and vLLM runs "
                                    f"{str(dtype).removeprefix('torch.')}: experts=in-place "
                                    "reads them as they are (give vLLM the checkpoint's dtype, "
                                    "or use experts=stream)")
    convert = _prepack(getattr(fused, "isa", "vec"))
    raw = _read(tier, store, (0, 0))
    want = dict(kernel_layout(module, {w: raw[to_store[w]] for w in WEIGHTS}))
    for w in WEIGHTS:
        got = convert(raw[to_store[w]])
        if got.shape != want[w].shape or got.dtype != want[w].dtype or not torch.equal(
                got.view(torch.uint8), want[w].contiguous().view(torch.uint8)):
            raise PluginConfigError(f"stmoe: vLLM's processing of {w} is not a prepack of the "
                                    "checkpoint's tensor as it lies (padded or reshaped): "
                                    "experts=in-place cannot serve it bit for bit; use "
                                    "experts=stream")
    layouts = {to_store[w]: SlotLayout(tuple(raw[to_store[w]].shape), dtype, convert)
               for w in WEIGHTS}
    return layouts, (to_store[WEIGHTS[0]], to_store[WEIGHTS[1]])


def _prepack(isa: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """One expert's matrix as vLLM's CPU kernel reads it (its prepack, that expert alone)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    return lambda t: cpu_prepack_moe_weight(t.unsqueeze(0), isa)[0]


def _read(tier: Tier, store: ExpertStore, key: tuple[int, int]) -> dict[str, torch.Tensor]:
    """One expert's tensors as the checkpoint holds them, read and checked by the tier."""
    block = store.blocks[key]
    buf = aligned_buffer(buffer_bytes(block))
    raw = tier.fetch(block, buf).clone()
    out = {}
    for p in param_specs(block):
        out[p.name] = raw[p.offset: p.offset + p.nbytes].view(p.dtype).view(p.shape)
    return out
