"""The expert store: every (layer, expert)'s weights as one aligned block, one read each.

    STORE/index.json    format, version, the model's fingerprint, and per block:
                        layer, expert, offset, nbytes, crc32 and its tensors
                        (name, dtype, shape, offset inside the block)
    STORE/experts.bin   the blocks, each starting at a multiple of ALIGN bytes

Blocks are aligned so a reader can bypass the page cache (O_DIRECT needs aligned
offsets and sizes). Packing is deterministic: the same model gives the same
bytes. The non-expert weights are not in the store; they load from the model
folder as usual. A model folder offloaded without a store gets one packed on
first use, in a cache directory (``ensure_store``).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import StmoeError

STORE_FORMAT = "stmoe-expert-store"
STORE_VERSION = 1
ALIGN = 4096  # bytes: the page / O_DIRECT alignment of every block


class StoreError(StmoeError):
    """An expert store is missing, damaged, or belongs to another model."""


@dataclass(frozen=True)
class TensorSlot:
    name: str  # parameter name inside the experts module, e.g. "gate_up_proj"
    dtype: str  # numpy dtype string
    shape: tuple[int, ...]  # one expert's slice
    offset: int  # bytes from the block start


@dataclass(frozen=True)
class Block:
    layer: int  # MoE layer 0..L-1
    expert: int
    offset: int  # bytes from the start of experts.bin
    nbytes: int  # payload bytes (the block occupies nbytes rounded up to ALIGN)
    crc32: int
    tensors: tuple[TensorSlot, ...]


def fingerprint(model: Any) -> dict[str, Any]:
    """What a store must agree with to serve ``model``."""
    from stmoe.model_introspect import experts_modules

    modules = experts_modules(model)
    c = model.config
    return {
        "model_type": getattr(c, "model_type", ""),
        "hidden_size": getattr(c, "hidden_size", 0),
        "moe_layers": len(modules),
        "num_experts": int(getattr(modules[0][1], "num_experts", 0)) if modules else 0,
    }


def pack(model: Any, out_dir: str | Path) -> Path:
    """Write ``model``'s routed experts as a store; returns its folder."""
    import torch

    from stmoe.model_introspect import experts_modules

    modules = experts_modules(model)
    if not modules:
        raise StoreError(f"{type(model).__name__} has no routed-experts modules to pack")
    num_experts = int(getattr(modules[0][1], "num_experts", 0))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    blocks: list[Block] = []
    offset = 0
    tmp = out / "experts.bin.tmp"
    with open(tmp, "wb") as f:
        for layer, (_, module) in enumerate(modules):
            params = sorted((n, p) for n, p in module.named_parameters(recurse=False)
                            if p.dim() >= 1 and p.shape[0] == num_experts)  # fmt: skip
            if not params:
                raise StoreError(f"MoE layer {layer}: no per-expert parameters found")
            for expert in range(num_experts):
                payload, slots, inner = [], [], 0
                for name, p in params:
                    arr = p.detach()[expert].to("cpu").contiguous()
                    data = arr.reshape(-1).view(torch.uint8).numpy().tobytes()
                    dtype = str(arr.dtype).removeprefix("torch.")
                    slots.append(TensorSlot(name, dtype, tuple(arr.shape), inner))
                    payload.append(data)
                    inner += len(data)
                blob = b"".join(payload)
                f.write(blob)
                pad = (-len(blob)) % ALIGN
                f.write(b"\0" * pad)
                blocks.append(
                    Block(layer, expert, offset, len(blob), zlib.crc32(blob), tuple(slots))
                )
                offset += len(blob) + pad
    os.replace(tmp, out / "experts.bin")
    index = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "align": ALIGN,
        "model": fingerprint(model),
        "blocks": [_block_json(b) for b in blocks],
    }
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return out


