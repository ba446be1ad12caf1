"""The expert store's index: its entries, its checksum, and every check made on opening it.

An index is trusted only after it passes, in this order: the format and version,
a SHA-256 of its own canonical content (one flipped bit anywhere is caught), and
then every entry on its own terms (a hand-made index with a recomputed checksum
must still describe a sound store): each (layer, expert) of the grid present
exactly once, each block's tensors laid end to end and adding up to its size, one
layout per layer, and each block exactly where packing puts it (``placement``: an
index edited alone cannot send a (layer, expert) to another's bytes). An in-place
index (``data`` is ``"checkpoint"``: ``store.in_place``) has no data file: each block
lists its extents in the checkpoint's own files instead, each inside its file's
recorded size and none sharing a byte with another (where the checkpoint's headers put
them is checked with its folder: ``extents``). Fitting a model is ``check``'s concern.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import crc32c

from stmoe.errors import OffloadError, StoreError
from stmoe.quant.formats import LAYOUT_KEY, NATIVE, WeightFormat, stored_format
from stmoe.util.shown import short_repr

STORE_FORMAT = "stmoe-expert-store"
STORE_VERSION = 6  # 2: the data file named by the index (atomic repacking), checksummed index;
# 3: blocks checksummed with CRC-32C (hardware: ~10x faster than zlib's CRC-32 on every read);
# 4: the experts' weight format (``weights``: native, int8, int4 and its group size);
# 5: an index may read its blocks in place from the checkpoint (``IN_PLACE``);
# 6: an int4 store records the packing CPU's int4 layout (``LAYOUT_KEY``: ``int4_store``)
READ_VERSIONS = (3, 4, 5, 6)  # a version 3 store holds native weights and still loads
IN_PLACE = "checkpoint"  # ``data`` of an in-place index: the blocks are the checkpoint's bytes
MAX_EXTENTS = 64  # per block (an expert's tensors, each at most one piece per shard)
ALIGN = 4096  # bytes: the page / O_DIRECT alignment of every block
DATA_NAME = re.compile(r"experts-[0-9a-f]{16}\.bin")  # a plain name in the store folder
MAX_INDEX_BYTES = 1 << 28  # far above any real model's (DeepSeek-V3: ~15k blocks, a few MB)
MAX_TENSORS, MAX_DIMS = 64, 8  # tensors per block, dimensions per tensor
# bytes per element of every dtype a store may hold (torch's names)
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
MODEL_KEYS = ("hidden_size", "model_type", "moe_layers", "num_experts")
TOP_KEYS = {"align", "blocks", "checksum", "data", "data_bytes", "format", "model", "source",
            "version", "weights"}
V3_KEYS = TOP_KEYS - {"weights"}
BLOCK_KEYS = {"crc32c", "expert", "layer", "nbytes", "offset", "tensors"}
IN_PLACE_KEYS = BLOCK_KEYS - {"offset"} | {"extents"}


def block_crc(data: Any, crc: int = 0) -> int:
    """CRC-32C of ``data`` (a buffer) continued from ``crc``: a block's checksum. Hardware
    CRC (SSE4.2 / ARMv8) through the crc32c package, which releases the GIL: 0.3 ms for a
    6 MiB expert here, where zlib's CRC-32 took 3.6 ms on the compute thread of every miss
    (store version 2)."""
    return crc32c.crc32c(data, crc)


@dataclass(frozen=True)
class TensorSlot:
    name: str  # parameter name inside the experts module, e.g. "gate_up_proj"
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]  # one expert's slice
    offset: int  # bytes from the block start


class Extent(NamedTuple):
    """Bytes of an in-place block in one checkpoint file."""

    file: int  # position in the index's ``source`` files
    offset: int  # bytes from the start of that file
    nbytes: int


@dataclass(frozen=True)
class Block:
    layer: int  # MoE layer 0..L-1
    expert: int
    offset: int  # bytes from the start of the data file (-1 in place: ``extents``)
    nbytes: int  # payload bytes (the block occupies nbytes rounded up to ALIGN)
    crc32c: int  # CRC-32C (Castagnoli) of the payload: ``block_crc``
    tensors: tuple[TensorSlot, ...]
    extents: tuple[Extent, ...] = ()  # in place: the payload's pieces, end to end


@dataclass(frozen=True)
class StoreIndex:
    """A checked index: the model's fingerprint, where the weights came from, the blocks."""

    model: dict[str, Any]
    source: dict[str, Any]  # {"kind": "module"} or {"kind": "folder", "files": [...]}
    data: str  # the data file's name in the store folder
    data_bytes: int
    blocks: dict[tuple[int, int], Block]
    weights: WeightFormat = NATIVE  # how the blocks' expert matrices are stored
    int4_layout: str | None = None  # int4: the packing CPU's layout (None: unrecorded, <= v5)

    @property
    def in_place(self) -> bool:
        """The blocks are read from the checkpoint's own files (no data file)."""
        return self.data == IN_PLACE


