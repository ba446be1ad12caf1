"""Experts vLLM never loads: a model bigger than the memory vLLM is given (``experts=stream``).

Why: by default vLLM reads every weight into memory and processes it before the plugin
can take the experts over, so a model whose experts do not fit cannot start. Streamed,
the checkpoint's routed-expert tensors never reach vLLM's loader (``skip_experts``: its
weight iterator filtered; the routed-experts parameters counted as loaded, since the
store holds them), each layer's expert tensors, allocated but never written (untouched
pages cost no memory), are replaced by one zero expert before vLLM processes them (its
kernel set up as ever), and the store is packed from the checkpoint one expert at a time
(``runtime.store.pack_stream``), each expert put in the kernel's layout by vLLM's own
processing (``kernel_layout``) applied to that expert alone: the same bytes as one row
of the whole layer's processed tensors (tested against the loaded path, bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from stmoe.runtime.store.check import check_source, file_records
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.folder import check_disk
from stmoe.runtime.store.pack_stream import CheckpointExperts
from stmoe.runtime.store.packing import write_store
from stmoe.vllm_plugin.config import PluginConfigError
from stmoe.vllm_plugin.kernel_store import open_checked
from stmoe.vllm_plugin.layers import WEIGHTS, MoeLayer

EXPERTS_KEY = ".experts."  # a routed expert's tensor in the checkpoint (not shared_expert)
# transformers' per-expert parameter (pack_stream) -> vLLM's: gate then up, as vLLM's w13
TO_VLLM = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


Replacement = tuple[type, str, Callable[..., Any]]  # (class, method's name, the new method)


def skip_experts() -> list[Replacement]:
    """The methods that make vLLM's default loader leave the routed experts to the plugin
    (see the docstring), for ``install`` to put in place."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    get_all, track = DefaultModelLoader.get_all_weights, DefaultModelLoader.track_weights_loading
    process = UnquantizedFusedMoEMethod.process_weights_after_loading

    def get_all_weights(self: Any, model_config: Any, model: Any) -> Iterator[Any]:
        for name, tensor in get_all(self, model_config, model):
            if EXPERTS_KEY not in name:
                yield name, tensor

    def track_weights_loading(self: Any, model: Any, loaded: set[str] | None) -> None:
        held = {f"{prefix}.{w}" for prefix, m in model.named_modules()
                if isinstance(m, RoutedExperts) for w in WEIGHTS}
        track(self, model, None if loaded is None else set(loaded) | held)

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        for w in WEIGHTS:  # one zero expert in place of E never written
            p = getattr(layer, w)
            layer._parameters[w] = torch.nn.Parameter(
                torch.zeros((1, *p.shape[1:]), dtype=p.dtype), requires_grad=False)
        layer._stmoe_streamed = True
        process(self, layer)

    return [(DefaultModelLoader, "get_all_weights", get_all_weights),
            (DefaultModelLoader, "track_weights_loading", track_weights_loading),
            (UnquantizedFusedMoEMethod, "process_weights_after_loading",
             process_weights_after_loading)]


class _Holder(torch.nn.Module):
    """One expert's weights as a layer for vLLM's processing; all else read from the layer."""

    def __init__(self, layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.__dict__["_layer"] = layer
        for name, t in tensors.items():
            self._parameters[name] = torch.nn.Parameter(t.unsqueeze(0), requires_grad=False)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"], name)


def kernel_layout(layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[
        tuple[str, torch.Tensor]]:
    """One expert's (vLLM-named) tensors as vLLM's CPU kernel reads them: its own
    processing (padding, prepacking) applied to that expert alone."""
    holder = _Holder(layer, tensors)
    layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(holder)
    return [(w, getattr(holder, w).data[0]) for w in WEIGHTS]


def streamed_blocks(model_dir: Path, layers: list[MoeLayer], dtype: torch.dtype,
                    record: dict[str, object]) -> Iterator[tuple[int, int, list[Any]]]:
    """Every (layer, expert)'s kernel-layout tensors, read one expert at a time."""
    source = CheckpointExperts(model_dir)
    n = int(layers[0].module.global_num_experts)
    if len(source.layers) != len(layers) or source.num_experts != n:
        raise PluginConfigError(f"stmoe: {model_dir}'s checkpoint has {len(source.layers)} MoE "
                                f"layers of {source.num_experts} experts, vLLM's model "
                                f"{len(layers)} of {n}")
    for layer, expert, tensors in source.blocks(record):
        named = {}
        for name, t in tensors:
            if name not in TO_VLLM:
                raise PluginConfigError(f"stmoe: the experts' parameter {name!r} has no vLLM "
                                        "counterpart the plugin knows (gate_up_proj, down_proj)")
            named[TO_VLLM[name]] = t.to(dtype)
        yield layer, expert, kernel_layout(layers[layer].module, named)


def open_or_pack_streamed(path: Path, layers: list[MoeLayer], model_record: dict[str, object],
                          model_dir: Path) -> tuple[ExpertStore, bool]:
    """The store at ``path``, packed there from the checkpoint first when it has none (refused
    first, in one line, where its disk cannot hold it); an existing one must be this
    model's in this layout, packed from these very files."""
    packed = not (path / "index.json").exists()
    if packed:  # (each layer holds one processed expert: its rows' size is every block's)
        check_disk(path, int(model_record["num_experts"]) * sum(
            getattr(layer.module, w).data[0].nbytes for layer in layers for w in WEIGHTS),
            "store=")
        dtype = layers[0].module.w13_weight.dtype
        record = file_records(model_dir)
        write_store(path, model_record, record, streamed_blocks(model_dir, layers, dtype,
                                                                record))
    store = open_checked(path, model_record)
    check_source(store.path, store.index, model_dir)
    return store, packed
