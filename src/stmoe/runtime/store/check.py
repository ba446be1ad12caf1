"""Does a store belong to this model? Its shapes, and its weights, checked before any token.

Two ways to know the weights are the model's own, both fast at real sizes:

- a model in memory (``stmoe.offload(model, ...)``): its expert tensors are still
  there, so each block's CRC32 is compared with the model's own bytes;
- a model folder: a store packed from that folder records each checkpoint file's
  name, size, mtime and SHA-256. Files whose size and mtime are unchanged are
  trusted; others are hashed again (a copied folder) and compared. A store packed
  from a model in memory cannot vouch for a folder's files and is refused there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stmoe.hf.layout import expert_params
from stmoe.hf.loading import checkpoint_files
from stmoe.runtime.store.index import StoreError, StoreIndex, block_crc
from stmoe.runtime.store.int4_store import Repack, int4_matrix
from stmoe.util.fileio import check_input_file

HASH_CHUNK = 1 << 24  # bytes read at a time when hashing a checkpoint file
PROGRESS_BYTES = 1 << 30  # show a progress bar when hashing more than this


def architecture(model: Any, layout: Any = None) -> dict[str, Any]:
    """What a store's shape must agree with to serve ``model`` (``layout``: its
    ``ModelLayout``, found here when not given)."""
    from stmoe.hf.layout import ModelLayout

    modules = (layout or ModelLayout.of(model)).modules
    c = model.config
    return {
        "model_type": getattr(c, "model_type", ""),
        "hidden_size": getattr(c, "hidden_size", 0),
        "moe_layers": len(modules),
        "num_experts": int(getattr(modules[0][1], "num_experts", 0)) if modules else 0,
    }


def check_layout(store: Path, index: StoreIndex, model: Any, layout: Any = None,
                 params: list[list[tuple[str, Any]]] | None = None) -> list[list[tuple[str, Any]]]:
    """Every block holds exactly its layer's per-expert parameters (name, dtype, shape;
    ``params`` where given, else the modules' own); returns each layer's parameters."""
    from stmoe.hf.layout import ModelLayout

    layout = layout or ModelLayout.of(model)
    want = architecture(model, layout)
    if want != index.model:
        raise StoreError(f"{store}: packed for {index.model} but the model is {want}; name "
                         "the model it was packed for, or pack this one into a new folder "
                         "with `stmoe pack MODEL -o NEW_FOLDER`")
    experts = want["num_experts"]
    per_layer = []
    for layer, (_, module) in enumerate(layout.modules):
        mine = expert_params(module, experts) if params is None else params[layer]
        expect = [(n, str(p.dtype).removeprefix("torch."), tuple(p.shape[1:]))
                  for n, p in mine]
        got = [(t.name, t.dtype, t.shape) for t in index.blocks[(layer, 0)].tensors]
        if got != expect:  # the index checked every expert of a layer holds expert 0's layout
            raise StoreError(f"{store}/index.json: layer {layer} holds {got}, the model's "
                             f"experts are {expect}; name the model it was packed for, or "
                             "pack this one into a new folder with `stmoe pack`")
        per_layer.append(mine)
    return per_layer


def check_weights(store: Path, index: StoreIndex, per_layer: list[list[tuple[str, Any]]],
                  repack: Repack | None = None) -> None:
    """Every block's CRC-32C equals that of the model's own expert bytes (all in memory;
    ``repack``: an int4 store packed on another kind of CPU, compared in its layout)."""
    import torch

    for layer, params in enumerate(per_layer):
        for expert in range(index.model["num_experts"]):
            crc = 0
            slots = index.blocks[(layer, expert)].tensors  # ``check_layout``: the params'
            for (_, p), slot in zip(params, slots, strict=True):
                t = p.detach()[expert].to("cpu").contiguous()
                if repack is not None and int4_matrix(slot):
                    t = repack.to_stored(t)
                crc = block_crc(t.reshape(-1).view(torch.uint8).numpy(), crc)
            if crc != index.blocks[(layer, expert)].crc32c:
                raise StoreError(f"{store}: layer {layer}, expert {expert} holds other weights "
                                 "than the model's; the store was packed from another model, "
                                 "pack this one with `stmoe pack`")


def materialised(per_layer: list[list[tuple[str, Any]]]) -> bool:
    """Whether the model's expert tensors hold their bytes (not on ``meta``)."""
    return all(not p.is_meta for params in per_layer for _, p in params)


