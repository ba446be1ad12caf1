"""Packing a model's routed experts into an expert store, and the store a model folder
uses when none is given (packed on first use into a cache directory).

Packing is deterministic: the same model gives the same bytes. Packing again is atomic:
the new data file is written beside the old one under its own name (its content's
hash), then index.json, which names it, is replaced in one rename (the switch); the old
data file is removed afterwards, and whatever a killed pack left is removed by the next
one. A pack holds the folder's advisory lock (``.pack.lock``, ``fcntl.flock``) from its
first byte to its clean-up, so two packs into one folder run one after the other: the
second cannot remove the data file the first has published but not yet indexed. A
model folder is packed without loading its model, one expert at a time from its
safetensors shards (``pack_folder``, ``pack_stream``).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from stmoe.errors import StmoeError, StmoeNote
from stmoe.hf.layout import expert_params
from stmoe.quant.formats import NATIVE, WeightFormat
from stmoe.runtime.store.check import architecture, check_model_folder, file_records
from stmoe.runtime.store.expert_store import ExpertStore
from stmoe.runtime.store.folder import (
    DATA_TEMP,
    LOCK_NAME,
    check_disk,
    named_data,
    pack_lock,
    refuse_foreign_index,
    remove_unnamed,
)
from stmoe.runtime.store.index import (
    ALIGN,
    Block,
    StoreError,
    TensorSlot,
    block_crc,
    index_text,
)
from stmoe.runtime.store.int4_store import packing_layout
from stmoe.util.cache_dir import cache_dir
from stmoe.util.fileio import (
    atomic_write_text,
    naming_failures,
    publish,
    temp_beside,
)
from stmoe.util.warn import warn

# progress(total_bytes, label) -> a context giving advance(nbytes), as progress.byte_progress
ProgressFactory = Callable[[int, str], AbstractContextManager[Callable[[int], None]]]


def pack(model: Any, out_dir: str | Path, source: str | Path | None = None,
         weights: WeightFormat | None = None) -> Path:
    """Write ``model``'s routed experts (all in memory) as a store; returns its folder.

    ``source``: the model folder ``model`` was just loaded from, unchanged. Its
    checkpoint files are recorded so that offloading that folder with this store
    can tell its weights are the store's (without it, only the model in memory can).
    ``weights``: the store's format; a native model is quantized expert by expert, a
    model quantized in memory (``quant.experts.quantize_model``) is stored as it is
    (None: the model's own format). A folder packs without loading its model:
    ``pack_folder``.
    """
    from stmoe.hf.layout import experts_modules
    from stmoe.quant.experts import format_of, resolved_for

    modules = experts_modules(model)
    if not modules:
        raise StoreError(f"{type(model).__name__} has no routed-experts modules to pack")
    held = format_of(modules[0][1])
    if weights is None or (held.quantized and weights.accepts(held)):
        weights = held
    if held.quantized and weights != held:
        raise StoreError(f"the model holds {held.label} experts; it cannot be packed as "
                         f"{weights.label} (pack the original model)")
    num_experts = int(getattr(modules[0][1], "num_experts", 0))
    layers = [expert_params(module, num_experts) for _, module in modules]
    for layer, params in enumerate(layers):
        if not params:
            raise StoreError(f"MoE layer {layer}: no per-expert parameters found")
    record = file_records(Path(source)) if source is not None else {"kind": "module"}
    blocks = ((layer, expert, [(n, p.detach()[expert]) for n, p in params])
              for layer, params in enumerate(layers) for expert in range(num_experts))
    if weights != held:
        weights = resolved_for([m for _, m in modules], weights)
        transposed = [bool(getattr(m, "is_transposed", False)) for _, m in modules]
        blocks = quantized_blocks(blocks, weights, transposed)
    return _write_store(Path(out_dir), architecture(model), record, blocks, lambda n: None,
                        weights)


def quantized_blocks(blocks: Iterable[tuple[int, int, list[Any]]], weights: WeightFormat,
                     transposed: list[bool], advance: Callable[[int], None] = lambda n: None,
                     ) -> Iterator[tuple[int, int, list[Any]]]:
    """Each native block's tensors in ``weights`` (``quant.experts.quantize_expert``);
    ``advance`` told each block's native bytes (what a progress bar counts)."""
    from stmoe.quant.experts import quantize_expert

    for layer, expert, tensors in blocks:
        where = f"MoE layer {layer}: "
        quantized = quantize_expert(tensors, weights, transposed[layer], where)
        advance(sum(t.numel() * t.element_size() for _, t in tensors))
        del tensors
        yield layer, expert, quantized


def pack_folder(model_dir: str | Path, out_dir: str | Path,
                progress: ProgressFactory | None = None,
                weights: WeightFormat = NATIVE) -> Path:
    """Write a model folder's routed experts as a store, read one expert at a time from its
    safetensors shards (``pack_stream``), never the whole model in memory; the same bytes
    as ``pack`` of the loaded model. A checkpoint whose experts cannot be read one by one
    is loaded and packed whole, with a note saying why. ``progress(total_bytes, label)``:
    a context giving ``advance(nbytes)`` (default: a bar on stderr when on a terminal);
    ``weights``: the store's format (quantized expert by expert as they are read)."""
    from stmoe.runtime.store.pack_stream import CheckpointExperts, StreamUnsupported
    from stmoe.util.progress import byte_progress

    model_dir = Path(model_dir)
    check_model_folder(model_dir)
    refuse_quantized(model_dir)
    refuse_foreign_index(Path(out_dir))  # before any reading (pack_lock checks it again)
    try:
        experts = CheckpointExperts(model_dir)
    except StreamUnsupported as exc:
        from stmoe.hf.loading import load_causal_lm

        try:
            model = load_causal_lm(model_dir)
        except StmoeError as failed:  # (a checkpoint its config.json does not describe)
            raise StoreError(f"{exc}; nor does the whole model load: {failed}") from None
        warn(f"{exc}; packing from the whole model loaded in memory", StmoeNote)
        return pack(model, out_dir, source=model_dir, weights=weights)
    if weights.quantized:
        from stmoe.quant.experts import input_widths

        weights = weights.resolved(input_widths([([(p.name, p.shape) for p in row], t)
                                                 for row, t in zip(experts.layers,
                                                                   experts.transposed,
                                                                   strict=True)]))
    # the store: the native bytes, or about 1/2 (int8) and 1/4 (int4) of bf16 experts (their
    # scales and alignment besides: a margin); before the checkpoint is hashed
    check_disk(Path(out_dir), experts.nbytes * {"int8": 0.52, "int4": 0.27}.get(weights.name, 1))
    record = file_records(model_dir)
    try:
        label = f"packing {model_dir.name}" + (f" as {weights.short}" if weights.quantized
                                               else "")
        with (progress or byte_progress)(experts.nbytes, label) as advance:
            blocks = experts.blocks(record)
            if weights.quantized:  # the bar counts the checkpoint's bytes read
                blocks = quantized_blocks(blocks, weights, experts.transposed, advance)
                advance = lambda n: None  # noqa: E731
            return _write_store(Path(out_dir), experts.architecture, record, blocks, advance,
                                weights)
    finally:
        experts.release(force=True)


def write_store(out_dir: str | Path, model: dict[str, Any], record: dict[str, Any],
                blocks: Iterable[tuple[int, int, list[tuple[str, Any]]]],
                weights: WeightFormat = NATIVE) -> Path:
    """A store of ``blocks`` ((layer, expert, [(name, tensor)]) in order) already in their
    final layout, for ``model`` (what its index must agree with) packed from ``record``
    (the checkpoint's files): how a runtime that lays experts out its own way (the vLLM
    plugin: its kernel's layout) writes its store, with the packers' atomic ending."""
    return _write_store(Path(out_dir), model, record, blocks, lambda n: None, weights)


def _write_store(out: Path, model: dict[str, Any], record: dict[str, Any], blocks: Iterable[Any],
                 advance: Callable[[int], None], weights: WeightFormat) -> Path:
    """The data file, then index.json naming it (the switch), then the replaced data file
    removed: the one ending of both packers. An int4 index records this CPU's layout, which
    its bytes are in (``int4_store``). What an earlier pack left (a failed one's data file
    no index names; a killed one's temporary file: ``temp_beside``) goes first
    (``check_disk`` counted it free), and a data file whose index could not be written goes
    with its failure."""
    out.mkdir(parents=True, exist_ok=True)
    with pack_lock(out):
        remove_unnamed(out, named_data(out))
        data, size, written = _write_data(blocks, out, advance)
        text = index_text(model, record, data, size, written, weights, packing_layout(weights))
        try:
            atomic_write_text(out / "index.json", text)  # the switch: the new store is whole
        except Exception:  # (ENOSPC; a kill leaves it to the next pack, as it would anyway)
            remove_unnamed(out, named_data(out))  # (the new file, unless the old is the same)
            raise
        remove_unnamed(out, data)
    return out


def _write_data(blocks: Iterable[tuple[int, int, list[tuple[str, Any]]]], out: Path,
                advance: Callable[[int], None]) -> tuple[str, int, list[Block]]:
    """The blocks into a temporary file renamed to its content's name; (name, size, blocks)."""
    written: list[Block] = []
    offset, digest = 0, hashlib.sha256()
    with temp_beside(out / DATA_TEMP) as tmp:
        with naming_failures(out), open(tmp, "wb") as f:  # a full disk names the store
            for layer, expert, tensors in blocks:
                blob, slots = block_bytes(tensors)
                del tensors  # a streamed expert's memory map may be released now
                padded = blob + b"\0" * ((-len(blob)) % ALIGN)
                f.write(padded)
                digest.update(padded)
                written.append(Block(layer, expert, offset, len(blob), block_crc(blob), slots))
                offset += len(padded)
                advance(len(blob))
        name = f"experts-{digest.hexdigest()[:16]}.bin"
        publish(tmp, out / name)
    return name, offset, written


def block_bytes(tensors: list[tuple[str, Any]]) -> tuple[bytes, tuple[TensorSlot, ...]]:
    """One expert's tensors end to end, and where each sits in the block."""
    import torch

    payload, slots, inner = [], [], 0
    for name, t in tensors:
        arr = t.to("cpu").contiguous()
        data = arr.reshape(-1).view(torch.uint8).numpy().tobytes()
        slots.append(TensorSlot(name, str(arr.dtype).removeprefix("torch."), tuple(arr.shape),
                                inner))
        payload.append(data)
        inner += len(data)
    return b"".join(payload), tuple(slots)


def temporary_store_dir() -> Path:
    """A folder for the store of a loaded model, removed at the latest when the process exits
    (``close`` removes it first; a model never closed left a copy of its experts behind)."""
    path = Path(tempfile.mkdtemp(prefix="stmoe-store-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def default_store_dir(model_dir: Path, weights: WeightFormat | None = None,
                      in_place: bool = False) -> Path:
    """Where a model folder's store in ``weights`` (None: native) is packed on first use,
    or its in-place index made (``STMOE_CACHE`` overrides)."""
    root = cache_dir("stores")
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in [*sorted(model_dir.glob("*.safetensors")), model_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    suffix = f"-{weights.short}" if weights is not None and weights.quantized else ""
    suffix += "-in-place" if in_place else ""
    return root / f"{model_dir.name}-{h.hexdigest()[:16]}{suffix}"


def refuse_quantized(model_dir: Path) -> None:
    """A checkpoint quantized by another tool (config.json's ``quantization_config``: FP8
    with its scales, GPTQ, AWQ) is refused: its experts' bytes are not weights stmoe
    computes, and loading around them dropped the scales with no error."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # (the loader names a missing or damaged config)
    quantized = config.get("quantization_config") if isinstance(config, dict) else None
    if quantized is not None:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise StoreError(f"{model_dir / 'config.json'}: a checkpoint quantized by another tool "
                         f"({method}); stmoe offloads float checkpoints (bf16, fp16, fp32): give "
                         "the original weights (stmoe's own --format int8/int4 quantizes them; "
                         "a `stmoe quantize` folder is vLLM's: serve it there)")


def open_store(model_dir: str | Path, store: str | Path | None,
               progress: ProgressFactory | None = None,
               weights: WeightFormat | None = None, in_place: bool = False) -> ExpertStore:
    """The store for ``model_dir``, opened and matched to its checkpoint: the given one
    (refused when damaged or foreign, never overwritten), or the model's cached one,
    packed now (``pack_folder``, with ``progress``) when missing, and packed again, with
    a note, when damaged, of an older version or half-written (a killed pack).
    ``weights``: the format wanted (None: a given store's own, else native); a given
    store in another format is refused. ``in_place``: the cached one is an in-place
    index (``in_place.make_in_place``), made the same way."""
    model_dir = Path(model_dir)
    refuse_quantized(model_dir)
    if in_place and weights is not None and weights.quantized:
        raise StoreError(f"{weights.label} experts are not the checkpoint's bytes, so they "
                         f"cannot be read in place; pack them: stmoe pack {model_dir} -o DIR "
                         f"{weights.pack_options}")
    if store is not None:
        opened = ExpertStore(store)
        opened.check_source(model_dir)
        if weights is not None and not weights.accepts(opened.weights):
            raise StoreError(f"{opened.path}: holds {opened.weights.label} experts, not "
                             f"{weights.label}; pack one: stmoe pack {model_dir} -o DIR "
                             f"{weights.pack_options}")
        if in_place and not opened.in_place:
            raise StoreError(f"{opened.path}: a packed store, not an in-place index; leave "
                             f"out in-place, or make one: stmoe pack {model_dir} -o DIR "
                             "--in-place")
        return opened
    weights = weights or NATIVE
    out = default_store_dir(model_dir, weights, in_place)
    if (opened := _cached(out, model_dir, weights, in_place, say=False)) is not None:
        return opened  # (no lock: a cache packed beforehand may be read-only)
    out.mkdir(parents=True, exist_ok=True)
    # held from the check to the pack's end: a first use beside another process's waits for
    # it, before hashing the checkpoint, then uses its store (it packed it all again)
    with pack_lock(out, "another process is packing this store; waiting to use it"):
        if (opened := _cached(out, model_dir, weights, in_place, say=True)) is not None:
            return opened
        if in_place:
            from stmoe.runtime.store.in_place_index import make_in_place

            make_in_place(model_dir, out, progress)
        else:
            pack_folder(model_dir, out, progress, weights)
    opened = ExpertStore(out)
    opened.check_source(model_dir)
    return opened


def _cached(out: Path, model_dir: Path, weights: WeightFormat, in_place: bool,
            say: bool) -> ExpertStore | None:
    """The cached store in ``out`` if it serves ``model_dir`` as asked, else None (with a
    note of why it is packed again, where ``say``)."""
    if (out / "index.json").exists():
        try:
            opened = ExpertStore(out)
            opened.check_source(model_dir)
            if not weights.accepts(opened.weights):
                raise StoreError(f"holds {opened.weights.label} experts")
            if opened.in_place != in_place:
                raise StoreError("in place" if opened.in_place else "not in place")
            return opened
        except StoreError as exc:
            if say:
                warn(f"the cached store is unusable ({exc}); packing it again", StmoeNote)
    elif say and out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir()):
        warn(f"{out}: a half-written store (no index.json); packing it again", StmoeNote)
    return None


def ensure_store(model_dir: str | Path, store: str | Path | None,
                 weights: WeightFormat | None = None, in_place: bool = False) -> Path:
    """``open_store``'s folder (the given store, or the model's cached one)."""
    return open_store(model_dir, store, weights=weights, in_place=in_place).path
