"""The expert store: every (layer, expert)'s weights as one aligned block, one read each.

    STORE/index.json              format, version, the model's shape, where its weights
                                  came from (``source``), the data file's name, per block:
                                  layer, expert, offset, nbytes, crc32c and its tensors
                                  (name, dtype, shape, offset inside the block); and a
                                  SHA-256 of all that (``store_index``)
    STORE/experts-<sha256>.bin    the blocks, each starting at a multiple of ALIGN bytes

Blocks are aligned so a reader can bypass the page cache (O_DIRECT needs aligned
offsets and sizes). Packing is deterministic: the same model gives the same
bytes. Packing again is atomic: the new data file is written beside the old one
under its own name (its content's hash), then index.json, which names it, is
replaced in one rename (the switch); the old data file is removed afterwards, and
whatever a killed pack left is removed by the next one. A store is checked
before the first token: the index entry by entry (``store_index``), then against
the model's shapes and weights (``store_check``). The non-expert weights are not in
the store; they load from the model folder as usual. A model folder is packed
without loading its model, one expert at a time from its safetensors shards
(``pack_folder``, ``pack_stream``); a model folder offloaded without a store gets
one packed on first use, in a cache directory (``open_store``).
"""

from __future__ import annotations

import hashlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import StmoeError, StmoeNote
from stmoe.fileio import (
    atomic_write_text,
    check_input_file,
    publish,
    temp_beside,
)
from stmoe.runtime.store_check import (
    architecture,
    check_layout,
    check_source,
    check_weights,
    expert_params,
    file_records,
    materialised,
)
from stmoe.runtime.store_index import (
    ALIGN,
    DATA_NAME,
    DTYPE_SIZES,
    STORE_FORMAT,
    STORE_VERSION,
    Block,
    StoreError,
    TensorSlot,
    block_crc,
    index_text,
    read_index,
)

__all__ = ["ALIGN", "STORE_FORMAT", "STORE_VERSION", "Block", "ExpertStore", "StoreError",
           "TensorSlot", "ensure_store", "open_store", "pack", "pack_folder"]  # fmt: skip

# progress(total_bytes, label) -> a context giving advance(nbytes), as _progress.byte_progress
ProgressFactory = Callable[[int, str], AbstractContextManager[Callable[[int], None]]]
DATA_TEMP = "experts.bin"  # a pack's temporary data file: .experts.bin.<pid>.<random>.tmp
_OLD_DATA = ("experts.bin", "experts.bin.tmp")  # version 1's data file and its temporary


def pack(model: Any, out_dir: str | Path, source: str | Path | None = None) -> Path:
    """Write ``model``'s routed experts (all in memory) as a store; returns its folder.

    ``source``: the model folder ``model`` was just loaded from, unchanged. Its
    checkpoint files are recorded so that offloading that folder with this store
    can tell its weights are the store's (without it, only the model in memory can).
    A folder packs without loading its model: ``pack_folder``.
    """
    from stmoe.model_introspect import experts_modules

    modules = experts_modules(model)
    if not modules:
        raise StoreError(f"{type(model).__name__} has no routed-experts modules to pack")
    num_experts = int(getattr(modules[0][1], "num_experts", 0))
    layers = [expert_params(module, num_experts) for _, module in modules]
    for layer, params in enumerate(layers):
        if not params:
            raise StoreError(f"MoE layer {layer}: no per-expert parameters found")
    record = file_records(Path(source)) if source is not None else {"kind": "module"}
    blocks = ((layer, expert, [(n, p.detach()[expert]) for n, p in params])
              for layer, params in enumerate(layers) for expert in range(num_experts))  # fmt: skip
    return _write_store(Path(out_dir), architecture(model), record, blocks, lambda n: None)


def pack_folder(model_dir: str | Path, out_dir: str | Path,
                progress: ProgressFactory | None = None) -> Path:  # fmt: skip
    """Write a model folder's routed experts as a store, read one expert at a time from its
    safetensors shards (``pack_stream``), never the whole model in memory; the same bytes
    as ``pack`` of the loaded model. A checkpoint whose experts cannot be read one by one
    is loaded and packed whole, with a note saying why. ``progress(total_bytes, label)``:
    a context giving ``advance(nbytes)`` (default: a bar on stderr when on a terminal)."""
    from stmoe._progress import byte_progress
    from stmoe.runtime.pack_stream import CheckpointExperts, StreamUnsupported

    model_dir = Path(model_dir)
    try:
        experts = CheckpointExperts(model_dir)
    except StreamUnsupported as exc:
        from stmoe.capture_generate import load_causal_lm

        model = load_causal_lm(model_dir)  # its errors are clear
        warnings.warn(f"{exc}; packing from the whole model loaded in memory", StmoeNote,
                      stacklevel=2)  # fmt: skip
        return pack(model, out_dir, source=model_dir)
    record = file_records(model_dir)
    try:
        with (progress or byte_progress)(experts.nbytes, f"packing {model_dir.name}") as advance:
            blocks = experts.blocks(record)
            return _write_store(Path(out_dir), experts.architecture, record, blocks, advance)
    finally:
        experts.release(force=True)


