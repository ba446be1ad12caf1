"""The plugin's expert store: each expert's weights exactly as vLLM's kernel reads them.

Why its own store: vLLM's CPU MoE kernel reads its weights prepacked (padded, reordered
for the grouped GEMM), and the prepacked bytes of one expert are that expert's row of the
prepacked tensors (tested). A store of those rows lets a miss land in a slot with one
read and no conversion, and every slot holds the very bytes plain vLLM computes with:
the plugin's outputs are plain vLLM's, bit for bit.

The store is packed on first use from the weights vLLM has just loaded and processed; on
later uses every block is checked against those weights (CRC-32C) before it is trusted, and
every block of its data file is read once and checked (``first_damaged``): inside vLLM one
step computes every request together, so a damaged block found by a step would stop vLLM's
engine; found at the start, the plugin's own store (under its cache) is packed again, and
one given as ``store=`` is refused, naming the block. (The read costs about what vLLM has
just read to load the experts, each block checked while the next is read;
``experts=stream``/``in-place``, for models bigger than memory, check each block as it is
read.) Its index names the kernel layout in
``model_type`` (``qwen2_moe@vllm-cpu-vec``), so that no other runtime mistakes it for a
store of the checkpoint's own layout.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from stmoe.errors import BlockError
from stmoe.runtime.store.check import file_records
from stmoe.runtime.store.expert_store import CHANGED, CORRUPT, ExpertStore
from stmoe.runtime.store.folder import check_disk
from stmoe.runtime.store.index import Block, StoreError, block_crc
from stmoe.runtime.store.packing import write_store
from stmoe.util.cache_dir import cache_dir
from stmoe.vllm_plugin.layers import MoeLayer

log = logging.getLogger("vllm.stmoe")  # under vLLM's logger: its handler and format


def kernel_tag(layers: list[MoeLayer]) -> str:
    """The layout the store's bytes are in: vLLM's kernel, its ISA and the dtype."""
    fused = layers[0].module.quant_method.moe_kernel.fused_experts
    dtype = str(layers[0].module.w13_weight.dtype).removeprefix("torch.")
    return f"vllm-cpu-{getattr(fused, 'isa', None) or type(fused).__name__}-{dtype}"


def model_record(layers: list[MoeLayer], model_type: str) -> dict[str, object]:
    """What the store's index must agree with (its ``model``)."""
    return {"model_type": f"{model_type}@{kernel_tag(layers)}",
            "hidden_size": int(layers[0].module.hidden_size),
            "moe_layers": len(layers),
            "num_experts": int(layers[0].module.global_num_experts)}


def default_dir(model_dir: Path, layers: list[MoeLayer]) -> Path:
    """Where a model's kernel-layout store is packed when ``store`` is not given."""
    import vllm

    root = cache_dir("vllm")
    h = hashlib.sha256(f"{model_dir.resolve()}|{vllm.__version__}".encode())
    for f in [*sorted(model_dir.glob("*.safetensors")), model_dir / "config.json"]:
        if f.exists():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return root / f"{model_dir.name}-{kernel_tag(layers)}-{h.hexdigest()[:16]}"


def _blocks(layers: list[MoeLayer]) -> Iterator[tuple[int, int, list[tuple[str, torch.Tensor]]]]:
    for layer in layers:
        tensors = [getattr(layer.module, w).data for w in layer.params]
        for e in range(tensors[0].shape[0]):
            yield layer.index, e, [(w, t[e]) for w, t in zip(layer.params, tensors, strict=True)]


def open_checked(path: Path, want: dict[str, object]) -> ExpertStore:
    """The store at ``path``, refused unless it is this vLLM model's, in this layout."""
    store = ExpertStore(path)
    try:
        _same_model(store, want)
    except StoreError:
        store.close()
        raise
    return store


def _same_model(store: ExpertStore, want: dict[str, object]) -> None:
    if store.model != want:
        raise StoreError(f"{store.path}: a store for {store.model}, but this vLLM model is "
                         f"{want}; give another store= (or remove this one to pack it again)")


def problem(exc: StoreError) -> str:
    """``exc``'s words less the way out a ``stmoe pack`` user takes (the plugin packs its
    stores itself: its messages say their own way out)."""
    return str(exc).removesuffix(f"; {CORRUPT}").removesuffix(f"; {CHANGED}")