def checksum(index: dict[str, Any]) -> str:
    """SHA-256 of the index's canonical JSON, without its own checksum field."""
    body = {k: v for k, v in index.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def index_text(model: dict[str, Any], source: dict[str, Any], data: str, data_bytes: int,
               blocks: list[Block], weights: WeightFormat = NATIVE,
               int4_layout: str | None = None) -> str:
    """The index.json of a store, checksum included (deterministic; ``int4_layout``: int4's)."""
    index = {"format": STORE_FORMAT, "version": STORE_VERSION, "align": ALIGN, "data": data,
             "data_bytes": data_bytes, "model": model, "source": source,
             "weights": weights.to_json(), "blocks": [_block_json(b) for b in blocks],
             **({LAYOUT_KEY: int4_layout} if int4_layout is not None else {})}
    index["checksum"] = checksum(index)
    return json.dumps(index, indent=1, sort_keys=True) + "\n"


def read_index(path: Path) -> StoreIndex:
    """``path`` (an index.json) parsed and checked, or one StoreError naming it."""
    size = path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise StoreError(f"{path}: {size} bytes, more than any store index "
                         f"({MAX_INDEX_BYTES}); not an stmoe expert store index")
    try:
        index = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:  # ValueError: a number of over 4300 digits
        raise StoreError(f"{path}: not valid JSON ({str(getattr(exc, 'msg', exc))[:80]}); "
                         "the store is damaged, pack it again") from None
    if not isinstance(index, dict) or index.get("format") != STORE_FORMAT:
        raise StoreError(f"{path}: not an stmoe expert store index")
    if index.get("version") not in READ_VERSIONS or isinstance(index.get("version"), bool):
        raise StoreError(f"{path}: store version {short_repr(index.get('version'))}, this stmoe "
                         f"reads {READ_VERSIONS[0]} to {READ_VERSIONS[-1]}; pack the model again")
    if index.get("checksum") != checksum(index):
        raise StoreError(f"{path}: index.json fails its checksum; the store is damaged, "
                         "pack it again")
    return _Checker(path).index(index)


class _Checker:
    """Entry by entry checks of a checksummed index; each failure names the entry."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: list[int] | None = None  # in place: each checkpoint file's recorded size

    def fail(self, where: str, problem: str) -> StoreError:
        return StoreError(f"{self.path}: {where}: {problem}; the store is damaged, pack it again")

    def int_field(self, d: dict[str, Any], key: str, where: str, low: int = 0,
                  high: int = 1 << 62) -> int:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise self.fail(where, f"{key} is {short_repr(v)}, expected a whole number "
                                   f"{low}..{high}")
        return v

    def index(self, index: dict[str, Any]) -> StoreIndex:
        keys = TOP_KEYS if index["version"] >= 4 else V3_KEYS
        if set(index) - {LAYOUT_KEY} != keys:
            raise self.fail("top level", f"keys {sorted(index)}, expected {sorted(keys)}")
        try:  # the experts' format; int4 (version 6): the CPU layout that packed it
            weights, layout = stored_format(index)
        except OffloadError as exc:
            raise self.fail(*str(exc).split(": ", 1)) from None
        if index["align"] != ALIGN:
            raise StoreError(f"{self.path}: blocks aligned to {short_repr(index['align'])} bytes, "
                             f"this stmoe expects {ALIGN}; pack the model again")
        model = index["model"]
        if not isinstance(model, dict) or set(model) != set(MODEL_KEYS):
            raise self.fail("model", f"expected an object with keys {list(MODEL_KEYS)}")
        layers = self.int_field(model, "moe_layers", "model", 1, 1 << 16)
        experts = self.int_field(model, "num_experts", "model", 1, 1 << 16)
        self.int_field(model, "hidden_size", "model")
        if not isinstance(model["model_type"], str):
            raise self.fail("model", "model_type is not a string")
        data = index["data"]
        in_place = data == IN_PLACE and index["version"] >= 5
        if not in_place and (not isinstance(data, str) or not DATA_NAME.fullmatch(data)):
            raise self.fail("data", f"{short_repr(data)} is not a data file name of a store")
        data_bytes = self.int_field(index, "data_bytes", "data_bytes")
        source = self.source(index["source"])
        if in_place and (source["kind"] != "folder" or weights != NATIVE):
            raise self.fail("data", "an in-place index reads a checkpoint folder's own "
                                    "(native) bytes")
        self.files = [f[1] for f in source.get("files", [])] if in_place else None
        raw = index["blocks"]
        if not isinstance(raw, list) or len(raw) != layers * experts:
            count = len(raw) if isinstance(raw, list) else "no list of"
            raise self.fail("blocks", f"{count} blocks, expected one per (layer, expert): "
                                      f"{layers} x {experts}")
        blocks: dict[tuple[int, int], Block] = {}
        for i, entry in enumerate(raw):
            b = (self.in_place_block(entry, f"block {i}", layers, experts) if in_place
                 else self.block(entry, f"block {i}", layers, experts, data_bytes))
            if (b.layer, b.expert) in blocks:
                raise self.fail(f"block {i}", f"layer {b.layer}, expert {b.expert} twice")
            blocks[(b.layer, b.expert)] = b
        if in_place:
            self.extent_placement(blocks, data_bytes)
        else:
            self.placement(blocks, data_bytes)
        return StoreIndex(model, source, data, data_bytes, blocks, weights, layout)

    def source(self, s: Any) -> dict[str, Any]:
        if s == {"kind": "module"}:
            return s
        if not isinstance(s, dict) or set(s) != {"kind", "files"} or s["kind"] != "folder":
            raise self.fail("source", 'expected {"kind": "module"} or a folder\'s files')
        files = s["files"]
        if not isinstance(files, list) or not files:
            raise self.fail("source", "no checkpoint files listed")
        for i, f in enumerate(files):
            ok = (isinstance(f, list) and len(f) == 4 and isinstance(f[0], str) and f[0]
                  and "/" not in f[0] and all(isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 0 for v in f[1:3])
                  and isinstance(f[3], str) and re.fullmatch(r"[0-9a-f]{64}", f[3]))
            if not ok:
                raise self.fail(f"source file {i}", "expected [name, size, mtime_ns, sha256]")
        return s

    def block(self, d: Any, where: str, layers: int, experts: int, data_bytes: int) -> Block:
        if not isinstance(d, dict) or set(d) != BLOCK_KEYS:
            raise self.fail(where, f"expected an object with keys {sorted(BLOCK_KEYS)}")
        layer = self.int_field(d, "layer", where, 0, layers - 1)
        expert = self.int_field(d, "expert", where, 0, experts - 1)
        where = f"{where} (layer {layer}, expert {expert})"
        offset = self.int_field(d, "offset", where, 0, data_bytes)
        nbytes = self.int_field(d, "nbytes", where, 1, data_bytes)
        crc = self.int_field(d, "crc32c", where, 0, 0xFFFFFFFF)
        if offset % ALIGN:  # (inside the data: ``placement``)
            raise self.fail(where, f"offset {offset} is not a multiple of {ALIGN}")
        return Block(layer, expert, offset, nbytes, crc, self.tensors(d["tensors"], where,
                                                                      nbytes))

    def in_place_block(self, d: Any, where: str, layers: int, experts: int) -> Block:
        """An in-place index's block: its extents inside their files, adding up to it."""
        if not isinstance(d, dict) or set(d) != IN_PLACE_KEYS:
            raise self.fail(where, f"expected an object with keys {sorted(IN_PLACE_KEYS)}")
        layer = self.int_field(d, "layer", where, 0, layers - 1)
        expert = self.int_field(d, "expert", where, 0, experts - 1)
        where = f"{where} (layer {layer}, expert {expert})"
        nbytes = self.int_field(d, "nbytes", where, 1)
        crc = self.int_field(d, "crc32c", where, 0, 0xFFFFFFFF)
        raw = d["extents"]
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_EXTENTS:
            raise self.fail(where, f"extents: expected a list of 1..{MAX_EXTENTS}")
        assert self.files is not None
        extents = []
        for j, e in enumerate(raw):
            ok = (isinstance(e, list) and len(e) == 3
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
                  and 0 <= e[0] < len(self.files) and e[1] >= 0 and e[2] >= 1)
            if not ok:
                raise self.fail(f"{where}, extent {j}", "expected [file, offset, nbytes] "
                                f"with file 0..{len(self.files) - 1}")
            if e[1] + e[2] > self.files[e[0]]:
                raise self.fail(f"{where}, extent {j}", f"bytes {e[1]}..{e[1] + e[2]} run past "
                                f"checkpoint file {e[0]} ({self.files[e[0]]} bytes)")
            extents.append(Extent(*e))
        if sum(e.nbytes for e in extents) != nbytes:
            raise self.fail(where, f"nbytes {nbytes}, but its extents hold "
                                   f"{sum(e.nbytes for e in extents)}")
        return Block(layer, expert, -1, nbytes, crc, self.tensors(d["tensors"], where, nbytes),
                     tuple(extents))

    def tensors(self, tensors: Any, where: str, nbytes: int) -> tuple[TensorSlot, ...]:
        """A block's tensors, laid end to end and adding up to its ``nbytes``."""
        if not isinstance(tensors, list) or not 1 <= len(tensors) <= MAX_TENSORS:
            raise self.fail(where, f"tensors: expected a list of 1..{MAX_TENSORS}")
        slots, inner = [], 0
        for j, t in enumerate(tensors):
            slot = self.slot(t, f"{where}, tensor {j}")
            if slot.offset != inner:
                raise self.fail(f"{where}, tensor {j}", f"inner offset {slot.offset}, "
                                f"expected {inner} (tensors end to end)")
            inner += slot_bytes(slot)
            slots.append(slot)
        if inner != nbytes:
            raise self.fail(where, f"nbytes {nbytes}, but its tensors hold {inner}")
        return tuple(slots)

    def slot(self, t: Any, where: str) -> TensorSlot:
        ok = (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str) and t[0]
              and isinstance(t[1], str) and t[1] in DTYPE_SIZES
              and isinstance(t[2], list) and len(t[2]) <= MAX_DIMS
              and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40
                      for n in t[2])
              and isinstance(t[3], int) and not isinstance(t[3], bool))
        if not ok:
            raise self.fail(where, "expected [name, dtype, shape, offset] with a known dtype")
        return TensorSlot(t[0], t[1], tuple(t[2]), t[3])

    def placement(self, blocks: dict[tuple[int, int], Block], data_bytes: int) -> None:
        """Each block where packing puts it: in (layer, expert) order, each at the end of the
        one before rounded up to ALIGN, the data ending with the last (module docstring)."""
        end = 0
        for b in (blocks[key] for key in sorted(blocks)):
            if b.offset != end:
                raise self.fail(f"layer {b.layer}, expert {b.expert}", f"offset {b.offset}, "
                                f"where packing puts this block at {end}")
            end = -(-(b.offset + b.nbytes) // ALIGN) * ALIGN
        if end != data_bytes:
            raise self.fail("data_bytes", f"{data_bytes}, but the blocks end at {end}")
        self.layouts(blocks)

    def extent_placement(self, blocks: dict[tuple[int, int], Block], data_bytes: int) -> None:
        """No two extents share a checkpoint byte; the blocks add up to ``data_bytes``."""
        pieces = sorted(((e, b) for b in blocks.values() for e in b.extents), key=lambda p: p[0])
        for (a, _), (e, b) in itertools.pairwise(pieces):
            if e.file == a.file and e.offset < a.offset + a.nbytes:
                raise self.fail(f"layer {b.layer}, expert {b.expert}", f"bytes from "
                                f"{e.offset} of checkpoint file {e.file} overlap another "
                                "block's")
        total = sum(b.nbytes for b in blocks.values())
        if total != data_bytes:
            raise self.fail("data_bytes", f"{data_bytes}, but the blocks hold {total}")
        self.layouts(blocks)

    def layouts(self, blocks: dict[tuple[int, int], Block]) -> None:
        """Each layer has one tensor layout (its caches have one)."""
        for (layer, expert), b in blocks.items():
            if b.tensors != blocks[(layer, 0)].tensors:
                raise self.fail(f"layer {layer}, expert {expert}",
                                "tensors differ from the layer's expert 0")


def slot_bytes(t: TensorSlot) -> int:
    return math.prod(t.shape) * DTYPE_SIZES[t.dtype]


def _block_json(b: Block) -> dict[str, Any]:
    where: dict[str, Any] = ({"extents": [list(e) for e in b.extents]} if b.extents
                             else {"offset": b.offset})
    return {"layer": b.layer, "expert": b.expert, **where, "nbytes": b.nbytes,
            "crc32c": b.crc32c, "tensors": [[t.name, t.dtype, list(t.shape), t.offset]
                                          for t in b.tensors]}
