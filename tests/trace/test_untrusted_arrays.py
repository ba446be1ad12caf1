"""Array files that used to import as a wrong trace with exit 0 (or crash): the native
file's and a header-less ``.npz``'s sequence starts, a header-less ``.npz``'s slot order
and member names, a bare ``.npy``'s prompt lengths and manifest, a native file's
lookahead and token ids, MoE-Infinity's ``.npz`` layer numbers. Each is refused in one
line naming the file, the position and what was expected, or read right.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_engine_files import drop_npz_arrays, expert_drop_records

from conftest import one_line_error
from stmoe import load_trace, synthesize
from stmoe.trace.export import export_npy

HEADER = {"format": "stmoe-trace", "version": 1, "domains": ["a", "b", "c"],
          "meta": {"model": "m", "num_experts": 8, "top_k": 2, "num_layers": 1}}


def experts10() -> np.ndarray:
    """[10, 1, 2] int16: two distinct ids per token."""
    return np.array([[t % 8, (t + 1) % 8] for t in range(10)], np.int16).reshape(10, 1, 2)


def write_pair(tmp_path, starts: np.ndarray):
    """The same routing as a native file and as a header-less ``.npz``."""
    arrays = dict(experts=experts10(), seq_starts=starts, is_decode=np.zeros(10, bool))
    native, bare = tmp_path / "native.npz", tmp_path / "bare.npz"
    np.savez(native, header=np.array(json.dumps(HEADER)), **arrays)
    np.savez(bare, meta=json.dumps({"num_experts": 8}), **arrays)
    return native, bare


@pytest.mark.parametrize("starts, fragments", [
    (np.array([0, 6, 3], np.uint64), ["sequence 2", "starts at token 3, not after 6",
                                      "strictly increasing"]),
    (np.array([0, 100, -100], np.int8), ["sequence 2", "starts at token -100",
                                         "token positions >= 0 that fit int64"]),
    (np.array([0, 2**63 + 5], np.uint64), ["sequence 1", f"starts at token {2**63 + 5}",
                                          "fit int64"]),
    (np.array([0, 4, 12], np.uint32), ["sequence 2 starts at token 12 of 10", "below T=10"]),
])
def test_sequence_starts_are_judged_at_their_stored_width(cli, tmp_path, starts, fragments):
    for path in write_pair(tmp_path, starts):
        one_line_error(cli("info", path), path.name, *fragments)
        one_line_error(cli("import", path, "-o", tmp_path / "out.npz"), path.name, *fragments)
    assert not (tmp_path / "out.npz").exists()


def test_valid_narrow_sequence_starts_load_as_int64(tmp_path):
    for path in write_pair(tmp_path, np.array([0, 4, 7], np.uint8)):
        trace = load_trace(path)
        assert trace.seq_starts.dtype == np.int64
        assert trace.seq_lengths.tolist() == [4, 3, 3]


def test_headerless_npz_slots_are_put_in_rank_order(tmp_path):
    """As every importer does: highest gate weight first, stable, and counted."""
    ex = np.array([[[0, 1], [4, 5]], [[2, 3], [6, 7]]], np.int16)
    w = np.array([[[0.3, 0.7], [0.5, 0.5]], [[0.6, 0.4], [0.1, 0.9]]], np.float32)
    np.savez(tmp_path / "asc.npz", experts=ex, weights=w, meta=json.dumps({"num_experts": 8}))
    trace = load_trace(tmp_path / "asc.npz")
    assert trace.experts.tolist() == [[[1, 0], [4, 5]], [[2, 3], [7, 6]]]
    assert trace.weights.tolist() == np.sort(w, axis=2)[:, :, ::-1].tolist()
    assert trace.meta.extra["reordered_by_weight"] == 2


def test_headerless_npz_unknown_member_is_refused_by_name(cli, tmp_path):
    ex = experts10()
    np.savez(tmp_path / "w.npz", experts=ex, weight=np.ones(ex.shape, np.float32),
             meta=json.dumps({"num_experts": 8}))
    one_line_error(cli("import", tmp_path / "w.npz", "-o", tmp_path / "out.npz"), "w.npz",
                   "unknown member 'weight'", "only members meta, experts, seq_starts, "
                   "is_decode, weights, token_ids, lookahead, lookahead_late")
    assert not (tmp_path / "out.npz").exists()


def test_npy_prompt_longer_than_its_sequence_is_refused(cli, tmp_path):
    np.save(tmp_path / "r.npy", experts10().astype(np.int32))
    result = cli("import", tmp_path / "r.npy", "-o", tmp_path / "out.npz", "--seq-starts", "0,4",
                 "--prompt-lengths", "3,9")
    one_line_error(result, "r.npy", "sequence 1: a prompt of 9 tokens but only 6 routed tokens",
                   "a prompt length of at most the routed tokens")
    assert not (tmp_path / "out.npz").exists()
    done = cli("import", tmp_path / "r.npy", "-o", tmp_path / "out.npz", "--seq-starts", "0,4",
               "--prompt-lengths", "3,6")  # a whole sequence of prompt: no decode token
    assert done.exit_code == 0, done.output
    assert load_trace(tmp_path / "out.npz").is_decode.tolist() == [False] * 3 + [True] + \
        [False] * 6


def test_npy_manifest_must_list_the_file_being_imported(cli, tmp_path):
    """t.manifest.json binds t.npy and t.seq_starts.npy; t.dat beside them (np.save by
    hand) shares the manifest's name but is not what it checked."""
    trace = synthesize(tokens=20, layers=2, experts=8, top_k=2, sequences=2)
    export_npy(trace, tmp_path / "t.npy")
    with open(tmp_path / "t.dat", "wb") as f:
        np.save(f, np.load(tmp_path / "t.npy")[:12])
    one_line_error(cli("import", tmp_path / "t.dat", "-o", tmp_path / "out.npz"), "t.dat",
                   "t.manifest.json lists t.npy, t.seq_starts.npy, not t.dat",
                   "expected t.dat and its side file from one `stmoe export`")
    assert not (tmp_path / "out.npz").exists()
    assert load_trace(tmp_path / "t.npy").seq_starts.tolist() == trace.seq_starts.tolist()


