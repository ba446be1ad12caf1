"""A model folder's experts read straight from its safetensors shards, one expert at a time.

``stmoe pack MODEL_DIR`` must not need the whole model in memory (issue 19: an
8-layer checkpoint of Qwen3.6-35B-A3B's shape holds 12 GiB of experts). The
model is built on ``meta`` (shapes and dtypes, no bytes) to learn what a block
holds: each MoE layer's experts module (``hf.layout``) and its per-expert
parameters (``hf.layout.expert_params``), exactly as packing a model in memory
sees them. Each checkpoint key is mapped to those parameters by transformers' own
loading rules (``hf.loading.conversions``), so both layouts on disk are read:

- fused, as transformers 5 saves and ``stmoe make-model`` writes:
  ``mlp.experts.gate_up_proj`` [N, 2I, H]; expert e is the slice [e];
- per expert, as the hub's Qwen-MoE, OLMoE and Mixtral checkpoints (and the
  shipped model) are: ``mlp.experts.{e}.gate_proj.weight``, ``...up_proj...``;
  expert e's slice is built by transformers' own converter operations
  (stack, then concatenate) run on expert e's tensors alone.

Anything else (an unknown tensor under an experts module, an operation that
mixes experts, a dtype transformers would cast, a missing expert) raises
``StreamUnsupported`` naming the tensor, before a byte is written; the caller
then loads the model as before. The bytes of every block equal the in-memory
packer's, so a store is the same whichever way it was packed.

Tensors are read through safetensors' lazy ``safe_open`` (a memory map). The
pages a map has touched count as the process's memory until it is closed, so
the open files are closed again after every ``RELEASE_BYTES`` read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stmoe.hf.layout import expert_params, experts_modules
from stmoe.hf.loading import checkpoint_files, conversions, meta_model
from stmoe.runtime.store.check import architecture, check_unchanged
from stmoe.runtime.store.index import StoreError
from stmoe.util.fileio import check_input_file

RELEASE_BYTES = 256 << 20  # close the memory maps after this many bytes read


class StreamUnsupported(StoreError):
    """This checkpoint's experts cannot be read one by one; pack from the loaded model."""


@dataclass
class _Param:
    """Where one per-expert parameter of one MoE layer comes from in the checkpoint."""

    name: str  # the experts module's parameter, e.g. "gate_up_proj"
    full: str  # the model's parameter name, e.g. "model.layers.0.mlp.experts.gate_up_proj"
    dtype: torch.dtype
    shape: tuple[int, ...]  # one expert's slice
    fused: tuple[Path, str] | None = None  # a checkpoint tensor [N, ...] holding every expert
    converter: Any = None  # transformers' WeightConverter building it from per-expert tensors
    # converter source pattern -> expert -> (file, key)
    pieces: dict[str, dict[int, tuple[Path, str]]] = field(default_factory=dict)


