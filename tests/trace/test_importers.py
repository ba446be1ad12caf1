"""Importers: each foreign format becomes the same trace; content decides the format."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import REAL_NPZ, REAL_ROUTES, needs_shared
from stmoe import TraceError, import_files, load_trace, synthesize
from stmoe.trace import sniff_format
from stmoe.trace.export import export_jsonl, export_npy


@needs_shared
def test_real_sample_routes_json_and_npz_give_identical_arrays():
    routes, npz = load_trace(REAL_ROUTES), load_trace(REAL_NPZ)
    assert routes.experts.shape == (164, 40, 8) and routes.experts.dtype == np.int16
    assert np.array_equal(routes.experts, npz.experts)
    assert np.array_equal(routes.is_decode, npz.is_decode)
    assert np.array_equal(routes.seq_starts, npz.seq_starts)
    assert np.array_equal(routes.weights, npz.weights)
    assert routes.num_experts == npz.num_experts == 256
    assert int(routes.is_decode.sum()) == 128
    assert routes.meta.model == "Qwen3.6-35B-A3B-4bit"
    assert routes.token_ids is not None and routes.token_ids[0] == 248045


@needs_shared
def test_formats_are_sniffed_by_content_not_name(tmp_path):
    disguised = tmp_path / "trace.dat"
    disguised.write_bytes(REAL_ROUTES.read_bytes())
    assert sniff_format(disguised) == "routes"
    assert sniff_format(REAL_NPZ) == "npz"


def small_trace(**kw):
    spec = dict(tokens=60, layers=3, experts=10, top_k=2, sequences=3, domains=3, seed=2)
    return synthesize(**{**spec, **kw})


def test_jsonl_records_in_any_order_give_the_same_trace(tmp_path):
    trace = small_trace()
    path = export_jsonl(trace, tmp_path / "t.jsonl")
    header, *lines = path.read_text().splitlines()  # the metadata line stays first
    random.Random(0).shuffle(lines)
    path.write_text("\n".join([header, *lines]) + "\n")
    back = load_trace(path)
    assert back.meta.synthetic and back.meta.model == "synthetic" and back.num_experts == 10
    assert sniff_format(path) == "jsonl"
    assert np.array_equal(back.experts, trace.experts)
    assert np.array_equal(back.weights, trace.weights)
    assert np.array_equal(back.is_decode, trace.is_decode)
    assert np.array_equal(back.seq_starts, trace.seq_starts)
    assert back.domains == trace.domains


def test_npy_with_sequence_starts_from_option_and_side_file(tmp_path):
    trace = small_trace()
    path = export_npy(trace, tmp_path / "t.npy")  # writes t.seq_starts.npy beside it
    assert sniff_format(path) == "npy"
    side = load_trace(path, num_experts=10)
    assert np.array_equal(side.experts, trace.experts)
    assert side.seq_starts.tolist() == trace.seq_starts.tolist() == [0, 20, 40]
    (tmp_path / "t.seq_starts.npy").unlink()  # the export's pair broken: refused
    with pytest.raises(TraceError, match=r"t\.seq_starts\.npy is not the file t\.manifest"):
        load_trace(path)
    (tmp_path / "t.manifest.json").unlink()  # a bare array: one sequence
    assert load_trace(path).seq_starts.tolist() == [0]
    assert load_trace(path, seq_starts="0,30").seq_starts.tolist() == [0, 30]
    text = tmp_path / "starts.txt"
    text.write_text("0\n10\n50\n")
    assert load_trace(path, seq_starts=str(text)).seq_starts.tolist() == [0, 10, 50]


def test_npy_int32_ids_are_narrowed_and_n_is_inferred_when_missing(tmp_path):
    ex = np.array([[[3, 1]], [[0, 2]]], dtype=np.int32)
    np.save(tmp_path / "v.npy", ex)
    trace = load_trace(tmp_path / "v.npy")
    assert trace.experts.dtype == np.int16 and trace.num_experts == 4
    assert trace.meta.extra["num_experts_inferred"] is True


def routes_doc(n_tokens=3, layers=(0, 1), k=2, weights=True, **meta):
    routes = []
    for p in range(n_tokens):
        entry = {}
        for lid in layers:
            e = {"experts": [(p + lid) % 5, (p + lid + 1) % 5]}
            if weights:
                e["weights"] = [0.7, 0.3]
            entry[str(lid)] = e
        routes.append(
            {
                "token_pos": p,
                "token_id": 100 + p,
                "phase": "decode" if p else "prefill",
                "layers": entry,
            }
        )
    return {"meta": {"model_id": "m", "num_experts": 5, "top_k": k, **meta}, "routes": routes}


def test_several_routes_files_become_one_sequence_each_with_their_domains(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(routes_doc(domain="code")))
    b.write_text(json.dumps(routes_doc(4)))
    trace = import_files([a, b], domain="chat")
    assert trace.seq_starts.tolist() == [0, 3]
    assert trace.domains == ("code", "chat")
    assert trace.is_decode.tolist() == [False, True, True, False, True, True, True]


def test_model_layer_numbers_are_mapped_to_moe_layers_and_kept(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(routes_doc(layers=(1, 3, 5))))
    trace = load_trace(path)
    assert trace.num_layers == 3
    assert trace.meta.extra["model_layer_ids"] == [1, 3, 5]


def test_slots_are_put_in_router_rank_order_by_weight(tmp_path):
    doc = routes_doc(n_tokens=1, layers=(0,))
    doc["routes"][0]["layers"]["0"] = {"experts": [4, 2], "weights": [0.2, 0.8]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    assert trace.experts[0, 0].tolist() == [2, 4]
    assert trace.weights[0, 0].tolist() == pytest.approx([0.8, 0.2])
    assert trace.meta.extra["reordered_by_weight"] == 1


def test_joining_files_of_different_models_is_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(routes_doc()))
    doc = routes_doc()
    doc["meta"]["model_id"] = "other"
    b.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"cannot be joined.*model .other."):
        import_files([a, b])
