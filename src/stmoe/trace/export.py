"""Writers for foreign formats, so traces travel to tools that don't read ``.npz``.

The native format (``io.save_trace``) is the one lossless format; these exports
carry what their format can (JSON Lines: all but token ids; npy: expert ids and
sequence starts only, the manifest saying where rows are sets; vllm and sglang: the
engines' response layouts, see ``engines.writers``). Every export is written
atomically (``util.fileio``): a killed or failed export leaves the old file whole;
npy's two files switch as one, bound by a manifest (``NAME.manifest.json``) that the
npy reader checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.engines.writers import export_sglang, export_vllm
from stmoe.trace.ranks import RANK_ORDER, is_ranked
from stmoe.trace.schema import UNLABELLED, RoutingTrace
from stmoe.util.fileio import atomic_write, atomic_write_files
from stmoe.util.progress import progress

EXPORT_FORMATS = ("jsonl", "npy", "vllm", "sglang")


def export_jsonl(trace: RoutingTrace, path: str | Path) -> Path:
    """A metadata line, then one record per (token, layer) with weights, phase and domain."""
    return atomic_write(path, lambda f: _jsonl_lines(trace, f))


def _jsonl_lines(trace: RoutingTrace, f: BinaryIO) -> None:
    """The JSON Lines records, streamed to ``f`` (a trace of millions of token-layers)."""
    seq_of = trace.sequence_of_token()
    starts = np.asarray(trace.seq_starts)
    weights = None if trace.weights is None else np.asarray(trace.weights)
    f.write(json.dumps({"meta": trace.meta.to_dict()}).encode() + b"\n")
    for t in progress(range(trace.num_tokens), trace.num_tokens, "writing JSON Lines"):
        s = int(seq_of[t])
        base = {
            "seq": s,
            "token": int(t - starts[s]),
            "phase": "decode" if trace.is_decode[t] else "prefill",
            "domain": trace.domains[s],
        }
        for layer in range(trace.num_layers):
            rec = {**base, "layer": layer, "experts": trace.experts[t, layer].tolist()}
            if weights is not None:
                rec["weights"] = [float(w) for w in weights[t, layer]]
            f.write(json.dumps(rec).encode() + b"\n")


def export_npy(trace: RoutingTrace, path: str | Path) -> Path:
    """The ``[T, L, K]`` expert array plus a ``.seq_starts.npy`` side file beside it, and the
    manifest that binds the two (``NAME.manifest.json``), switched as one."""
    path = Path(path)
    experts = np.asarray(trace.experts, dtype=np.int16)
    starts = np.asarray(trace.seq_starts, dtype=np.int64)
    main, _ = atomic_write_files(  # np.save(path) would append ".npy" to other names
        [(path, lambda f: np.save(f, experts)),
         (path.with_suffix(".seq_starts.npy"), lambda f: np.save(f, starts))],
        manifest_path(path), None if is_ranked(trace) else {RANK_ORDER: False})
    return main


def manifest_path(path: Path) -> Path:
    """Where ``export_npy`` lists the files of one export (the npy reader checks it)."""
    return path.with_suffix(".manifest.json")


def export_losses(trace: RoutingTrace, format: str) -> list[str]:
    """What of ``trace`` a ``format`` export does not keep (the native file keeps all): said
    where the export is written, since an import of it then differs without an error
    (synthetic routing read back as real, tables of N experts refused by it)."""
    if format == "jsonl":
        kept = {"model", "synthetic", "experts", "weights", "phases", "domains"}
    elif format == "vllm":  # (each request's prompt length: in its token ids, or the usage)
        kept = {"model", "token ids"} | (
            {"phases"} if trace.token_ids is not None or trace.num_sequences == 1 else set())
    elif format == "sglang":
        kept = {"phases"}
    else:  # npy
        kept = set()
    used = int(np.asarray(trace.experts).max(initial=-1)) + 1
    labelled = any(d != UNLABELLED for d in trace.domains)
    has = {
        "model": ("the model name", bool(trace.meta.model)),
        "synthetic": ("the SYNTHETIC mark", trace.meta.synthetic),
        "experts": (f"the experts per layer (an import counts {used}, the highest id used + 1: "
                    f"give it --num-experts {trace.num_experts})", used < trace.num_experts),
        "weights": ("the gate weights", trace.weights is not None),
        "phases": ("which tokens are decode tokens", bool(np.asarray(trace.is_decode).any())),
        "domains": ("the domains", labelled),
        "token ids": ("the token ids", trace.token_ids is not None),
        "lookahead": ("the gate lookahead", trace.lookahead is not None),
    }
    return [what for key, (what, present) in has.items() if present and key not in kept]


def export_trace(trace: RoutingTrace, path: str | Path, format: str) -> Path:
    """``trace`` written as ``format`` (``EXPORT_FORMATS``), atomically."""
    if format == "jsonl":
        return export_jsonl(trace, path)
    if format == "npy":
        return export_npy(trace, path)
    if format == "vllm":
        return export_vllm(trace, path)
    if format == "sglang":
        return export_sglang(trace, path)
    raise TraceError(f"unknown export format {format!r}", expected=f"one of {EXPORT_FORMATS}")
