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
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.predictors.base import ModelShape, PredictorError
from stmoe.predictors.kernels import CONF_NEW
from stmoe.predictors.tables_check import (
    TABLES_FORMAT,
    TABLES_VERSION,
    check_arrays,
    check_cct,
    check_domains,
    check_info,
    check_profiled_tokens,
    header_dims,
    max_bytes,
    read_header,
)
from stmoe.trace.checks import model_layer_ids
from stmoe.trace.io import read_npz_arrays
from stmoe.trace.schema import _CHUNK_TOKENS, RoutingTrace
from stmoe.util.fileio import atomic_write, check_input_file

__all__ = ["PROFILED_TOKENS_MAX", "RECENT_TOKENS", "TABLES_FORMAT", "TABLES_VERSION",
           "ProfiledTables", "cct_from_counts", "check_cct", "cooccurrence", "load_tables",
           "save_tables"]
RECENT_TOKENS = 1024  # profiled tokens kept for stmoe-plus's token memory (its ring size)
# the most profiled tokens' digests kept (16 MiB); beyond, a sample by digest value
PROFILED_TOKENS_MAX = 1 << 21


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
    # [P] uint64, sorted, unique: the profiled tokens' ``token_digests`` (those whose lowest
    # info["token_sample_bits"] bits are 0: all of them up to PROFILED_TOKENS_MAX), so a
    # replay can say which of its tokens were profiled (cli.table_notes); None in older files
    profiled_tokens: np.ndarray | None = None
    per_domain: dict[str, ProfiledTables] | None = None  # tables of each domain (stmoe-mix)
    source: str | None = None  # the file (and domain) read from, for messages; not saved

    @property
    def row_width(self) -> int:
        return int(self.cct_ids.shape[2])

    def check_fits(self, shape: ModelShape, where: str = "tables") -> None:
        """Refuse tables profiled for another model shape."""
        if shape != self.shape:
            raise PredictorError(
                f"{self.source or where}: profiled for {self.shape.describe()} but the "
                f"trace or model has {shape.describe()}; profile tables on a trace of this "
                "model"
            )

    def check_trace(self, trace: RoutingTrace) -> None:
        """Refuse tables that do not fit ``trace``: another model shape, or the same shape
        profiled on other MoE layers of the model (``profile --layers 12:24`` tables
        replayed on layers 0-11 would predict one cut's routing from another's, with no
        error). Tables without the record (older files) are checked by shape only."""
        self.check_fits(ModelShape.of(trace))
        profiled = self.info.get("model_layer_ids")
        replayed = model_layer_ids(trace)
        if profiled is not None and list(profiled) != replayed:
            raise PredictorError(
                f"{self.source or 'tables'}: profiled on the model's MoE layers "
                f"{layer_span(profiled)} but the trace replays layers {layer_span(replayed)}; "
                "profile and replay the same layers (the same --layers)"
            )


def layer_span(ids: list[int]) -> str:
    """``12-23`` for a run of layer numbers, else the list."""
    ids = [int(i) for i in ids]
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


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
              "cooccurrence": tables.cooccurrence, "layer_counts": tables.layer_counts}
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
    if tables.profiled_tokens is not None:  # (the whole tables' only, not a domain's)
        arrays["profiled_tokens"] = tables.profiled_tokens
    for i, (_, t) in enumerate(domains):
        arrays.update(_arrays(t, f"domain{i}/"))
    atomic_write(
        path, lambda f: np.savez_compressed(f, header=np.array(json.dumps(header)), **arrays)
    )
    return path


def load_tables(path: str | Path) -> ProfiledTables:
    """Read tables written by ``save_tables``, every field checked (``tables_check``)
    before a predictor's compiled kernels can see it; one clear line otherwise."""
    path = Path(path)
    if not path.exists():
        raise PredictorError(f"{path}: no such tables file (write one with `stmoe profile`)")
    check_input_file(path, "a tables file (write one with `stmoe profile`)")
    where = str(path)
    try:  # the header first: the sizes it declares bound what the arrays may take
        header = read_header(read_npz_arrays(path, mmap=False, only=("header",)).get("header"),
                             where)
        dims = header_dims(header, where)
        domains = check_domains(header.get("per_domain", []), where)
        arrays = read_npz_arrays(path, mmap=False,
                                 max_total=max_bytes(dims, len(domains), RECENT_TOKENS)
                                 + 8 * PROFILED_TOKENS_MAX)
    except (zlib.error, NotImplementedError, RuntimeError) as exc:  # damaged, odd or encrypted
        raise PredictorError(f"{where}: not a readable tables file ({exc})") from None
    info = check_info(header.get("info", {}), dims.shape.num_layers, where)
    tables = _tables_from(check_arrays(arrays, dims, where), dims.shape, info, where)
    tables = dataclasses.replace(tables, profiled_tokens=check_profiled_tokens(
        arrays.get("profiled_tokens"), PROFILED_TOKENS_MAX, where))
    per_domain = {}
    for i, (name, domain_info) in enumerate(domains):
        field_ = f"per_domain[{i}]"
        domain_info = check_info(domain_info, dims.shape.num_layers, where, f"{field_}.info")
        part = check_arrays(arrays, dims, where, prefix=f"domain{i}/")
        per_domain[name] = _tables_from(part, dims.shape, domain_info, f"{where}: domain {name!r}")
    if per_domain:
        tables = dataclasses.replace(tables, per_domain=per_domain)
    return tables


def _tables_from(arrays: dict[str, np.ndarray | None], shape: ModelShape, info: dict[str, Any],
                 source: str) -> ProfiledTables:
    return ProfiledTables(shape=shape, cct_ids=arrays["cct_ids"], cct_conf=arrays["cct_conf"],
                          cooccurrence=arrays["cooccurrence"], layer_counts=arrays["layer_counts"],
                          info=info, pair_counts=arrays["pair_counts"],
                          temporal=arrays["temporal"], recent=arrays["recent"],
                          source=source)  # type: ignore[arg-type]
