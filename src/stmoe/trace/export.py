"""Writers for foreign formats, so traces travel to tools that don't read ``.npz``.

The native format (``io.save_trace``) is the one lossless format; these exports
carry what their format can (JSON Lines: all but token ids; npy: expert ids and
sequence starts only; vllm and sglang: the engines' response layouts, see
``engines.writers``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.engines.writers import export_sglang, export_vllm
from stmoe.trace.schema import RoutingTrace
from stmoe.util.progress import progress

EXPORT_FORMATS = ("jsonl", "npy", "vllm", "sglang")


def export_jsonl(trace: RoutingTrace, path: str | Path) -> Path:
    """A metadata line, then one record per (token, layer) with weights, phase and domain."""
    path = Path(path)
    seq_of = trace.sequence_of_token()
    starts = np.asarray(trace.seq_starts)
    weights = None if trace.weights is None else np.asarray(trace.weights)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"meta": trace.meta.to_dict()}) + "\n")
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
                f.write(json.dumps(rec) + "\n")
    return path


def export_npy(trace: RoutingTrace, path: str | Path) -> Path:
    """The ``[T, L, K]`` expert array plus a ``.seq_starts.npy`` side file beside it."""
    path = Path(path)
    with open(path, "wb") as f:  # np.save(path) would append ".npy" to other names
        np.save(f, np.asarray(trace.experts, dtype=np.int16))
    np.save(path.with_suffix(".seq_starts.npy"), np.asarray(trace.seq_starts, dtype=np.int64))
    return path


def export_trace(trace: RoutingTrace, path: str | Path, format: str) -> Path:
    if format == "jsonl":
        return export_jsonl(trace, path)
    if format == "npy":
        return export_npy(trace, path)
    if format == "vllm":
        return export_vllm(trace, path)
    if format == "sglang":
        return export_sglang(trace, path)
    raise TraceError(f"unknown export format {format!r}", expected=f"one of {EXPORT_FORMATS}")