def first_damaged(store: ExpertStore) -> BlockError | None:
    """The first block of ``store`` that does not read whole and intact (every block read
    once, in the data file's order; an I/O error is such a block too), or None. The next
    block is read while one is checked (the check then costs about a plain read of the
    file), and each block read leaves the page cache (the runtime's disk reads bypass it: a
    whole store's pages would only push out others')."""
    order = sorted(store.blocks.values(), key=lambda b: b.offset)
    fd = os.open(store.data_file, os.O_RDONLY)

    def fetch(block: Block) -> bytes:
        try:
            return os.pread(fd, block.nbytes, block.offset)
        finally:
            os.posix_fadvise(fd, block.offset, block.nbytes, os.POSIX_FADV_DONTNEED)

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="stmoe-check") as reader:
            ahead = reader.submit(fetch, order[0]) if order else None
            for i, block in enumerate(order):
                try:
                    data = ahead.result()
                except OSError as exc:  # (EIO: a bad sector)
                    return BlockError(f"{store.path}: layer {block.layer}, expert "
                                      f"{block.expert} cannot be read "
                                      f"({exc.strerror or exc})", block.layer, block.expert)
                ahead = reader.submit(fetch, order[i + 1]) if i + 1 < len(order) else None
                try:
                    store.check_size(block, len(data))
                    store.check_crc(block, block_crc(memoryview(data)))
                except BlockError as exc:
                    return exc
    finally:  # (after the reader's last read ended)
        os.close(fd)
    return None


def open_or_pack(path: Path, layers: list[MoeLayer], model_type: str, model_dir: Path,
                 owned: bool = False) -> tuple[ExpertStore, bool]:
    """The store at ``path``, packed there first from the weights vLLM loaded when it has
    none; (store, packed now). An existing store must be this model's, in this layout, and
    hold the very bytes vLLM loaded (each block's CRC-32C against the weights in memory,
    then every block read and checked): a damaged one (a block, its index, its data file)
    is packed again where it is the plugin's own (``owned``: under its cache), else
    refused."""
    want = model_record(layers, model_type)
    if not (path / "index.json").exists():
        return _pack(path, want, layers, model_dir), True
    try:
        store = ExpertStore(path)
    except StoreError as exc:  # its index or data file damaged, or another version's
        if not owned:
            raise
        return _pack(path, want, layers, model_dir, again=exc), True
    started = time.perf_counter()
    try:
        _same_model(store, want)
        _check_loaded(store, layers)
        damaged = first_damaged(store)
        if damaged is not None and not owned:
            raise StoreError(f"{problem(damaged)}. The store given as store= is not the "
                             f"plugin's to replace: remove {path} (the plugin packs it again "
                             "at its next start) or give another store=") from damaged
    except BaseException:
        store.close()
        raise
    if damaged is None:
        log.info("stmoe: every block of %s read and checked in %.1f s", path,
                 time.perf_counter() - started)
        return store, False
    store.close()
    return _pack(path, want, layers, model_dir, again=damaged), True


def _pack(path: Path, want: dict[str, object], layers: list[MoeLayer], model_dir: Path,
          again: StoreError | None = None) -> ExpertStore:
    """The store packed at ``path`` from the weights vLLM loaded (the checkpoint's records
    only then: hashing its files is for packing), opened; refused first, in one line, where
    its disk cannot hold it. ``again``: why the store there is packed again (said)."""
    if again is not None:
        log.warning("stmoe: %s; packing the plugin's store again from the weights vLLM "
                    "loaded", problem(again))
    check_disk(path, sum(getattr(layer.module, w).data.nbytes for layer in layers
                         for w in layer.params), "store=")
    write_store(path, want, file_records(model_dir), _blocks(layers))
    return open_checked(path, want)


def _check_loaded(store: ExpertStore, layers: list[MoeLayer]) -> None:
    """Refuse a store whose blocks' CRC-32Cs are not the weights vLLM loaded."""
    path = store.path
    for layer, expert, tensors in _blocks(layers):
        block = store.blocks[(layer, expert)]
        crc = 0
        for _, t in tensors:
            crc = block_crc(t.contiguous().view(-1).view(torch.uint8).numpy(), crc)
        if crc != block.crc32c:
            raise StoreError(f"{path}: layer {layer} expert {expert}'s block is not the weights "
                             "vLLM loaded (CRC-32C differs); the checkpoint changed since the "
                             "store was packed: remove the store to pack it again")
