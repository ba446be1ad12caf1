"""The expert store: every (layer, expert)'s weights as one aligned block, one read each.

    STORE/index.json              format, version, the model's shape, where its weights
                                  came from (``source``), the data file's name, per block:
                                  layer, expert, offset, nbytes, crc32c and its tensors
                                  (name, dtype, shape, offset inside the block); int4: the
                                  packing CPU's layout (``int4_store``); and a SHA-256 of
                                  all that (``index``)
    STORE/experts-<sha256>.bin    the blocks, each starting at a multiple of ALIGN bytes

Blocks are aligned so a reader can bypass the page cache (O_DIRECT needs aligned
offsets and sizes). Packing is deterministic: the same model gives the same
bytes. Packing again is atomic: the new data file is written beside the old one
under its own name (its content's hash), then index.json, which names it, is
replaced in one rename (the switch); the old data file is removed afterwards, and
whatever a killed pack left is removed by the next one. A store is checked
before the first token: the index entry by entry (``index``), then against
the model's shapes and weights (``check``). The non-expert weights are not in
the store; they load from the model folder as usual. A model folder is packed
without loading its model, one expert at a time from its safetensors shards
(``pack_folder``, ``pack_stream``); a model folder offloaded without a store gets
one packed on first use, in a cache directory (``open_store``). An in-place store
(``in_place``) has no data file: its index lists each block's bytes in the checkpoint's
own files, read where they lie (``in_place``), so a bf16 checkpoint is never copied.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import BlockError, StmoeError
from stmoe.runtime.store.check import (
    check_layout,
    check_source,
    check_weights,
    materialised,
)
from stmoe.runtime.store.folder import named_data
from stmoe.runtime.store.index import (
    DTYPE_SIZES,
    Block,
    StoreError,
    block_crc,
    read_index,
)
from stmoe.runtime.store.int4_store import reconcile
from stmoe.util.fileio import check_input_file

# what a block that fails its checksum asks of a user of ``stmoe pack`` (a runtime that
# packs its own stores, the vLLM plugin, says its own way out instead)
CORRUPT = "the store is corrupt, pack it again"
CHANGED = ("the checkpoint changed after the index was made, or is damaged: make it again "
           "(stmoe pack --in-place)")


class _Replaced(Exception):
    """The data file an index named was gone when opened, and index.json names another."""


class ExpertStore:
    """Read access to a packed store: one ``pread`` per expert, checked."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # the data file, held open until ``close``: (fd, st_dev, st_ino)
        self._data: tuple[int, int, int] | None = None
        self._let_go: weakref.finalize | None = None
        try:
            self._open()
        except _Replaced:  # a pack replaced the store between its index and its data file:
            try:  # the new one, whole
                self._open()
            except _Replaced:
                raise StoreError(f"{self.path}: packed again twice while it was opened; "
                                 "open it again once the packs are over") from None
        self.model = self.index.model
        self.blocks = self.index.blocks
        self.weights = self.index.weights  # native, int8 or int4: how the experts are stored
        # int4 packed on another kind of CPU: each block repacked into this CPU's layout as it
        # lands (``int4_store``: ``check_block``, ``check_parts``); None: used as stored
        self.repack = reconcile(self.path, self.index)
        self.source: Path | None = None  # the model folder the store was matched to
        self._checked: weakref.WeakSet[Any] = weakref.WeakSet()

    def _open(self) -> None:
        """The index read and checked, and the data file it names opened and held: every
        reader of this store reads that file (``data_file``), even once a later pack has
        replaced and removed it (it read "No such file" while a process started)."""
        index_path = self.path / "index.json"
        if not index_path.exists():
            raise StoreError(f"{self.path}: no such folder; write a store there with `stmoe "
                             "pack`" if not self.path.exists() else
                             f"{self.path}: not an expert store (no index.json); write one "
                             "with `stmoe pack`")
        try:
            check_input_file(index_path, "an expert store's index.json (write one with "
                                         "`stmoe pack`)")
            self.index = read_index(index_path)
            self.in_place = self.index.in_place  # read from the checkpoint's own files
            self.data_path: Path | None = None if self.in_place else self.path / self.index.data
            if self.data_path is not None:
                self._hold(self.data_path)
        except StoreError:
            raise
        except StmoeError as exc:  # check_input_file's own: the same line, as a StoreError
            raise StoreError(str(exc)) from None

    def _hold(self, data: Path) -> None:
        try:
            check_input_file(data, "an expert store's data file")
            fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
        except (StmoeError, FileNotFoundError):
            if data.exists():
                raise
            if named_data(self.path) not in ("", data.name):
                raise _Replaced from None
            raise StoreError(f"{data}: missing, though index.json names it; the store is "
                             "damaged, pack it again") from None
        self._let_go = weakref.finalize(self, os.close, fd)
        st = os.fstat(fd)
        self._data = (fd, st.st_dev, st.st_ino)
        size, want = st.st_size, self.index.data_bytes
        if size != want:
            state = "truncated" if size < want else "longer than its index says"
            raise StoreError(f"{data}: {size} bytes but the index needs {want}; the store is "
                             f"{state}, pack it again")

    def close(self) -> None:
        """Let the held data file go (an offloaded model's close: a temporary store removed
        then frees its disk at once); reads by its name from then on."""
        if self._let_go is not None:
            self._let_go()
        self._data = None

    @property
    def data_file(self) -> Path:
        """Where to open the data file the index named when the store was opened (that
        file even once replaced: the descriptor held, a forked child's too; by its name
        after ``close``). The descriptor is checked to be that file still (a number
        reused after a close would be another)."""
        if self.data_path is None:
            raise StoreError(f"{self.path}: an in-place index has no data file")
        if self._data is not None:
            fd, dev, ino = self._data
            held = Path(f"/proc/self/fd/{fd}")
            with contextlib.suppress(OSError):  # (the same file still: not a number reused)
                if (st := os.stat(held)).st_dev == dev and st.st_ino == ino:
                    return held
        return self.data_path

    def check_source(self, model_dir: str | Path) -> None:
        """Refuse a store packed from other weights than ``model_dir``'s checkpoint, and an
        in-place index whose extents are not where that checkpoint's headers put each
        expert (``extents.check_extents``: derived again, never trusted)."""
        check_source(self.path, self.index, Path(model_dir))
        if self.in_place:
            from stmoe.runtime.store.extents import check_extents

            check_extents(self.path, self.index, Path(model_dir))
        self.source = Path(model_dir)

    def checkpoint_files(self) -> list[Path]:
        """An in-place store's checkpoint files, numbered as its extents number them (the
        folder matched by ``check_source`` first: the index names files, not a folder)."""
        if self.source is None:
            raise StoreError(f"{self.path}: an in-place index reads the experts from the "
                             "checkpoint's own files; offload the model folder it was made "
                             "from (a model in memory cannot use it)")
        return [self.source / f[0] for f in self.index.source["files"]]

    @property
    def where(self) -> str:
        """What a failed read names: the data file, or the checkpoint read in place."""
        if self.data_path is not None:
            return str(self.data_path)
        return f"{self.source or self.path} (read in place)"

    def check_model(self, model: Any, layout: Any = None, params: Any = None) -> None:
        """Refuse to serve a model the store was not packed from: its shapes and dtypes,
        block by block, and its weights (the CRC-32C of its experts while they are in
        memory, else the checkpoint matched by ``check_source``). ``layout``: the model's
        ``hf.layout.ModelLayout`` where the caller has it; ``params``: each layer's
        per-expert parameters to check in place of the model's own (its experts in the
        store's format, made but not yet installed: ``quant.experts.plan_format``)."""
        if model in self._checked:
            return
        if self.in_place:
            self.checkpoint_files()  # refused now, not at the first miss
        per_layer = check_layout(self.path, self.index, model, layout, params)
        if materialised(per_layer):
            check_weights(self.path, self.index, per_layer, self.repack)
        elif self.source is None:
            raise StoreError(f"{self.path}: the model's experts are not in memory, so the "
                             "store cannot be matched to its weights; offload the model "
                             "folder instead")
        self._checked.add(model)

    def check_block(self, block: Block, data: memoryview) -> None:
        """Raise a clear StoreError when a block's bytes came back short or corrupt; then
        (``repack``) put its int4 matrices in this CPU's layout, in ``data``: every read of
        a block's bytes passes here or ``check_parts``, before anything computes with them."""
        self.check_size(block, len(data))
        self.check_crc(block, block_crc(data[: block.nbytes]))
        if self.repack is not None:
            self.repack.block(block, [data[: block.nbytes]])

    def check_size(self, block: Block, got: int) -> None:
        """Refuse a read of ``block`` that brought fewer than its bytes."""
        if got < block.nbytes:
            raise BlockError(f"{self.where}: short read of layer {block.layer}, expert "
                             f"{block.expert} ({got} of {block.nbytes} bytes)",
                             block.layer, block.expert)

    def check_parts(self, block: Block, parts: list[memoryview]) -> None:
        """``check_block`` for a block read in pieces (straight into a cache slot's tensors),
        its int4 matrices repacked there as ``check_block`` does."""
        crc = 0
        for part in parts:
            crc = block_crc(part, crc)
        self.check_crc(block, crc)
        if self.repack is not None:
            self.repack.block(block, parts)

    def check_crc(self, block: Block, crc: int) -> None:
        """Refuse a block whose bytes' CRC-32C is not its index entry's."""
        if crc == block.crc32c:
            return
        if self.in_place:
            raise BlockError(f"{self.where}: layer {block.layer}, expert {block.expert} fails "
                             f"the in-place index's checksum; {CHANGED}", block.layer,
                             block.expert)
        raise BlockError(f"{self.where}: layer {block.layer}, expert {block.expert} fails "
                         f"its checksum; {CORRUPT}", block.layer, block.expert)

    def read(self, layer: int, expert: int, fd: int | None = None) -> dict[str, np.ndarray]:
        """One expert's tensors (numpy; a dtype numpy lacks, e.g. bfloat16, as raw unsigned
        integers of its width), read and CRC-checked."""
        block = self.blocks.get((layer, expert))
        if block is None:
            raise StoreError(f"{self.path}: no block for layer {layer}, expert {expert}")
        if self.in_place:  # plain reads of its extents (the runtime's are ``InPlaceTier``'s)
            files = self.checkpoint_files()
            pieces = []
            for e in block.extents:
                with open(files[e.file], "rb") as f:
                    pieces.append(os.pread(f.fileno(), e.nbytes, e.offset))
            data: bytes | bytearray = b"".join(pieces)
        else:
            if fd is None and self._data is not None:
                fd = self._data[0]  # the held file (no open per expert; the CRC checks it)
            own = fd is None  # (closed: by its name)
            fd = os.open(self.data_file, os.O_RDONLY) if fd is None else fd
            try:
                data = os.pread(fd, block.nbytes, block.offset)
            finally:
                if own:
                    os.close(fd)
        if self.repack is not None:
            data = bytearray(data)  # repacked in place by the check
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