def default_store_dir(model_dir: Path) -> Path:
    """Where a model folder's store is packed on first use (``STMOE_CACHE`` overrides)."""
    root = Path(os.environ.get("STMOE_CACHE", Path.home() / ".cache" / "stmoe")) / "stores"
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in [*sorted(model_dir.glob("*.safetensors")), model_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return root / f"{model_dir.name}-{h.hexdigest()[:16]}"


def ensure_store(model_dir: Path, store: str | Path | None) -> Path:
    """The given store, or the model's cached one, packed now if missing."""
    if store is not None:
        return Path(store)
    out = default_store_dir(model_dir)
    if not (out / "index.json").is_file():
        from stmoe.capture_generate import load_causal_lm

        pack(load_causal_lm(model_dir), out)
    return out


class ExpertStore:
    """Read access to a packed store: one ``pread`` per expert, checked."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_path, data_path = self.path / "index.json", self.path / "experts.bin"
        if not index_path.is_file() or not data_path.is_file():
            raise StoreError(f"{self.path}: not an expert store (no index.json and experts.bin); "
                             "write one with `stmoe pack`")  # fmt: skip
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as exc:
            raise StoreError(f"{index_path}: not valid JSON ({exc.msg})") from None
        if not isinstance(index, dict) or index.get("format") != STORE_FORMAT:
            raise StoreError(f"{index_path}: not an stmoe expert store index")
        if index.get("version") != STORE_VERSION:
            raise StoreError(f"{index_path}: store version {index.get('version')!r}, this stmoe "
                             f"reads {STORE_VERSION}; pack the model again")  # fmt: skip
        if index.get("align") != ALIGN:
            raise StoreError(f"{index_path}: blocks aligned to {index.get('align')!r} bytes, "
                             f"this stmoe expects {ALIGN}; pack the model again")  # fmt: skip
        self.model = index["model"]
        self.blocks = {(b["layer"], b["expert"]): _block(b) for b in index["blocks"]}
        size = data_path.stat().st_size
        end = max((b.offset + b.nbytes for b in self.blocks.values()), default=0)
        if size < end:
            raise StoreError(f"{data_path}: {size} bytes but the index needs {end}; "
                             "the store is truncated, pack it again")  # fmt: skip
        self.data_path = data_path

    def check_model(self, model: Any) -> None:
        """Refuse to serve a model the store was not packed from."""
        want = fingerprint(model)
        if want != self.model:
            raise StoreError(f"{self.path}: packed for {self.model} but the model is {want}; "
                             "pack this model with `stmoe pack`")  # fmt: skip

    def check_block(self, block: Block, data: memoryview) -> None:
        """Raise a clear StoreError when a block's bytes came back short or corrupt."""
        if len(data) < block.nbytes:
            raise StoreError(f"{self.data_path}: short read of layer {block.layer}, expert "
                             f"{block.expert} ({len(data)} of {block.nbytes} bytes)")  # fmt: skip
        if zlib.crc32(data[: block.nbytes]) != block.crc32:
            raise StoreError(f"{self.data_path}: layer {block.layer}, expert {block.expert} fails "
                             "its checksum; the store is corrupt, pack it again")  # fmt: skip

    def read(self, layer: int, expert: int, fd: int | None = None) -> dict[str, np.ndarray]:
        """One expert's tensors (numpy; bfloat16 as raw uint16), read and CRC-checked."""
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
            dtype = np.dtype("uint16") if t.dtype == "bfloat16" else np.dtype(t.dtype)
            count = int(np.prod(t.shape))
            out[t.name] = np.frombuffer(data, dtype=dtype, count=count, offset=t.offset).reshape(
                t.shape
            )
        return out


def _block_json(b: Block) -> dict[str, Any]:
    return {"layer": b.layer, "expert": b.expert, "offset": b.offset, "nbytes": b.nbytes,
            "crc32": b.crc32, "tensors": [[t.name, t.dtype, list(t.shape), t.offset]
                                          for t in b.tensors]}  # fmt: skip


def _block(d: dict[str, Any]) -> Block:
    try:
        return Block(int(d["layer"]), int(d["expert"]), int(d["offset"]), int(d["nbytes"]),
                     int(d["crc32"]), tuple(TensorSlot(n, str(t), tuple(s), int(o))
                                            for n, t, s, o in d["tensors"]))  # fmt: skip
    except (KeyError, TypeError, ValueError):
        raise StoreError(f"a malformed block entry in the index: {str(d)[:80]}") from None