def _write_store(out: Path, model: dict[str, Any], record: dict[str, Any], blocks: Iterable[Any],
                 advance: Callable[[int], None]) -> Path:  # fmt: skip
    """The data file, then index.json naming it (the switch), then the replaced data file
    removed: the one ending of both packers."""
    out.mkdir(parents=True, exist_ok=True)
    data, size, written = _write_data(blocks, out, advance)
    text = index_text(model, record, data, size, written)
    atomic_write_text(out / "index.json", text)  # the switch: the new store is whole
    _remove_unnamed(out, data)
    return out


def _write_data(blocks: Iterable[tuple[int, int, list[tuple[str, Any]]]], out: Path,
                advance: Callable[[int], None]) -> tuple[str, int, list[Block]]:  # fmt: skip
    """The blocks into a temporary file renamed to its content's name; (name, size, blocks)."""
    written: list[Block] = []
    offset, digest = 0, hashlib.sha256()
    with temp_beside(out / DATA_TEMP) as tmp:
        with open(tmp, "wb") as f:
            for layer, expert, tensors in blocks:
                blob, slots = _block_bytes(tensors)
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


def _block_bytes(tensors: list[tuple[str, Any]]) -> tuple[bytes, tuple[TensorSlot, ...]]:
    """One expert's tensors end to end, and where each sits in the block."""
    import torch

    payload, slots, inner = [], [], 0
    for name, t in tensors:
        arr = t.to("cpu").contiguous()
        data = arr.reshape(-1).view(torch.uint8).numpy().tobytes()
        slots.append(TensorSlot(name, str(arr.dtype).removeprefix("torch."), tuple(arr.shape),
                                inner))  # fmt: skip
        payload.append(data)
        inner += len(data)
    return b"".join(payload), tuple(slots)


def _remove_unnamed(out: Path, keep: str) -> None:
    """Data files the index does not name: the replaced one, a killed pack's, version 1's."""
    for f in out.iterdir():
        if f.name != keep and (DATA_NAME.fullmatch(f.name) or f.name in _OLD_DATA):
            f.unlink(missing_ok=True)


