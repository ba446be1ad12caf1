"""Profiled tables (what ``profiling.profile`` learns), and the one file they live in.

Algorithm 1's cross-layer correlation table (CCT: for every adjacent layer pair
(l, l+1) and expert e at l, the ``row_width`` most frequent experts at l+1), the
full co-occurrence counts and each layer's expert frequencies (the frequency
baseline), and what stmoe-plus and hybrid use (pair counts up to D_MAX layers
apart, consecutive tokens, the last profiled tokens, the fit in
``info["plus"]``). ``save_tables`` / ``load_tables`` write and read them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.fileio import atomic_write
from stmoe.predictors.base import ModelShape, PredictorError
from stmoe.predictors.counting import D_MAX
from stmoe.predictors.kernels import CONF_NEW
from stmoe.trace.io import read_npz_arrays
from stmoe.trace.schema import _CHUNK_TOKENS, RoutingTrace

TABLES_FORMAT = "stmoe-tables"
TABLES_VERSION = 1
RECENT_TOKENS = 1024  # profiled tokens kept for stmoe-plus's token memory (its ring size)


@dataclass(frozen=True, eq=False)
class ProfiledTables:
    """What profiling learned about one model's routing."""

    shape: ModelShape
    cct_ids: np.ndarray  # [L-1, N, R] int16, candidates of layer l+1 per expert of l; -1 empty
    cct_conf: np.ndarray  # [L-1, N, R] int8, 2-bit confidences 0..3
    cooccurrence: np.ndarray  # [L-1, N, N] int64, co[l][e, f] counts of Algorithm 1
    layer_counts: np.ndarray  # [L, N] int64, tokens routed to each expert per layer
    info: dict[str, Any] = field(default_factory=dict)  # model, tokens, sources, domains
    # For the probabilistic predictors (stmoe-plus, hybrid); None in older files:
    pair_counts: np.ndarray | None = None  # [D, L-1, N, N]: e at l and f at l+d, d = 1..D
    temporal: np.ndarray | None = None  # [L, N, N]: e at l, then f at l in the next token
    recent: np.ndarray | None = None  # [M, L, K] int16: the last profiled tokens (token memory)
    per_domain: dict[str, ProfiledTables] | None = None  # tables of each domain (stmoe-mix)

    @property
    def row_width(self) -> int:
        return int(self.cct_ids.shape[2])

    def check_fits(self, shape: ModelShape, where: str = "tables") -> None:
        """Refuse tables profiled for another model shape."""
        if shape != self.shape:
            raise PredictorError(
                f"{where}: profiled for {self.shape.describe()} but the trace has "
                f"{shape.describe()}; profile tables on a trace of this model"
            )


def check_cct(ids: np.ndarray, conf: np.ndarray, num_experts: int, where: str = "tables") -> None:
    """Refuse a CCT the compiled kernels could not trust (they index by these ids)."""
    if not (np.issubdtype(ids.dtype, np.integer) and np.issubdtype(conf.dtype, np.integer)):
        raise PredictorError(f"{where}: CCT ids/confidences are not integers")
    bad = (ids < -1) | (ids >= num_experts)
    if bad.any():
        layer, e, s = (int(i) for i in np.argwhere(bad)[0])
        raise PredictorError(f"{where}: CCT[{layer}][{e}] slot {s} holds expert "
                             f"{int(ids[layer, e, s])}, "
                             f"expected -1..{num_experts - 1}")  # fmt: skip
    if ((conf < 0) | (conf > 3)).any():
        raise PredictorError(f"{where}: a CCT confidence lies outside 0..3 (2-bit counters)")
    ordered = np.sort(ids, axis=2)
    if ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any():
        raise PredictorError(f"{where}: a CCT row holds the same expert twice")


def cooccurrence(trace: RoutingTrace) -> np.ndarray:
    """[L-1, N, N] int64: co[l][e, f] = tokens choosing e at l and f at l+1."""
    n, n_layers = trace.num_experts, trace.num_layers
    co = np.zeros((max(n_layers - 1, 0), n * n), dtype=np.int64)
    for a in range(0, trace.num_tokens, _CHUNK_TOKENS):
        block = np.asarray(trace.experts[a : a + _CHUNK_TOKENS], dtype=np.int64)
        for layer in range(n_layers - 1):
            e, f = block[:, layer, :, None], block[:, layer + 1, None, :]
            valid = (e >= 0) & (f >= 0)
            co[layer] += np.bincount((e * n + f)[valid], minlength=n * n)
    return co.reshape(-1, n, n)


