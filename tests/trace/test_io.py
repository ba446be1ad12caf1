"""The native file: lossless, versioned, memory-mappable, and loud when damaged."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

import stmoe
from conftest import distinct_slots
from stmoe import TraceError, load_trace, save_trace, synthesize
from stmoe.trace.io import FORMAT_VERSION, read_native


def assert_same(a: stmoe.RoutingTrace, b: stmoe.RoutingTrace) -> None:
    assert np.array_equal(a.experts, b.experts) and b.experts.dtype == np.int16
    assert np.array_equal(a.seq_starts, b.seq_starts)
    assert np.array_equal(a.is_decode, b.is_decode)
    assert (a.weights is None) == (b.weights is None)
    if a.weights is not None:
        assert np.array_equal(a.weights, b.weights)
    for name in ("token_ids", "lookahead", "lookahead_late"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert np.array_equal(x, y), name
    assert a.domains == b.domains
    assert a.meta == b.meta


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_is_lossless(tmp_path, compress):
    trace = synthesize(tokens=300, layers=5, experts=16, top_k=3, sequences=3, domains=3, seed=4)
    look = distinct_slots(np.concatenate([trace.experts, (trace.experts + 1) % 16], axis=2))
    look[:, 0] = -1
    trace = stmoe.RoutingTrace(
        **{**trace.__dict__, "token_ids": np.arange(300, dtype=np.int64) * 7,
           "lookahead": look, "lookahead_late": look[:, :, ::-1].copy()}
    )
    path = save_trace(trace, tmp_path / "t.npz", compress=compress)
    back = load_trace(path)
    assert_same(trace, back)
    assert back.meta.synthetic and back.meta.extra["synth_spec"]["seed"] == 4


def test_round_trip_without_optional_arrays(tmp_path):
    trace = synthesize(tokens=50, layers=2, experts=8, top_k=2, sequences=1)
    trace = stmoe.RoutingTrace(**{**trace.__dict__, "weights": None})
    assert_same(trace, load_trace(save_trace(trace, tmp_path / "t.npz")))


def test_large_trace_opens_memory_mapped(tmp_path, monkeypatch):
    # 2M token-layers: the expert array (2M x K int16) is mapped, not copied. (Files
    # under 64 MiB normally load whole, to verify checksums; lower that bar here.)
    monkeypatch.setattr("stmoe.trace.io._MMAP_MIN_FILE", 0)
    trace = synthesize(
        tokens=125_000,
        layers=16,
        experts=32,
        top_k=2,
        sequences=50,
        seed=1,
        spatial=0.0,
        temporal=0.0,
    )
    path = save_trace(trace, tmp_path / "big.npz")
    mapped = load_trace(path, mmap=True)
    assert isinstance(mapped.experts, np.memmap)
    assert isinstance(mapped.weights, np.memmap)
    assert np.array_equal(mapped.experts, trace.experts)
    assert not isinstance(load_trace(path).experts, np.memmap)


def test_newer_format_version_is_refused(tmp_path):
    path = save_trace(
        synthesize(tokens=20, layers=2, experts=4, top_k=2, sequences=1), tmp_path / "t.npz"
    )
    arrays = dict(np.load(path))
    header = json.loads(str(arrays["header"]))
    header["version"] = FORMAT_VERSION + 1
    arrays["header"] = np.array(json.dumps(header))
    np.savez(path, **arrays)
    with pytest.raises(TraceError, match=r"format version 2 is not readable.*upgrade stmoe"):
        read_native(path)


def test_truncated_native_file_is_a_clear_error(tmp_path):
    path = save_trace(synthesize(tokens=200, layers=4, experts=8, top_k=2), tmp_path / "t.npz")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert "t.npz" in str(info.value) and "truncated" in str(info.value)


def test_writing_is_atomic_and_validates_first(tmp_path):
    bad = synthesize(tokens=20, layers=2, experts=4, top_k=2, sequences=1)
    bad = stmoe.RoutingTrace(**{**bad.__dict__, "seq_starts": np.array([3])})
    with pytest.raises(TraceError):
        save_trace(bad, tmp_path / "t.npz")
    assert list(tmp_path.iterdir()) == []


def test_native_file_is_a_plain_npz_readable_by_numpy(tmp_path):
    trace = synthesize(tokens=20, layers=2, experts=4, top_k=2, sequences=1)
    path = save_trace(trace, tmp_path / "t.npz")
    with zipfile.ZipFile(path) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    raw = np.load(path)
    assert raw["experts"].dtype == np.int16
    assert json.loads(str(raw["header"]))["format"] == "stmoe-trace"
