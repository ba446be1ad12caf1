"""Checked reading of ``.npy`` and ``.npz`` files: sizes before memory, checksums before trust.

numpy believes a file's header: a flipped byte in a ``.npy`` shape, or a small
zip whose directory promises gigabytes, costs that memory (or a MemoryError)
before anything is checked, and a shape smaller than the data silently reads the
wrong values. Here every declared size is checked first, against the other
declarations and the file's own size, and only then is anything allocated:

- a ``.npy``: header length + shape x itemsize == the file's size, exactly;
- an ``.npz`` member: the zip directory's uncompressed size == its ``.npy``
  header + shape x itemsize, and its data lies inside the file;
- a whole ``.npz``: the members' uncompressed sizes add up to at most
  ``RATIO_MAX`` times the file's size (or ``UNCOMPRESSED_FREE``, whichever is
  larger). Routing ids compress 2-5x and sparse masks maybe 20x; deflate reaches
  about 1000x only on near-constant data, which is what a decompression bomb is.

Every member's zip CRC-32 is verified, memory-mapped members included (a ``.npy``
has no checksum, so a flipped id there can pass: docs/trace-format.md).
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from stmoe.errors import TraceError

RATIO_MAX = 100  # uncompressed bytes per byte of the .npz file, over all its members
UNCOMPRESSED_FREE = 64 << 20  # a total below this is accepted at any ratio
_HEADER_MAX = 1 << 16  # numpy's own limit for a .npy header is 10,000 bytes
_CHUNK = 16 << 20  # bytes read (and checksummed) at a time
_MMAP_MIN_BYTES = 1 << 20  # members smaller than this are read whole: mapping saves nothing
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # zip local file header, 30 bytes
_ZIP_MAGIC = b"PK\x03\x04"
# What a damaged zip raises from inside zipfile or a decompressor.
ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, RuntimeError,
               NotImplementedError, struct.error, OverflowError, IndexError)


@dataclass(frozen=True)
class NpyHeader:
    """A ``.npy`` header: what the data after it must be."""

    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    offset: int  # bytes from the start of the .npy to its data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def short(exc: BaseException) -> str:
    """An exception's text on one short line (numpy quotes whole headers)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def read_npy_header(f: BinaryIO) -> NpyHeader:
    """Parse a ``.npy`` header at ``f``'s position; ``ValueError`` when it is not one."""
    start = f.tell()
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, _HEADER_MAX)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, _HEADER_MAX)
        else:
            raise ValueError(f".npy format version {version} is not supported")
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error):
        raise  # the stream's own errors (a zip member's checksum, its decompression)
    except Exception as exc:  # numpy's parser of untrusted text raises many kinds
        raise ValueError(f"unreadable .npy header ({type(exc).__name__}: {short(exc)})") from None
    if dtype.hasobject:
        raise ValueError("the array holds Python objects (pickles are never loaded)")
    if dtype.itemsize == 0 or any(n < 0 for n in shape):
        raise ValueError(f"shape {shape} of {dtype} is not an array's")
    return NpyHeader(tuple(int(n) for n in shape), bool(fortran), dtype, f.tell() - start)


