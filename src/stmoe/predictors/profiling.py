"""Profiling: docs/method.md's Algorithm 1, and what the richer predictors learn.

``profile(traces)`` counts, for every adjacent layer pair (l, l+1), how often
expert e at l co-occurs with expert f at l+1 in the same token, and keeps for each
e the ``row_width`` most frequent f (ties to the smaller id, counts > 0) at
confidence 2: the cross-layer correlation table (CCT). The full co-occurrence
counts and each layer's expert frequencies are kept too, for the frequency
baseline and for richer predictors. It lives apart from ``tables`` (the tables
and their file) because it calls stmoe-plus's fit, which itself reads tables:
tables -> nothing of stmoe-plus; plus -> tables; profiling -> both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.predictors.base import ModelShape, PredictorError
from stmoe.predictors.counting import D_MAX, layer_tokens, pair_counts
from stmoe.predictors.plus.fitting import fit_weights
from stmoe.predictors.tables import (
    PROFILED_TOKENS_MAX,
    RECENT_TOKENS,
    ProfiledTables,
    cct_from_counts,
    cooccurrence,
    layer_span,
)
from stmoe.trace.checks import model_layer_ids
from stmoe.trace.ranks import as_sets, sequence_digests, token_digests
from stmoe.trace.schema import RoutingTrace
from stmoe.trace.summary import expert_load
from stmoe.util.cgroup import available_memory


def profile(
    traces: RoutingTrace | Sequence[RoutingTrace],
    row_width: int | None = None,
    fit_plus: bool = True,
    by_domain: bool = False,
) -> ProfiledTables:
    """Algorithm 1 over one or more traces of the same model; ``row_width`` defaults to K.

    Also counts what stmoe-plus and hybrid use (pairs of layers up to 4 apart,
    consecutive tokens) and, with ``fit_plus``, chooses their signal weights on a
    held-back tail of these same traces. ``by_domain`` adds tables of each domain
    (for stmoe-mix)."""
    traces = [traces] if isinstance(traces, RoutingTrace) else list(traces)
    # rows that are sets in their canonical order: the counts never read rank, and so the
    # tables' token memory and stmoe-plus's fit are functions of the sets too
    traces = [as_sets(t) for t in traces]
    if not traces:
        raise TraceError("nothing to profile", expected="at least one trace")
    shape = ModelShape.of(traces[0])
    for i, t in enumerate(traces[1:], start=1):
        if ModelShape.of(t) != shape:
            raise PredictorError(
                f"trace {i} has {ModelShape.of(t).describe()} but trace 0 has {shape.describe()}"
            )
        if model_layer_ids(t) != model_layer_ids(traces[0]):
            raise PredictorError(
                f"trace {i} holds the model's MoE layers {layer_span(model_layer_ids(t))} but "
                f"trace 0 holds {layer_span(model_layer_ids(traces[0]))}; profile one cut of "
                "the model's layers at a time"
            )
    width = shape.top_k if row_width is None else int(row_width)
    if not 1 <= width <= shape.num_experts:
        raise PredictorError(f"row width {width}: expected 1..{shape.num_experts}")
    check_table_memory(shape)
    co = sum(cooccurrence(t) for t in traces)
    ids, conf = cct_from_counts(co, width)
    counted = [pair_counts(t) for t in traces]
    pairs = sum(c[0] for c in counted).astype(np.int64)
    temporal = sum(c[1] for c in counted).astype(np.int64)
    extra: dict[str, Any] = {
        "layer_tokens": sum(layer_tokens(t) for t in traces).tolist(),
    }
    if fit_plus:  # (the tables file keeps the fit as a plain dict: PlusFit.to_dict)
        extra["plus"] = fit_weights(traces[-1]).to_dict()
    profiled, extra["token_sample_bits"] = _profiled_tokens(traces)
    return ProfiledTables(
        shape=shape,
        cct_ids=ids,
        cct_conf=conf,
        cooccurrence=co,
        layer_counts=sum(expert_load(t) for t in traces),
        info={
            "model": traces[0].meta.model,
            "tokens": int(sum(t.num_tokens for t in traces)),
            "sources": [t.meta.source for t in traces],
            "domains": sorted({d for t in traces for d in t.domains}),
            "synthetic": any(t.meta.synthetic for t in traces),
            # each profiled sequence's digest: a replay of one is in-sample (cli.table_notes)
            "sequences": sorted({d for t in traces for d in sequence_digests(t)}),
            # the model's MoE layers profiled: replaying other layers is refused (check_trace)
            "model_layer_ids": model_layer_ids(traces[0]),
            **extra,
        },
        pair_counts=pairs,
        temporal=temporal,
        per_domain=_per_domain(traces, width, fit_plus) if by_domain else None,
        recent=np.concatenate([np.asarray(t.experts) for t in traces])[-RECENT_TOKENS:].astype(
            np.int16
        ),
        profiled_tokens=profiled,
    )


def _profiled_tokens(traces: Sequence[RoutingTrace]) -> tuple[np.ndarray, int]:
    """The profiled tokens' digests (``token_digests``: sorted, unique) and the bits of the
    sample kept: all of them up to PROFILED_TOKENS_MAX, else those whose lowest ``bits``
    bits are 0 (a sample by digest value: a replay samples its own tokens the same way)."""
    digests = np.unique(np.concatenate([token_digests(t) for t in traces]))
    bits = 0
    while len(digests) > PROFILED_TOKENS_MAX:
        bits += 1
        digests = digests[digests & np.uint64((1 << bits) - 1) == 0]
    return digests, bits


def table_bytes(shape: ModelShape) -> int:
    """A floor on profiling's peak memory: the N x N counts held at once (Algorithm 1's
    int64 co-occurrence, float64 pairs up to D_MAX layers apart and consecutive tokens),
    which grow with N squared (32767 experts and 2 layers: 56 GiB)."""
    n, layers = shape.num_experts, shape.num_layers
    return 8 * n * n * ((D_MAX + 1) * max(layers - 1, 1) + layers)


# profiling's peak over ``table_bytes``: the counts' temporaries (negated copies, argsort
# results, float conversions); measured 3.7x-4.9x at N = 1024-2048 (2026-12-06, ru_maxrss)
PEAK_FACTOR = 4


def check_table_memory(shape: ModelShape) -> None:
    """Refuse, before anything N x N is allocated, tables that cannot fit in memory: a
    declared N of 32767 is a valid trace but its counts would not fit most machines. The
    need is the peak (``PEAK_FACTOR`` times the counts), so that a trace that passes does
    not end in the kernel's out-of-memory kill instead."""
    counts, have = table_bytes(shape), available_memory()
    need = PEAK_FACTOR * counts
    if need > have:
        raise PredictorError(
            f"profiling {shape.describe()} needs about {need / 2**30:.1f} GiB at its peak "
            f"({counts / 2**30:.1f} GiB of N x N count tables and their temporaries), but "
            f"{have / 2**30:.1f} GiB of memory is available; "
            "expected tables that fit: profile fewer layers (--layers A:B) or on a machine "
            "with more memory")


def _per_domain(traces: list[RoutingTrace], width: int, fit_plus: bool
                ) -> dict[str, ProfiledTables]:
    from stmoe.trace import concat, select_domain

    names = list(dict.fromkeys(d for t in traces for d in t.domains))
    if len(names) < 2:
        raise TraceError(f"profiling by domain needs at least 2 domains, the traces have {names}",
                         hint="label sequences with --domain when importing")
    out = {}
    for d in names:
        parts = [select_domain(t, d) for t in traces if d in t.domains]
        out[d] = profile(concat(parts, drop_partial=True), width, fit_plus)
    return out
