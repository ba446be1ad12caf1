"""Engine files that used to import as a wrong trace with exit 0, or crash with the
generic line: vLLM routing profiles, MoE-Infinity's expert-drop trace, SGLang's
responses and recorder dumps, ``stmoe_moe_layers``. Each is refused in one line naming
the file, the position and what was expected, or read right.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from test_engine_files import drop_npz_arrays, expert_drop_records, moedropt, recorder_dump

from conftest import one_line_error
from stmoe import load_trace, synthesize
from stmoe.trace.engines.writers import export_sglang, export_vllm

# ---- vLLM routing profiles -----------------------------------------------------------------

PROFILE_POS = [0, 1, 2, 0, 0]  # a prompt of 3 tokens, then 2 decode steps


def profile_ids(t: int, layer: int) -> list[int]:
    return [(t + 2 * layer) % 8, (t + 2 * layer + 1) % 8]


def profile_records(positions=PROFILE_POS, layers=(0, 1)) -> list[dict]:
    """One record per (token, layer), token-major, as the profiler writes them."""
    return [{"problem_id": "q0", "layer": layer, "token_pos": p, "experts": profile_ids(t, layer),
             "gating_probs": [0.7, 0.3]} for t, p in enumerate(positions) for layer in layers]


def write_lines(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_profile_records_are_placed_by_their_own_position(tmp_path):
    recs = profile_records()
    recs[1], recs[3] = recs[3], recs[1]  # layer 1's tokens 0 and 1 swapped in the file
    write_lines(tmp_path / "p.jsonl", recs)
    trace = load_trace(tmp_path / "p.jsonl")
    for layer in (0, 1):
        assert trace.experts[:, layer].tolist() == [profile_ids(t, layer) for t in range(5)]
    assert trace.is_decode.tolist() == [False, False, False, True, True]


def test_profile_positions_that_skip_repeat_or_start_late_are_refused(cli, tmp_path):
    cases = {
        "late": ([5, 6, 7], ["line 1", "problem 'q0', layer 0 starts at token_pos 5",
                             "positions from 0 (tokens 0..4 are missing)"]),
        "gap": ([0, 1, 3, 0, 0], ["line 5", "layer 0: token_pos 3 in a prefill pass of 3",
                                  "token_pos 0..2, each once"]),
        "repeat": ([0, 1, 1, 2, 0], ["line 5", "token_pos 1 in a prefill pass of 4"]),
        "decode": ([0, 1, 2, 0, 4], ["line 9", "token_pos 4 after the prefill pass",
                                     "then 0 for each decode step"]),
    }
    for name, (positions, fragments) in cases.items():
        write_lines(tmp_path / f"{name}.jsonl", profile_records(positions))
        result = cli("import", tmp_path / f"{name}.jsonl", "-o", tmp_path / "out.npz")
        one_line_error(result, f"{name}.jsonl", *fragments)
    # a layer whose prefill pass is longer than another's: not the same prompt
    recs = profile_records([0, 1, 2, 0, 0])
    recs[7]["token_pos"] = 3  # layer 1 of token 3: its prompt runs 0..3
    write_lines(tmp_path / "torn.jsonl", recs)
    one_line_error(cli("import", tmp_path / "torn.jsonl", "-o", tmp_path / "out.npz"),
                   "torn.jsonl", "line 2", "a prefill pass of 4 tokens at layer 1 but 3 at "
                   "layer 0", "the same prompt at every layer")
    assert not (tmp_path / "out.npz").exists()


def test_profile_gating_probs_missing_or_misspelt_in_one_record_is_refused(cli, tmp_path):
    recs = profile_records()
    del recs[4]["gating_probs"]
    write_lines(tmp_path / "missing.jsonl", recs)
    one_line_error(cli("import", tmp_path / "missing.jsonl", "-o", tmp_path / "out.npz"),
                   "missing.jsonl", "line 5", "'gating_probs' is missing here but given on "
                   "line 1", "gating_probs in all records or in none")
    recs = profile_records()
    recs[4]["gating_prob"] = recs[4].pop("gating_probs")
    write_lines(tmp_path / "misspelt.jsonl", recs)
    one_line_error(cli("import", tmp_path / "misspelt.jsonl", "-o", tmp_path / "out.npz"),
                   "misspelt.jsonl", "line 5", "unknown field 'gating_prob'",
                   "expected 'gating_probs'")
    recs = profile_records()
    for r in recs:
        r["token_id"], r["dataset"] = 17, "gsm8k"  # known fields, read by nothing
    write_lines(tmp_path / "extra.jsonl", recs)
    assert load_trace(tmp_path / "extra.jsonl").weights is not None


# ---- MoE-Infinity's expert-drop trace ------------------------------------------------------


def test_expert_drop_non_finite_weight_on_a_routed_expert_is_refused(cli, tmp_path):
    ne, recs = expert_drop_records()
    for value, name in ((np.nan, "nan"), (-np.inf, "-inf")):
        seq, layer, rows, w, m = recs[3]  # record 3: layer 3 of the second pass
        routed = int(np.flatnonzero(m[0])[0])
        w = w.copy()
        w[0, routed] = value
        damaged = [*recs[:3], (seq, layer, rows, w, m), *recs[4:]]
        (tmp_path / "w.bin").write_bytes(moedropt(ne, damaged))
        one_line_error(cli("import", tmp_path / "w.bin", "-o", tmp_path / "out.npz"),
                       "w.bin", "record 3 (layer 3), row 0",
                       f"gate weight {name} on routed expert {routed}",
                       "a finite gate weight for every expert the mask routes")
        np.savez(tmp_path / "w.npz", **drop_npz_arrays(damaged))  # decode rows: record 1
        one_line_error(cli("import", tmp_path / "w.npz", "-o", tmp_path / "out.npz"),
                       "w.npz", "record 1 (layer 3), row 0", f"gate weight {name}")
    # a NaN where the mask does not route is no routing's weight: read as before
    seq, layer, rows, w, m = recs[0]
    w = w.copy()
    w[m == 0] = np.nan
    (tmp_path / "ok.bin").write_bytes(moedropt(ne, [(seq, layer, rows, w, m), *recs[1:]]))
    assert load_trace(tmp_path / "ok.bin").experts[0, 0].tolist() == np.flatnonzero(m[0]) \
        [np.argsort(-w[0, m[0] == 1])].tolist()
    assert not (tmp_path / "out.npz").exists()


# ---- stmoe_moe_layers: the model layers an export names ------------------------------------


def exported(tmp_path, fmt: str, sequences: int = 2):
    """A 3-layer trace exported at model layers 1, 2 and 4 (dense 0 and 3 hold -1)."""
    trace = synthesize(tokens=16, layers=3, experts=8, top_k=2, sequences=sequences)
    trace = trace.with_meta(extra={**trace.meta.extra, "model_layer_ids": [1, 2, 4]})
    path = tmp_path / f"{fmt}.json"
    (export_vllm if fmt == "vllm" else export_sglang)(trace, path)
    return trace, path, json.loads(path.read_text())


def test_a_damaged_stmoe_moe_layers_is_refused_not_followed(cli, tmp_path):
    trace, path, doc = exported(tmp_path, "vllm")
    sgl = ["--layers", "5", "--top-k", "2"]
    cases = {  # the list the file carries: what is refused
        "short": ([1, 2], ["names model layers up to 2 but the routing has 5",
                           "the last of them named"]),
        "twice": ([1, 1, 2, 4], ["'stmoe_moe_layers' is [1, 1, 2, 4]",
                                 "increasing model layer numbers, each once"]),
        "skips": ([1, 4], ["choices[0]", "model layer 2 routes but 'stmoe_moe_layers' does "
                           "not name it"]),
    }
    for value, fragments in cases.values():
        doc["stmoe_moe_layers"] = value
        path.write_text(json.dumps(doc))
        one_line_error(cli("import", path, "-o", tmp_path / "out.npz"), "vllm.json",
                       *fragments)
    _, path, docs = exported(tmp_path, "sglang")
    docs[1]["meta_info"]["stmoe_moe_layers"] = [1, 2]
    path.write_text(json.dumps(docs))
    one_line_error(cli("import", path, "-o", tmp_path / "out.npz", *sgl), "sglang.json",
                   "response 1: 'stmoe_moe_layers' is [1, 2] here but [1, 2, 4] in response 0",
                   "the same model layers in every response")
    del docs[1]["meta_info"]["stmoe_moe_layers"]
    path.write_text(json.dumps(docs))
    one_line_error(cli("import", path, "-o", tmp_path / "out.npz", *sgl),
                   "response 1: 'stmoe_moe_layers' is None here")
    assert not (tmp_path / "out.npz").exists()
    # the intact exports read back
    for fmt, options in (("vllm", []), ("sglang", sgl)):
        _, path, _ = exported(tmp_path, fmt)
        assert cli("import", path, "-o", tmp_path / f"{fmt}.npz", *options).exit_code == 0
        back = load_trace(tmp_path / f"{fmt}.npz")
        assert np.array_equal(np.sort(back.experts, axis=2), np.sort(trace.experts, axis=2))
        assert back.meta.extra["model_layer_ids"] == [1, 2, 4]


def test_expert_drop_mask_byte_other_than_0_or_1_is_refused(cli, tmp_path):
    ne, recs = expert_drop_records()
    seq, layer, rows, w, m = recs[0]
    m = m.copy()
    m[2, 5] = 200  # once read as 200 routed experts: a broadcast error
    (tmp_path / "m.bin").write_bytes(moedropt(ne, [(seq, layer, rows, w, m), *recs[1:]]))
    one_line_error(cli("import", tmp_path / "m.bin", "-o", tmp_path / "out.npz"), "m.bin",
                   "record 0 (layer 1), row 2: mask byte 200 for expert 5",
                   "0 or 1, whether the expert is routed")
    assert not (tmp_path / "out.npz").exists()


# ---- SGLang ---------------------------------------------------------------------------------


def test_sglang_response_of_no_token_is_refused(cli, tmp_path):
    ids = base64.b64encode(np.arange(8, dtype="<i4").tobytes()).decode()
    doc = {"text": "", "meta_info": {"prompt_tokens": 0, "completion_tokens": 0,
                                     "routed_experts": ids}}
    (tmp_path / "z.json").write_text(json.dumps(doc))
    one_line_error(cli("import", tmp_path / "z.json", "-o", tmp_path / "out.npz", "--top-k", "2"),
                   "z.json", "response 0: prompt_tokens and completion_tokens are both 0",
                   "a request of at least one token")
    assert not (tmp_path / "out.npz").exists()


def test_sglang_empty_batch_is_refused(cli, tmp_path):
    (tmp_path / "e.json").write_text("[]")
    one_line_error(cli("import", tmp_path / "e.json", "-o", tmp_path / "out.npz", "--format",
                       "sglang"), "e.json", "the batch is an empty list",
                   "a /generate response, or a list of one or more")
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.filterwarnings('ignore:dropped dense layer 0:stmoe.errors.StmoeNote')
def test_sglang_recorder_fields_of_the_wrong_kind_are_refused(cli, tmp_path):
    torch = pytest.importorskip("torch")
    cases = {
        "fid": (1, "forward_pass_id", "1", ["record 1: 'forward_pass_id' is '1'",
                                             "an integer, the pass's number"]),
        "ids": (0, "input_ids", 4, ["record 0 (forward pass 0): 'input_ids' is 4",
                                    "a list of integers >= 0"]),
        "text": (0, "positions", ["a"] * 8, ["record 0 (forward pass 0): 'positions' is "
                                             "['a', 'a'"]),
        "negative": (1, "positions", [-1], ["record 1 (forward pass 1): 'positions' is [-1]",
                                            "a list of integers >= 0"]),
        "lens": (0, "extend_seq_lens", [8, 0], ["record 0 (forward pass 0): extend_seq_lens "
                                                "[8, 0]", "one length >= 1 per request"]),
    }
    for name, (i, key, value, fragments) in cases.items():
        dump, _, _ = recorder_dump()
        dump["records"][i][key] = value
        torch.save(dump, tmp_path / f"{name}.pt")
        one_line_error(cli("import", tmp_path / f"{name}.pt", "-o", tmp_path / "out.npz"),
                       f"{name}.pt", *fragments)
    assert not (tmp_path / "out.npz").exists()
    dump, _, _ = recorder_dump()
    for rec in dump["records"]:  # tensors, as the recorder may store them, read the same
        rec["positions"] = torch.tensor(rec["positions"], dtype=torch.int64)
        rec["forward_pass_id"] = torch.tensor(rec["forward_pass_id"])
    torch.save(dump, tmp_path / "tensors.pt")
    assert load_trace(tmp_path / "tensors.pt").num_sequences == 3
