"""MoE-Infinity's expert-drop trace (``benchmarks/expert_drop``): the ``MOEDROPT`` binary
and the compressed ``.npz`` its parser flattens it into.

Binary (little-endian), written by ``ExpertDispatcher::DumpExpertDropTrace``: magic
``MOEDROPT``, int32 version, E, L, reserved, int64 record count, int64 byte sizes
``[L * E]``, then per record int64 seq, int32 layer, int32 rows, uint8
residency-known, f32 weights ``[rows * E]``, u8 mask ``[rows * E]``, u8 resident ``[E]``.
The ``.npz`` keeps decode records only: ``weights``/``mask``/``resident`` ``[R, E]``,
``layer``/``seq`` ``[R]``, ``byte_size`` and scalars. A record is one (forward pass,
layer); its routed experts are the mask's, ordered by weight. Records are grouped into
passes as MoE-Infinity's ``cost_model.group_steps`` does: in ``seq`` order, a new pass
where the layer does not increase. A pass with several rows is a prompt (prefill),
which starts a new sequence; one-row passes are decode.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.assemble import agreed_num_experts, layer_numbering
from stmoe.trace.engines.common import EngineOptions, SequenceRouting, assemble, check_size

MAGIC = b"MOEDROPT"
NPZ_KEYS = {"weights", "mask", "layer", "seq"}
_HEADER = struct.Struct("<8siiiiq")

Record = tuple[int, int, np.ndarray, np.ndarray]  # seq, layer, weights [rows, E], mask


def read_binary(path: Path, opts: EngineOptions, num_experts: int | None):
    buf = path.read_bytes()
    check_size(_HEADER.size, len(buf), "the header")
    _, version, ne, nl, _, nrec = _HEADER.unpack_from(buf, 0)
    if not (0 < ne <= 1 << 15 and 0 < nl <= 1 << 16 and nrec >= 0):
        raise TraceError(f"the header says {ne} experts, {nl} layers, {nrec} records",
                         position="header", expected="positive sizes")
    off = _HEADER.size + nl * ne * 8  # byte sizes: not routing
    check_size(off, len(buf), f"byte_size [{nl} x {ne}]", "header")
    check_size(nrec * (17 + ne), len(buf) - off, f"{nrec} records", "header")
    records: list[Record] = []
    for i in range(nrec):
        where = f"record {i}"
        check_size(17, len(buf) - off, "a record header", where)
        seq, layer, rows = struct.unpack_from("<qii", buf, off)
        off += 17
        if rows < 0:
            raise TraceError(f"rows is {rows}", position=where, expected="rows >= 0")
        cells = rows * ne
        check_size(cells * 5 + ne, len(buf) - off, f"{rows} rows of {ne} experts", where)
        w = np.frombuffer(buf, "<f4", cells, off).reshape(rows, ne)
        m = np.frombuffer(buf, np.uint8, cells, off + cells * 4).reshape(rows, ne)
        off += cells * 5 + ne
        records.append(_checked((seq, layer, w, m), where))
    if off != len(buf):
        raise TraceError(f"{len(buf) - off} bytes after the last record", position="end",
                         expected=f"exactly {nrec} records")
    meta = {"source": f"imported from {path.name} (MoE-Infinity expert-drop trace v{version})",
            "file": str(path)}
    return _trace(records, opts, agreed_num_experts(num_experts, ne), meta)


def read_npz(arrays: dict[str, np.ndarray], path: Path, opts: EngineOptions,
             num_experts: int | None):
    w, m = np.asarray(arrays["weights"]), np.asarray(arrays["mask"])
    layer, seq = np.asarray(arrays["layer"]), np.asarray(arrays["seq"])
    n = len(layer)
    if w.ndim != 2 or m.shape != w.shape or len(w) != n or seq.shape != (n,):
        raise TraceError(f"weights {w.shape}, mask {m.shape}, layer {layer.shape}, "
                         f"seq {seq.shape}",
                         expected="weights and mask [R, E], layer and seq [R]")
    for name, arr in (("layer", layer), ("seq", seq)):
        if not np.issubdtype(arr.dtype, np.integer):  # int() would truncate 1.7 to layer 1
            raise TraceError(f"member {name!r} has dtype {arr.dtype}",
                             expected="integer layer numbers and sequence counters")
    records = [_checked((int(seq[i]), int(layer[i]), w[i : i + 1], m[i : i + 1]), f"record {i}")
               for i in range(n)]
    ne = w.shape[1]
    if "num_experts" in arrays:
        declared = np.asarray(arrays["num_experts"])
        if declared.shape != () or not np.issubdtype(declared.dtype, np.integer):
            raise TraceError(f"member 'num_experts' has shape {declared.shape}, dtype "
                             f"{declared.dtype}", expected="one integer")
        ne = int(declared)
    meta = {"source": f"imported from {path.name} (MoE-Infinity expert-drop trace)",
            "file": str(path)}
    return _trace(records, opts, agreed_num_experts(num_experts, ne), meta)


def _checked(record: Record, where: str) -> Record:
    """A record whose mask is 0/1 bytes and whose routed experts have finite weights: a
    NaN or -inf weight would sort its expert out of the routing, a mask byte of 200 be
    counted as 200 routed experts."""
    _, layer, w, m = record
    bad = (m != 0) & (m != 1)
    if bad.any():
        row, e = (int(i) for i in np.argwhere(bad)[0])
        raise TraceError(f"mask byte {m[row, e].item()!r} for expert {e}",
                         position=f"{where} (layer {layer}), row {row}",
                         expected="0 or 1, whether the expert is routed")
    with np.errstate(invalid="ignore"):
        bad = (m == 1) & ~np.isfinite(w)
    if bad.any():
        row, e = (int(i) for i in np.argwhere(bad)[0])
        raise TraceError(f"gate weight {float(w[row, e])} on routed expert {e}",
                         position=f"{where} (layer {layer}), row {row}",
                         expected="a finite gate weight for every expert the mask routes")
    return record


def _trace(records: list[Record], opts: EngineOptions, num_experts: int, meta: dict):
    if not records:
        raise TraceError("the trace holds no records", expected="at least one routed token")
    passes = _steps(records)
    mapping, layer_extra = layer_numbering(r[1] for r in records)
    k = max(int(m.sum(axis=1).max(initial=0)) for _, _, _, m in records)
    requests: list[SequenceRouting] = []
    blocks: list[tuple[np.ndarray, np.ndarray]] = []
    prompt = 0
    for recs in passes:
        rows = _pass_rows(recs[0][0], recs, mapping)
        if rows > 1 and blocks:
            requests.append(_request(blocks, prompt, len(requests), layer_extra))
            blocks = []
        if not blocks:
            prompt = rows if rows > 1 else 0
        blocks.append(_routing(recs, rows, mapping, k))
    requests.append(_request(blocks, prompt, len(requests), layer_extra))
    return assemble(requests, opts, num_experts, meta)


def _steps(records: list[Record]) -> list[list[Record]]:
    """The forward passes, as MoE-Infinity's own ``cost_model.group_steps`` reads them:
    records in ``seq`` order (stable), a new pass wherever the layer does not increase
    (``seq`` orders the records; it need not be one number per pass)."""
    order = sorted(range(len(records)), key=lambda i: records[i][0])
    steps: list[list[Record]] = []
    for i in order:
        if not steps or records[i][1] <= steps[-1][-1][1]:
            steps.append([])
        steps[-1].append(records[i])
    return steps


def _pass_rows(seq: int, recs: list[Record], mapping: dict[int, int]) -> int:
    layers = [r[1] for r in recs]
    rows = {len(r[2]) for r in recs}
    if sorted(layers) != sorted(mapping) or len(rows) != 1:
        missing = sorted(set(mapping) - set(layers))
        raise TraceError(f"step seq={seq} has layers {sorted(layers)} with rows {sorted(rows)}",
                         position=f"seq {seq}", expected=f"one record for each of layers "
                         f"{sorted(mapping)} (missing {missing}), equal rows")
    return rows.pop()


def _routing(recs: Iterable[Record], rows: int, mapping: dict[int, int], k: int):
    experts = np.full((rows, len(mapping), k), -1, dtype=np.int32)
    weights = np.zeros(experts.shape, dtype=np.float32)
    for _, layer, w, m in recs:
        masked = np.where(m > 0, w, -np.inf)
        order = np.argsort(-masked, axis=1, kind="stable")[:, :k]
        chosen = np.take_along_axis(m > 0, order, axis=1)
        experts[:, mapping[layer]] = np.where(chosen, order, -1)
        weights[:, mapping[layer]] = np.where(chosen, np.take_along_axis(w, order, axis=1), 0)
    return experts, weights


def _request(blocks: list, prompt: int, i: int, extra: dict) -> SequenceRouting:
    return SequenceRouting(np.concatenate([b[0] for b in blocks]), prompt,
                   weights=np.concatenate([b[1] for b in blocks]),
                   where=f"sequence {i}", extra=dict(extra))