def cct_from_counts(co: np.ndarray, row_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1's table from counts: top ``row_width`` per row, ties to the smaller id."""
    order = np.argsort(-co, axis=2, kind="stable")[:, :, :row_width]  # stable: smaller id first
    top = np.take_along_axis(co, order, axis=2)
    ids = np.where(top > 0, order, -1).astype(np.int16)
    conf = np.where(top > 0, CONF_NEW, 0).astype(np.int8)
    return ids, conf


def _arrays(tables: ProfiledTables, prefix: str = "") -> dict[str, np.ndarray]:
    arrays = {"cct_ids": tables.cct_ids, "cct_conf": tables.cct_conf,
              "cooccurrence": tables.cooccurrence, "layer_counts": tables.layer_counts}  # fmt: skip
    for name in ("pair_counts", "temporal", "recent"):
        if getattr(tables, name) is not None:
            arrays[name] = getattr(tables, name)
    return {prefix + k: v for k, v in arrays.items()}


def save_tables(tables: ProfiledTables, path: str | Path) -> Path:
    """Write tables (and any per-domain tables) to one versioned, compressed ``.npz``
    (atomically); a domain's arrays are stored under ``domain<i>/``."""
    path = Path(path)
    domains = list((tables.per_domain or {}).items())
    header = {
        "format": TABLES_FORMAT,
        "version": TABLES_VERSION,
        "num_layers": tables.shape.num_layers,
        "num_experts": tables.shape.num_experts,
        "top_k": tables.shape.top_k,
        "row_width": tables.row_width,
        "info": tables.info,
        "per_domain": [{"domain": d, "info": t.info} for d, t in domains],
    }
    arrays = _arrays(tables)
    for i, (_, t) in enumerate(domains):
        arrays.update(_arrays(t, f"domain{i}/"))
    atomic_write(
        path, lambda f: np.savez_compressed(f, header=np.array(json.dumps(header)), **arrays)
    )
    return path


def load_tables(path: str | Path) -> ProfiledTables:
    """Read tables written by ``save_tables``; clear errors for other or damaged files."""
    path = Path(path)
    if not path.exists():
        raise PredictorError(f"{path}: no such tables file (write one with `stmoe profile`)")
    arrays = read_npz_arrays(path, mmap=False)
    try:
        header = json.loads(str(arrays["header"][()]))
    except (KeyError, json.JSONDecodeError):
        raise PredictorError(f"{path}: not an stmoe tables file (no valid header)") from None
    if header.get("format") != TABLES_FORMAT:
        raise PredictorError(
            f"{path}: not an stmoe tables file (format {header.get('format')!r}, expected "
            f"{TABLES_FORMAT!r}); write tables with `stmoe profile`"
        )
    if not isinstance(header.get("version"), int) or header["version"] > TABLES_VERSION:
        raise PredictorError(
            f"{path}: tables version {header.get('version')!r} is newer than this stmoe "
            f"reads ({TABLES_VERSION}); upgrade stmoe"
        )
    shape = ModelShape(header["num_layers"], header["num_experts"], header["top_k"])
    tables = _tables_from(arrays, shape, header["row_width"], header.get("info", {}), path)
    per_domain = {}
    for i, entry in enumerate(header.get("per_domain", [])):
        part = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(f"domain{i}/")}
        if not isinstance(entry, dict) or "domain" not in entry or not part:
            raise PredictorError(f"{path}: per-domain tables {i} are incomplete")
        per_domain[str(entry["domain"])] = _tables_from(part, shape, header["row_width"],
                                                        entry.get("info", {}), path)  # fmt: skip
    if per_domain:
        tables = dataclasses.replace(tables, per_domain=per_domain)
    return tables


def _tables_from(arrays: dict, shape: ModelShape, row_width: int, info: dict,
                 path: Path) -> ProfiledTables:  # fmt: skip
    missing = [k for k in ("cct_ids", "cct_conf", "cooccurrence", "layer_counts")
               if k not in arrays]  # fmt: skip
    if missing:
        raise PredictorError(f"{path}: not an stmoe tables file (no {missing[0]})")
    ids, conf = arrays["cct_ids"], arrays["cct_conf"]
    want = (max(shape.num_layers - 1, 0), shape.num_experts, row_width)
    if ids.shape != want or conf.shape != want:
        raise PredictorError(f"{path}: CCT has shape {ids.shape}, expected {want}")
    check_cct(ids, conf, shape.num_experts, str(path))
    return ProfiledTables(
        shape=shape,
        cct_ids=ids.astype(np.int16),
        cct_conf=conf.astype(np.int8),
        cooccurrence=arrays["cooccurrence"],
        layer_counts=arrays["layer_counts"],
        info=info,
        pair_counts=_optional(
            arrays, "pair_counts", (D_MAX, want[0], shape.num_experts, shape.num_experts), path
        ),
        temporal=_optional(
            arrays, "temporal", (shape.num_layers, shape.num_experts, shape.num_experts), path
        ),
        recent=_recent(arrays, shape, path),
    )


def _recent(arrays: dict, shape: ModelShape, path: Path) -> np.ndarray | None:
    a = arrays.get("recent")
    if a is None:
        return None
    if (
        a.ndim != 3
        or a.shape[1:] != (shape.num_layers, shape.top_k)
        or (a.size and (a.min() < -1 or a.max() >= shape.num_experts))
    ):
        raise PredictorError(f"{path}: 'recent' has shape {a.shape} or ids out of range")
    return a.astype(np.int16)


def _optional(arrays: dict, key: str, want: tuple[int, ...], path: Path) -> np.ndarray | None:
    """An optional count array, checked against the model shape."""
    a = arrays.get(key)
    if a is None:
        return None
    want = (want[0], max(want[1], 1), *want[2:]) if key == "pair_counts" else want
    if a.shape != want or not np.issubdtype(a.dtype, np.number):
        raise PredictorError(f"{path}: {key} has shape {a.shape}, expected {want}")
    return a