def file_records(model_dir: Path) -> dict[str, Any]:
    """The ``source`` a store packed from ``model_dir`` records: each checkpoint file's
    name, size, mtime_ns and SHA-256."""
    files = [check_input_file(f, "a checkpoint file") for f in checkpoint_files(model_dir)]
    if not files:
        raise StoreError(f"{model_dir}: no checkpoint files (*.safetensors or *.bin)")
    for f in files:  # a store records each file by its name in ``model_dir``
        if f.parent != Path(model_dir):
            raise StoreError(f"{model_dir / 'model.safetensors.index.json'}: shard "
                             f"{f.relative_to(model_dir) if f.is_relative_to(model_dir) else f}"
                             " is not in the model folder itself; stmoe reads shards beside "
                             "config.json only: move it there and fix the weight_map")
    stats = [f.stat() for f in files]
    hashes = _sha256(files, f"hashing {model_dir.name}'s checkpoint")
    rows = zip(files, stats, hashes, strict=True)
    return {"kind": "folder", "files": [[f.name, st.st_size, st.st_mtime_ns, h]
                                        for f, st, h in rows]}


def check_model_folder(model_dir: Path) -> None:
    """Refuse a checkpoint path that is no folder, saying which: missing, or a file."""
    if not model_dir.is_dir():
        raise StoreError(f"{model_dir}: no such folder; give a local transformers checkpoint "
                         "folder (config.json and *.safetensors or *.bin)"
                         if not model_dir.exists() else
                         f"{model_dir}: a file; give the checkpoint's folder (config.json "
                         "and *.safetensors or *.bin)")


def check_unchanged(model_dir: Path, record: dict[str, Any], doing: str, again: str) -> None:
    """Refuse a store made while a checkpoint file changed (``record``: ``file_records``
    taken before ``doing`` began): raised before its index is switched, so a store never
    mixes two checkpoints."""
    for name, size, mtime, _ in record["files"]:
        st = (model_dir / name).stat()
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise StoreError(f"{model_dir / name}: changed while it was being {doing}; "
                             f"{again}")


def check_source(store: Path, index: StoreIndex, model_dir: Path) -> None:
    """The store was packed from ``model_dir``'s checkpoint (see the module docstring)."""
    kind = (" --in-place" if index.in_place else f" --format {index.weights.name}"
            if index.weights.quantized else "")  # (the same kind of store, new)
    hint = (f"name the model it was packed from, or pack this one into a new folder: stmoe "
            f"pack {model_dir} -o NEW_FOLDER{kind} (packing into {store} replaces that store)")
    if index.source["kind"] != "folder":
        raise StoreError(f"{store}: packed from a model in memory, so it cannot vouch for "
                         f"{model_dir}'s weights; {hint}")
    recorded = {name: (size, mtime, sha) for name, size, mtime, sha in index.source["files"]}
    files = {f.name: f for f in checkpoint_files(model_dir)}
    if sorted(files) != sorted(recorded):
        raise StoreError(f"{store}: packed from checkpoint files {sorted(recorded)}, "
                         f"{model_dir} has {sorted(files)}; {hint}")
    rehash = []
    for name, path in files.items():
        st = check_input_file(path, "a checkpoint file").stat()
        size, mtime, _ = recorded[name]
        if st.st_size != size:
            raise StoreError(f"{store}: packed from other weights than {model_dir} "
                             f"({name} differs); {hint}")
        if st.st_mtime_ns != mtime:
            rehash.append(path)
    for path, sha in zip(rehash, _sha256(rehash, f"checking {model_dir.name}'s checkpoint"),
                         strict=True):
        if sha != recorded[path.name][2]:
            raise StoreError(f"{store}: packed from other weights than {model_dir} "
                             f"({path.name} differs); {hint}")


def _sha256(files: Iterable[Path], label: str) -> list[str]:
    """SHA-256 of each file, with a progress bar on stderr when there is much to read."""
    files = list(files)
    total = sum(f.stat().st_size for f in files)
    if total <= PROGRESS_BYTES:
        return [_hash_file(f, lambda n: None) for f in files]
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        return [_hash_file(f, lambda n: bar.advance(task, n)) for f in files]


def _hash_file(path: Path, advance: Any) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            advance(len(chunk))
    return h.hexdigest()
