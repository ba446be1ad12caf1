"""Whether a trace's rows are in rank order survives every way a trace travels (join, npy,
SGLang, JSON Lines), and the canonical order of set rows (``stmoe.trace.ranks``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stmoe.errors import TraceError
from stmoe.trace import concat, import_file, save_trace, summarize, synthesize
from stmoe.trace.engines.common import EngineOptions
from stmoe.trace.export import export_trace
from stmoe.trace.ranks import as_sets, is_ranked, require_ranked, set_order


def unranked(trace):
    """``trace`` marked as an importer marks a source that keeps sets only."""
    meta = dataclasses.replace(trace.meta, extra={**trace.meta.extra, "rank_order": False})
    return dataclasses.replace(trace, meta=meta, weights=None)


def test_the_canonical_order_is_ascending_ids_empty_slots_last():
    rows = np.array([[[5, -1, 2, 9]], [[-1, -1, 3, 0]]], dtype=np.int16)
    weights = np.array([[[0.1, 0.0, 0.7, 0.2]], [[0.0, 0.0, 0.4, 0.6]]], dtype=np.float32)
    ids, w = set_order(rows)
    assert ids.tolist() == [[[2, 5, 9, -1]], [[0, 3, -1, -1]]] and w is None
    ids, w = set_order(rows, weights)  # each weight stays with its id
    assert ids.tolist() == [[[2, 5, 9, -1]], [[0, 3, -1, -1]]]
    assert np.allclose(w, [[[0.7, 0.1, 0.2, 0.0]], [[0.6, 0.4, 0.0, 0.0]]])


def test_as_sets_leaves_a_ranked_trace_alone_and_orders_set_rows():
    trace = synthesize(tokens=50, layers=3, experts=16, top_k=4, sequences=2)
    assert is_ranked(trace) and as_sets(trace) is trace
    sets = unranked(trace)
    shuffled = dataclasses.replace(sets, experts=np.ascontiguousarray(
        np.asarray(sets.experts)[:, :, ::-1]))
    a, b = as_sets(sets), as_sets(shuffled)
    assert np.array_equal(a.experts, b.experts) and a.experts.dtype == np.int16
    assert np.all(np.diff(np.asarray(a.experts), axis=-1) > 0)
    assert not is_ranked(a) and summarize(a)["rank_order"] is False


def test_a_refusal_is_one_line_naming_the_trace_and_why():
    sets = unranked(synthesize(tokens=20, layers=2, experts=8, top_k=2, sequences=1))
    with pytest.raises(TraceError) as caught:
        require_ranked(sets, "predictor 'x'", "it weighs the top-1 expert")
    text = str(caught.value)
    assert "\n" not in text
    for part in ("predictor 'x'", "it weighs the top-1 expert", sets.meta.source,
                 "rank_order: false"):
        assert part in text, part
    require_ranked(synthesize(tokens=20, layers=2, experts=8, top_k=2), "x", "y")  # ranked: fine


def test_joining_a_set_trace_makes_the_whole_one_of_sets():
    a = synthesize(tokens=30, layers=2, experts=8, top_k=2, sequences=1, seed=1)
    b = synthesize(tokens=30, layers=2, experts=8, top_k=2, sequences=1, seed=2)
    a, b = (dataclasses.replace(t, weights=None) for t in (a, b))
    assert is_ranked(concat([a, b]))
    assert not is_ranked(concat([a, unranked(b)])) and not is_ranked(concat([unranked(a), b]))


@pytest.mark.parametrize("fmt", ["npy", "sglang", "jsonl", "vllm"])
def test_an_export_of_set_rows_imports_as_set_rows(tmp_path, fmt):
    """stmoe's own npy export keeps rank order, but not where the trace's rows were sets:
    its manifest says so (a bare .npy is read as sets anyway)."""
    trace = synthesize(tokens=40, layers=3, experts=16, top_k=4, sequences=1)
    trace = dataclasses.replace(trace, weights=None)
    options = {"layers": 3, "top_k": 4} if fmt == "sglang" else {}
    for source, ranked in ((trace, fmt != "vllm"), (unranked(trace), False)):
        out = export_trace(source, tmp_path / f"x.{fmt}", fmt)
        engine = {"engine": EngineOptions(**options)} if options else {}
        back = import_file(out, num_experts=16, **engine)
        assert is_ranked(back) is ranked, (fmt, ranked)
        assert np.array_equal(back.experts, source.experts)


def test_the_native_file_keeps_the_flag(tmp_path):
    from stmoe.trace import load_trace

    trace = unranked(synthesize(tokens=20, layers=2, experts=8, top_k=2))
    save_trace(trace, tmp_path / "t.npz")
    assert not is_ranked(load_trace(tmp_path / "t.npz"))