def load_npy(path: Path, *, mmap: bool = False) -> np.ndarray:
    """A whole ``.npy`` file, its header checked against the file's size before reading."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = read_npy_header(f)
            _check_npy_size(head, size - head.offset)
            if mmap and head.nbytes:
                return np.memmap(path, dtype=head.dtype, mode="r", offset=head.offset,
                                 shape=head.shape, order="F" if head.fortran else "C")
            return _read_data(f, head)
    except (ValueError, EOFError, OSError) as exc:
        raise TraceError(f"not a readable .npy array ({short(exc)})", file=path,
                         expected="a plain numeric array",
                         hint=_TRUNCATED if _is_short(exc) else None) from None


def load_npy_bytes(raw: bytes) -> np.ndarray:
    """A ``.npy`` held in memory (an engine's base64 field); ``ValueError`` when damaged."""
    f = io.BytesIO(raw)
    head = read_npy_header(f)
    _check_npy_size(head, len(raw) - head.offset)
    return _read_data(f, head)


_TRUNCATED = "the file looks truncated"


def _is_short(exc: BaseException) -> bool:
    """The file holds less than its header promises."""
    return isinstance(exc, EOFError) or "fewer than declared" in str(exc)


def _check_npy_size(head: NpyHeader, available: int) -> None:
    if head.nbytes != available:
        short_by = "fewer" if available < head.nbytes else "more"
        raise ValueError(f"its header declares shape {head.shape} of {head.dtype} "
                         f"({head.nbytes} bytes) but {available} bytes remain "
                         f"({short_by} than declared)")


def _read_data(f: BinaryIO, head: NpyHeader) -> np.ndarray:
    """The array after a checked header, read in chunks (no second copy of the bytes)."""
    flat = np.empty(math.prod(head.shape), dtype=head.dtype)
    view = memoryview(flat).cast("B") if flat.nbytes else memoryview(b"")
    done = 0
    while done < len(view):
        chunk = f.read(min(_CHUNK, len(view) - done))
        if not chunk:
            raise EOFError(f"the data ends after {done} of {len(view)} bytes")
        view[done : done + len(chunk)] = chunk
        done += len(chunk)
    if head.fortran:
        return flat.reshape(head.shape[::-1]).transpose()
    return flat.reshape(head.shape)


def read_npz_arrays(
    path: Path, *, mmap: bool, known: Collection[str] | None = None,
    only: Collection[str] | None = None, max_total: int = 0,
) -> dict[str, np.ndarray]:
    """Every member of an ``.npz`` as an array, each size checked before it is read.

    ``mmap`` maps stored (uncompressed) members of 1 MiB or more instead of reading
    them; ``known`` lists the only member names allowed (others are refused unread);
    ``only``: read just these members (those present). ``max_total``: the uncompressed
    bytes the caller knows its format may hold, from sizes it has already checked (a
    tables file's header: its arrays are mostly zeros, far beyond ``RATIO_MAX``);
    accepted beyond the ratio, up to that.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            infos = _checked_directory(zf, path, known, only, max_total)
            return {name: _member(zf, info, name, path, mmap) for name, info in infos.items()}
    except TraceError:
        raise
    except ZIP_ERRORS as exc:
        raise TraceError(f"not a readable .npz file ({short(exc)})", file=path,
                         hint="the file may be truncated or corrupt") from None


def _checked_directory(
    zf: zipfile.ZipFile, path: Path, known: Collection[str] | None,
    only: Collection[str] | None = None, max_total: int = 0,
) -> dict[str, zipfile.ZipInfo]:
    """The members by array name, once the directory's sizes are judged plausible."""
    size = os.stat(path).st_size
    infos: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        name = info.filename.removesuffix(".npy")
        if not info.filename.endswith(".npy") or (known is not None and name not in known):
            expected = "only .npy members" if known is None else f"members {', '.join(known)}"
            tables = name in ("header", "cct_ids")  # (save_tables' members)
            raise TraceError(f"unexpected member {info.filename!r}", file=path, expected=expected,
                             hint="this is a tables file (`stmoe profile` writes them), not a "
                             "routing trace" if tables else "the file is damaged or not this "
                             "format")
        if name in infos:
            raise TraceError(f"member {info.filename!r} appears twice", file=path,
                             expected="one member per array")
        if info.header_offset + info.compress_size > size or (
            info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size
        ):
            raise TraceError(f"array {name!r} lies outside the file or its sizes disagree",
                             file=path, hint=_TRUNCATED)
        infos[name] = info
    _check_tiling(path, infos, getattr(zf, "start_dir", None))
    if only is not None:
        infos = {name: info for name, info in infos.items() if name in only}
    total = sum(i.file_size for i in infos.values())
    if total > max(UNCOMPRESSED_FREE, RATIO_MAX * size, max_total):
        raise TraceError(
            f"the arrays would take {total} bytes uncompressed, {total // max(size, 1)} "
            f"times the file's {size} bytes",
            file=path,
            expected=f"at most {RATIO_MAX} times the file's size (routing compresses far less)",
            hint="the file is damaged or a decompression bomb; it was not decompressed",
        )
    return infos


def _check_tiling(path: Path, infos: dict[str, zipfile.ZipInfo], end: int | None) -> None:
    """The members lie end to end from byte 0 up to the zip directory, nothing between.

    A damaged directory can skip entries (a length field that swallows the next ones)
    and a bomb can point several entries at the same bytes; in both the members no
    longer tile the file. (A member written to a stream is followed by a 12 to 24 byte
    data descriptor.)
    """
    at, after = 0, (0,)  # the gaps allowed after the previous member
    with open(path, "rb") as f:
        for info in sorted(infos.values(), key=lambda i: i.header_offset):
            if info.header_offset - at not in after:
                break
            f.seek(info.header_offset)
            fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            at = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
            at += info.compress_size
            after = (0, 12, 16, 20, 24) if info.flag_bits & 0x08 else (0,)
        else:
            if end is None or end - at in after:
                return
    raise TraceError("the zip directory does not account for every member", file=path,
                     expected="members end to end, each listed once",
                     hint="the file is damaged; write it again")


def _member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, path: Path,
            mmap: bool) -> np.ndarray:
    """One member, its .npy header checked against the directory before its data is read."""
    compressed = info.compress_type != zipfile.ZIP_STORED
    try:
        if mmap and not compressed and info.file_size >= _MMAP_MIN_BYTES:
            return _map_member(path, info)
        with zf.open(info) as f:
            head = read_npy_header(f)
            _check_npy_size(head, info.file_size - head.offset)
            arr = _read_data(f, head)
            if f.read(1):  # also makes zipfile compare the CRC-32 at the end
                raise ValueError("data after the array")
            return arr
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError) as exc:
        what = "compressed array" if compressed else "array"
        raise TraceError(f"damaged {what} {name!r} ({short(exc)})", file=path,
                         hint="the file is corrupt or truncated; write it again"
                         ) from None


def _map_member(path: Path, info: zipfile.ZipInfo) -> np.ndarray:
    """Memory-map a stored member after checking its header, sizes and CRC-32.

    The checksum reads the member once (validation reads it anyway); the array stays
    mapped, not copied into memory.
    """
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
        if fields[0] != _ZIP_MAGIC:
            raise ValueError("bad zip local header")
        start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        f.seek(start)
        crc, left = 0, info.file_size
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise EOFError("the member ends early")
            crc, left = zlib.crc32(chunk, crc), left - len(chunk)
        if crc != info.CRC:
            raise zipfile.BadZipFile("its CRC-32 does not match")
        f.seek(start)
        head = read_npy_header(f)
    _check_npy_size(head, info.file_size - head.offset)
    if head.nbytes == 0:  # nothing to map (and mmap refuses an empty range)
        return np.empty(head.shape, dtype=head.dtype)
    return np.memmap(path, dtype=head.dtype, mode="r", offset=start + head.offset,
                     shape=head.shape, order="F" if head.fortran else "C")