def default_store_dir(model_dir: Path) -> Path:
    """Where a model folder's store is packed on first use (``STMOE_CACHE`` overrides)."""
    root = Path(os.environ.get("STMOE_CACHE", Path.home() / ".cache" / "stmoe")) / "stores"
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in [*sorted(model_dir.glob("*.safetensors")), model_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return root / f"{model_dir.name}-{h.hexdigest()[:16]}"


def open_store(model_dir: str | Path, store: str | Path | None,
               progress: ProgressFactory | None = None) -> ExpertStore:  # fmt: skip
    """The store for ``model_dir``, opened and matched to its checkpoint: the given one
    (refused when damaged or foreign, never overwritten), or the model's cached one,
    packed now (``pack_folder``, with ``progress``) when missing, and packed again, with
    a note, when damaged, of an older version or half-written (a killed pack)."""
    model_dir = Path(model_dir)
    if store is not None:
        opened = ExpertStore(store)
        opened.check_source(model_dir)
        return opened
    out = default_store_dir(model_dir)
    if (out / "index.json").exists():
        try:
            opened = ExpertStore(out)
            opened.check_source(model_dir)
            return opened
        except StoreError as exc:
            warnings.warn(f"the cached store is unusable ({exc}); packing it again",
                          StmoeNote, stacklevel=2)  # fmt: skip
    elif out.is_dir() and any(out.iterdir()):
        warnings.warn(f"{out}: a half-written store (no index.json); packing it again",
                      StmoeNote, stacklevel=2)  # fmt: skip
    pack_folder(model_dir, out, progress)
    opened = ExpertStore(out)
    opened.check_source(model_dir)
    return opened


def ensure_store(model_dir: str | Path, store: str | Path | None) -> Path:
    """``open_store``'s folder (the given store, or the model's cached one)."""
    return open_store(model_dir, store).path


class ExpertStore:
    """Read access to a packed store: one ``pread`` per expert, checked."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_path = self.path / "index.json"
        if not index_path.exists():
            raise StoreError(f"{self.path}: not an expert store (no index.json); "
                             "write one with `stmoe pack`")  # fmt: skip
        try:
            check_input_file(index_path, "an expert store's index.json (write one with "
                                         "`stmoe pack`)")  # fmt: skip
            self.index = read_index(index_path)
            self.data_path = self.path / self.index.data
            if not self.data_path.exists():
                raise StoreError(f"{self.data_path}: missing, though index.json names it; "
                                 "the store is damaged, pack it again")  # fmt: skip
            check_input_file(self.data_path, "an expert store's data file")
        except StoreError:
            raise
        except StmoeError as exc:  # check_input_file's own: the same line, as a StoreError
            raise StoreError(str(exc)) from None
        self.model = self.index.model
        self.blocks = self.index.blocks
        size, want = self.data_path.stat().st_size, self.index.data_bytes
        if size != want:
            state = "truncated" if size < want else "longer than its index says"
            raise StoreError(f"{self.data_path}: {size} bytes but the index needs {want}; "
                             f"the store is {state}, pack it again")  # fmt: skip
        self.source: Path | None = None  # the model folder the store was matched to
        self._checked: weakref.WeakSet[Any] = weakref.WeakSet()

    def check_source(self, model_dir: str | Path) -> None:
        """Refuse a store packed from other weights than ``model_dir``'s checkpoint."""
        check_source(self.path, self.index, Path(model_dir))
        self.source = Path(model_dir)

    def check_model(self, model: Any) -> None:
        """Refuse to serve a model the store was not packed from: its shapes and dtypes,
        block by block, and its weights (the CRC-32C of its experts while they are in
        memory, else the checkpoint matched by ``check_source``)."""
        if model in self._checked:
            return
        per_layer = check_layout(self.path, self.index, model)
        if materialised(per_layer):
            check_weights(self.path, self.index, per_layer)
        elif self.source is None:
            raise StoreError(f"{self.path}: the model's experts are not in memory, so the "
                             "store cannot be matched to its weights; offload the model "
                             "folder instead")  # fmt: skip
        self._checked.add(model)

    def check_block(self, block: Block, data: memoryview) -> None:
        """Raise a clear StoreError when a block's bytes came back short or corrupt."""
        self.check_size(block, len(data))
        self._check_crc(block, block_crc(data[: block.nbytes]))

    def check_size(self, block: Block, got: int) -> None:
        """Refuse a read of ``block`` that brought fewer than its bytes."""
        if got < block.nbytes:
            raise StoreError(f"{self.data_path}: short read of layer {block.layer}, expert "
                             f"{block.expert} ({got} of {block.nbytes} bytes)")  # fmt: skip

    def check_parts(self, block: Block, parts: list[memoryview]) -> None:
        """``check_block`` for a block read in pieces (straight into a cache slot's tensors)."""
        crc = 0
        for part in parts:
            crc = block_crc(part, crc)
        self._check_crc(block, crc)

    def _check_crc(self, block: Block, crc: int) -> None:
        if crc != block.crc32c:
            raise StoreError(f"{self.data_path}: layer {block.layer}, expert {block.expert} fails "
                             "its checksum; the store is corrupt, pack it again")  # fmt: skip

    def read(self, layer: int, expert: int, fd: int | None = None) -> dict[str, np.ndarray]:
        """One expert's tensors (numpy; a dtype numpy lacks, e.g. bfloat16, as raw unsigned
        integers of its width), read and CRC-checked."""
        block = self.blocks.get((layer, expert))
        if block is None:
            raise StoreError(f"{self.path}: no block for layer {layer}, expert {expert}")
        own = fd is None
        fd = os.open(self.data_path, os.O_RDONLY) if own else fd
        try:
            data = os.pread(fd, block.nbytes, block.offset)
        finally:
            if own:
                os.close(fd)
        self.check_block(block, memoryview(data))
        out = {}
        for t in block.tensors:
            dtype = _numpy_dtype(t.dtype)
            count = int(np.prod(t.shape))
            out[t.name] = np.frombuffer(data, dtype=dtype, count=count, offset=t.offset).reshape(
                t.shape
            )
        return out


def _numpy_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(f"uint{8 * DTYPE_SIZES[name]}")