class CheckpointExperts:
    """Every (layer, expert)'s tensors of a model folder, read on demand from its shards.

    Construction maps and checks everything (no expert byte read except expert 0 of
    each parameter, to check its shape and dtype); ``tensors`` reads one expert.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.path = Path(model_dir)
        self.files = checkpoint_files(self.path)
        if not self.files or any(f.suffix != ".safetensors" for f in self.files):
            raise StreamUnsupported(f"{self.path}: not a safetensors checkpoint")
        try:
            model = meta_model(self.path)
        except (OSError, ValueError, KeyError) as exc:  # loading the model says it clearly
            raise StreamUnsupported(f"{self.path}: no usable config.json ({exc})") from None
        modules = experts_modules(model)
        if not modules:
            raise StoreError(f"{type(model).__name__} has no routed-experts modules to pack")
        self.architecture = architecture(model)
        self.num_experts = int(self.architecture["num_experts"])
        self.layers: list[list[_Param]] = []
        self._by_name: dict[str, _Param] = {}
        for layer, (prefix, module) in enumerate(modules):
            params = expert_params(module, self.num_experts)
            if not params:
                raise StoreError(f"MoE layer {layer}: no per-expert parameters found")
            row = [_Param(n, f"{prefix}.{n}", p.dtype, tuple(p.shape[1:])) for n, p in params]
            self.layers.append(row)
            self._by_name.update((p.full, p) for p in row)
        self._prefixes = {f"{prefix}.": module for prefix, module in modules}
        # each layer's matrices stored [in, out] (GPT-OSS): a quantized pack transposes them
        self.transposed = [bool(getattr(m, "is_transposed", False)) for _, m in modules]
        self._handles: dict[Path, Any] = {}
        self._read = 0
        self.nbytes = self.num_experts * sum(param_nbytes(p) for row in self.layers
                                             for p in row)
        self._map(conversions(model))
        for row in self.layers:
            for p in row:
                self._check(p)
        self.release(force=True)

    def blocks(self, record: dict[str, Any]) -> Iterator[tuple[int, int, list[Any]]]:
        """Each (layer, expert, tensors) in store order, then a check that no checkpoint file
        changed while it was read (``record``: ``check.file_records`` taken before),
        raised before the store's index is switched: a store never mixes two checkpoints."""
        for layer in range(len(self.layers)):
            for expert in range(self.num_experts):
                yield layer, expert, self.tensors(layer, expert)
                self.release()
        check_unchanged(self.path, record, "packed", "pack the model again")

    def tensors(self, layer: int, expert: int) -> list[tuple[str, torch.Tensor]]:
        """Expert ``expert`` of MoE layer ``layer``: its parameters' slices, sorted by name."""
        out = [(p.name, self._slice(p, expert)) for p in self.layers[layer]]
        self._read += sum(t.numel() * t.element_size() for _, t in out)
        return out

    def release(self, force: bool = False) -> None:
        """Close the memory maps once enough was read through them (see the module docstring).
        Call it between blocks, when no tensor ``tensors`` returned is alive."""
        if force or self._read >= RELEASE_BYTES:
            for handle in self._handles.values():
                handle.__exit__(None, None, None)
            self._handles.clear()
            self._read = 0

    def _open(self, path: Path) -> Any:
        from safetensors import SafetensorError, safe_open

        if path not in self._handles:
            check_input_file(path, "a checkpoint file")
            try:  # safetensors checks the header, and that its offsets fit in the file
                handle = safe_open(str(path), framework="pt")
            except SafetensorError as exc:
                raise StoreError(f"{path}: not a readable safetensors file ({exc})") from None
            self._handles[path] = handle.__enter__()
        return self._handles[path]

    def _map(self, rules: tuple[list[Any], list[Any]] | None) -> None:
        """Find each parameter's checkpoint tensors by transformers' own renaming rules."""
        renamings, converters = rules if rules is not None else ([], [])
        for f in self.files:
            for key in self._open(f).keys():  # noqa: SIM118 (safe_open is not a dict)
                renamed = key
                for r in renamings:  # every renaming in turn (transformers' own order; 5.17,
                    renamed, _ = r.rename_source_key(renamed)  # the GPU's, names no helper)
                name, pattern, converter = renamed, None, None
                for c in converters:  # at most one converter applies (transformers' rule)
                    name, pattern = c.rename_source_key(renamed)
                    if pattern is not None:
                        converter = c
                        break
                prefix = next((p for p in self._prefixes if name.startswith(p)), None)
                if prefix is not None:
                    self._assign(f, key, renamed, name, prefix, converter, pattern)
        for p in self._by_name.values():
            if p.fused is None and p.converter is None:
                raise StreamUnsupported(f"{self.path}: no checkpoint tensor holds {p.full}")

    def _assign(self, f: Path, key: str, renamed: str, name: str, prefix: str,
                converter: Any, pattern: str | None) -> None:
        """Record checkpoint tensor ``key`` as (part of) the model's parameter ``name``."""
        p = self._by_name.get(name)
        if p is None:
            module = self._prefixes[prefix]
            if name[len(prefix) :] in dict(module.named_parameters(recurse=False)):
                return  # a parameter of the experts module that is not per expert: not packed
            raise StreamUnsupported(f"{f}: tensor {key} is not a per-expert parameter of "
                                    f"{prefix.rstrip('.')}")
        if converter is None:
            if p.fused is not None or p.converter is not None:
                raise StreamUnsupported(f"{f}: tensor {key}: {p.full} is held twice")
            shape = tuple(self._open(f).get_slice(key).get_shape())
            if shape != (self.num_experts, *p.shape):
                raise StreamUnsupported(f"{f}: tensor {key} has shape {list(shape)}, "
                                        f"{p.full} is {[self.num_experts, *p.shape]}")
            p.fused = (f, key)
            return
        head = renamed[len(prefix) :].split(".", 1)[0]
        if not head.isdigit() or int(head) >= self.num_experts or p.fused is not None:
            raise StreamUnsupported(f"{f}: tensor {key}: expected one of {p.full}'s "
                                    f"{self.num_experts} experts")
        if p.converter is not None and p.converter is not converter:
            raise StreamUnsupported(f"{f}: tensor {key}: {p.full} is built two ways")
        p.converter = converter
        experts = p.pieces.setdefault(pattern, {})
        if int(head) in experts:
            raise StreamUnsupported(f"{f}: tensor {key}: expert {head} of {p.full} twice")
        experts[int(head)] = (f, key)

    def _check(self, p: _Param) -> None:
        """Every piece present, operations that keep experts apart, expert 0 as the model's."""
        if p.converter is not None:
            from transformers.core_model_loading import Concatenate, MergeModulelist

            ops = list(p.converter.operations)
            first, rest = (ops[0], ops[1:]) if ops else (None, [])
            joins = all(type(op) is Concatenate and op.dim >= 1 for op in rest)
            per_expert = type(first) is MergeModulelist and first.dim == 0 and joins
            if not per_expert:
                raise StreamUnsupported(f"{self.path}: {p.full} is built by {ops}, which "
                                        "stmoe cannot apply one expert at a time")
            for pattern in p.converter.source_patterns:
                got = p.pieces.get(pattern, {})
                if len(got) != self.num_experts:
                    raise StreamUnsupported(f"{self.path}: {p.full} needs {self.num_experts} "
                                            f"tensors {pattern!r}, the checkpoint has "
                                            f"{len(got)}")
                self._check_headers(p, got)
        t = self._slice(p, 0)
        if t.dtype != p.dtype or tuple(t.shape) != p.shape:
            where = p.fused[1] if p.fused else p.full
            raise StreamUnsupported(f"{self.path}: {where}: one expert is {t.dtype} "
                                    f"{list(t.shape)}, the model's {p.full} is {p.dtype} "
                                    f"{list(p.shape)} (transformers would convert it)")

    def _check_headers(self, p: _Param, pieces: dict[int, tuple[Path, str]]) -> None:
        """Every expert's tensor of one pattern with expert 0's dtype and shape, by the
        headers (``_check`` reads expert 0's alone): a header lying about another expert's
        would have its bytes packed, or read in place, as other values than transformers
        loads (a dtype it casts: loaded instead; a shape it cannot load: refused)."""
        first = self._open(pieces[0][0]).get_slice(pieces[0][1])
        want = (first.get_dtype(), first.get_shape())
        for _, (f, key) in sorted(pieces.items()):
            s = self._open(f).get_slice(key)
            dtype, shape = s.get_dtype(), s.get_shape()
            if shape != want[1]:
                raise StoreError(f"{f}: tensor {key} has shape {list(shape)}, expert 0's "
                                 f"{pieces[0][1]} {list(want[1])}: the checkpoint is damaged "
                                 f"({p.full} stacks them)")
            if dtype != want[0]:
                raise StreamUnsupported(f"{f}: tensor {key} is {dtype}, expert 0's "
                                        f"{pieces[0][1]} {want[0]} (transformers would "
                                        "convert it)")

    def _slice(self, p: _Param, expert: int) -> torch.Tensor:
        if p.fused is not None:
            f, key = p.fused
            return self._open(f).get_slice(key)[expert]
        inputs = {}
        for pattern in p.converter.source_patterns:
            f, key = p.pieces[pattern][expert]
            inputs[pattern] = [self._open(f).get_tensor(key)]
        for op in p.converter.operations:  # transformers' own, on this expert alone
            inputs = op.convert(inputs, source_patterns=p.converter.source_patterns,
                                target_patterns=p.converter.target_patterns)
        if len(inputs) != 1:
            raise StreamUnsupported(f"{self.path}: {p.full}: the converter made {len(inputs)} "
                                    "tensors, expected one")
        return next(iter(inputs.values()))[0]


def param_nbytes(p: _Param) -> int:
    """One expert's bytes of parameter ``p``."""
    count = 1
    for n in p.shape:
        count *= n
    return count * p.dtype.itemsize