def test_native_lookahead_and_token_ids_are_checked_with_their_position(cli, tmp_path):
    arrays = dict(experts=experts10(), seq_starts=np.array([0, 4, 7]),
                  is_decode=np.zeros(10, bool), header=np.array(json.dumps(HEADER)))
    look = np.full((10, 1, 4), -1, np.int16)
    look[6, 0, 2] = 8  # N is 8
    np.savez(tmp_path / "look.npz", lookahead=look, **arrays)
    one_line_error(cli("info", tmp_path / "look.npz"), "look.npz",
                   "token 6, layer 0, slot 2: a lookahead expert id is out of range: 8",
                   "expected -1..7")
    ids = np.arange(10, dtype=np.int64)
    ids[3] = -5
    np.savez(tmp_path / "ids.npz", token_ids=ids, **arrays)
    one_line_error(cli("info", tmp_path / "ids.npz"), "ids.npz",
                   "token 3: token id -5 is negative", "vocabulary ids >= 0")


def test_expert_drop_npz_layer_and_seq_must_be_integers(cli, tmp_path):
    arrays = drop_npz_arrays(expert_drop_records()[1])
    for name in ("layer", "seq"):
        bad = dict(arrays, **{name: arrays[name] + 0.7})  # 1.7 once truncated to layer 1
        np.savez(tmp_path / "d.npz", **bad)
        one_line_error(cli("import", tmp_path / "d.npz", "-o", tmp_path / "out.npz"), "d.npz",
                       f"member {name!r} has dtype float64", "integer layer numbers")
    np.savez(tmp_path / "d.npz", **arrays)
    assert cli("import", tmp_path / "d.npz", "-o", tmp_path / "out.npz").exit_code == 0
