"""Every malformed input of the foundation issue: one clear error, exit status 1.

Each case writes a broken file, runs ``stmoe import`` on it and checks that the
message names the file, the position and what was expected, with no traceback.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_importers import routes_doc

from stmoe import synthesize
from stmoe.trace import save_trace
from stmoe.trace.export import export_jsonl


def jsonl_text(**kw) -> str:
    rows = [
        {
            "seq": 0,
            "token": t,
            "layer": layer,
            "experts": [(t + layer) % 4, (t + layer + 1) % 4],
            "weights": [0.6, 0.4],
        }
        for t in range(3)
        for layer in range(2)
    ]
    return "\n".join(json.dumps(r) for r in rows) + "\n"


def write_npy(arr):
    def write(path):
        np.save(path, arr)

    return write


def write_text(text: str):
    def write(path):
        path.write_text(text)

    return write


def edit_jsonl(edit):
    def write(path):
        lines = jsonl_text().splitlines()
        path.write_text("\n".join(edit(lines)) + "\n")

    return write


def edit_routes(edit, *, raw=False):
    def write(path):
        doc = routes_doc(n_tokens=3, layers=(0, 1), k=2)
        result = edit(doc)
        path.write_text(result if raw else json.dumps(result))

    return write


def set_record(i, **fields):
    def edit(lines):
        rec = json.loads(lines[i])
        rec.update(fields)
        lines[i] = json.dumps(rec)
        return lines

    return edit


def set_route(i, layer=None, **fields):
    def edit(doc):
        target = doc["routes"][i] if layer is None else doc["routes"][i]["layers"][layer]
        target.update(fields)
        return doc

    return edit


GOOD3 = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]]])

CASES = {
    # raw .npy [T, L, K]
    "npy wrong rank": (
        "x.npy",
        write_npy(np.zeros((3, 2), dtype=np.int32)),
        [],
        ["x.npy", "rank 2", "rank 3, [T tokens, L MoE layers, K experts]"],
    ),
    "npy float ids": (
        "x.npy",
        write_npy(GOOD3.astype(float)),
        [],
        ["x.npy", "dtype float64", "integer expert ids"],
    ),
    "npy id >= N": (
        "x.npy",
        write_npy(np.where(GOOD3 == 3, 7, GOOD3)),
        ["--num-experts", "4"],
        ["x.npy", "expert id 7 is out of range", "token 0, layer 1, slot 1", "0..3"],
    ),
    "npy id < -1": (
        "x.npy",
        write_npy(np.where(GOOD3 == 2, -3, GOOD3)),
        ["--num-experts", "4"],
        ["x.npy", "expert id -3", "token 0, layer 1, slot 0", "or -1 for an empty slot"],
    ),
    "npy duplicate expert": (
        "x.npy",
        write_npy(np.where(GOOD3 == 3, 2, GOOD3)),
        ["--num-experts", "4"],
        ["x.npy", "expert 2 appears twice", "token 0, layer 1", "K distinct"],
    ),
    "npy empty trace": (
        "x.npy",
        write_npy(np.zeros((0, 2, 2), dtype=np.int16)),
        ["--num-experts", "4"],
        ["x.npy", "empty (0 tokens)", "at least one token"],
    ),
    "npy bad seq starts": (
        "x.npy",
        write_npy(GOOD3),
        ["--seq-starts", "0,2,1"],
        ["x.npy", "sequence 2 starts at token 1", "strictly increasing"],
    ),
    "npy truncated": (
        "x.npy",
        lambda p: (np.save(p, GOOD3), p.write_bytes(p.read_bytes()[:-5])),
        [],
        ["x.npy", "not a readable .npy", "truncated"],
    ),
    # JSON Lines
    "jsonl not json": (
        "x.jsonl",
        edit_jsonl(lambda ls: [ls[0], "{seq: oops", *ls[1:]]),
        [],
        ["x.jsonl", "line 2", "not valid JSON", "one JSON object per line"],
    ),
    "jsonl truncated": (
        "x.jsonl",
        lambda p: p.write_text(jsonl_text()[:-20]),
        [],
        ["x.jsonl", "line 6", "not valid JSON", "truncated"],
    ),
    "jsonl missing layer": (
        "x.jsonl",
        edit_jsonl(lambda ls: ls[:3] + ls[4:]),
        [],
        ["x.jsonl", "token 1 has no record for layer 1", "line 3", "all 2 layers for every token"],
    ),
    "jsonl record without its layer key": (  # (it said "'layer' is None")
        "x.jsonl",
        edit_jsonl(lambda ls: [*ls[:3], json.dumps({k: v for k, v in json.loads(ls[3]).items()
                                                    if k != "layer"}), *ls[4:]]),
        [],
        ["x.jsonl", "line 4", "'layer' missing", "an integer 'layer' >= 0"],
    ),
    # the meta line (stmoe export writes it) declares 3 layers: records of 2 are not a
    # 2-layer trace (issue 45)
    "jsonl meta declares a layer no record has": (
        "x.jsonl",
        edit_jsonl(lambda ls: [json.dumps({"meta": {"num_layers": 3, "num_experts": 4}}), *ls]),
        [],
        ["x.jsonl", "line 2", "the metadata on line 1 declares 3 MoE layers",
         "no record of any token for layer 2", "each of the 3 layers it declares"],
    ),
    "jsonl meta declares other layer ids": (
        "x.jsonl",
        edit_jsonl(lambda ls: [json.dumps({"meta": {"num_layers": 2, "extra": {
            "model_layer_ids": [0, 5]}}}), *[ls[i] for i in (0, 2, 4)]]),
        [],
        ["x.jsonl", "line 2", "declares 2 MoE layers", "no record of any token for layer 5"],
    ),
    "jsonl meta declares another K": (
        "x.jsonl",
        edit_jsonl(lambda ls: [json.dumps({"meta": {"top_k": 3}}), *ls]),
        [],
        ["x.jsonl", "line 2", "declares top_k 3, but the records hold 2 experts",
         "3 experts in every record"],
    ),
    "jsonl K differs": (
        "x.jsonl",
        edit_jsonl(set_record(2, experts=[0, 1, 2], weights=[0.4, 0.3, 0.3])),
        [],
        ["x.jsonl", "line 3", "3 experts in this record but 2", "K=2"],
    ),
    "jsonl duplicate record": (
        "x.jsonl",
        edit_jsonl(lambda ls: [*ls, ls[1]]),
        [],
        [
            "x.jsonl",
            "a second record for sequence 0, token 0, layer 1",
            "first on line 2",
            "line 7",
        ],
    ),
    "jsonl token gap": (
        "x.jsonl",
        edit_jsonl(lambda ls: ls[:2] + ls[4:]),
        [],
        ["x.jsonl", "jumps from token 0 to 2", "line 3", "consecutive token"],
    ),
    "jsonl token not int": (
        "x.jsonl",
        edit_jsonl(set_record(0, token="a")),
        [],
        ["x.jsonl", "line 1", "'token' is 'a'", "integer 'token'"],
    ),
    "jsonl nan weight": (
        "x.jsonl",
        edit_jsonl(set_record(3, weights=[0.5, float("nan")])),
        [],
        ["x.jsonl", "line 4", "gate weight nan in slot 1", "finite"],
    ),
    "jsonl id >= N": (
        "x.jsonl",
        edit_jsonl(set_record(4, experts=[9, 1])),
        ["--num-experts", "4"],
        ["x.jsonl", "line 5", "expert id 9 is out of range", "0..3"],
    ),
    "jsonl duplicate expert": (
        "x.jsonl",
        edit_jsonl(set_record(5, experts=[2, 2])),
        [],
        ["x.jsonl", "line 6", "expert 2 appears twice"],
    ),
    # nested routes JSON
    "routes truncated": (
        "x.json",
        edit_routes(lambda d: json.dumps(d, indent=1)[:-40], raw=True),
        [],
        ["x.json", "not valid JSON", "line", "column", "truncated"],
    ),
    "routes not json": (
        "x.json",
        write_text("{\n  'meta': nope\n}"),
        [],
        ["x.json", "line 2, column 3", "not valid JSON"],
    ),
    "routes non-increasing position": (
        "x.json",
        edit_routes(set_route(2, token_pos=1)),
        [],
        ["x.json", "route 2 (token_pos 1)", "token position 1 follows 1", "strictly increasing"],
    ),
    "routes missing layer": (
        "x.json",
        edit_routes(lambda d: (d["routes"][1]["layers"].pop("1"), d)[1]),
        [],
        ["x.json", "route 1 (token_pos 1)", "layer 1 is missing", "all 2 MoE layers"],
    ),
    "routes K differs": (
        "x.json",
        edit_routes(set_route(1, "0", experts=[0, 1, 2], weights=[0.5, 0.3, 0.2])),
        [],
        ["x.json", "route 1 (token_pos 1), layer 0", "3 experts but top_k is 2"],
    ),
    "routes nan weight": (
        "x.json",
        edit_routes(set_route(0, "1", weights=[0.5, float("nan")])),
        [],
        ["x.json", "route 0 (token_pos 0), layer 1", "gate weight nan in slot 1"],
    ),
    "routes id >= N": (
        "x.json",
        edit_routes(set_route(1, "0", experts=[6, 1])),
        [],
        ["x.json", "expert id 6 is out of range", "token 1, layer 0", "0..4"],
    ),
    "routes empty": (
        "x.json",
        edit_routes(lambda d: {**d, "routes": []}),
        [],
        ["x.json", "'routes' is empty"],
    ),
    "routes wrong layer count": (
        "x.json",
        edit_routes(lambda d: {**d, "meta": {**d["meta"], "num_moe_layers": 3}}),
        [],
        ["x.json", "route 0 has 2 layers but the metadata says 3"],
    ),
    "routes top_k not a number": (
        "x.json",
        edit_routes(lambda d: {**d, "meta": {**d["meta"], "top_k": "abc"}}),
        [],
        ["x.json", "metadata 'top_k' is 'abc'", "a positive integer"],
    ),
    "routes layer entry not an object": (
        "x.json",
        edit_routes(lambda d: (d["routes"][0]["layers"].update({"0": [1, 2]}), d)[1]),
        [],
        ["x.json", "route 0", "the layer entry is a JSON list"],
    ),
    "routes route not an object": (
        "x.json",
        edit_routes(lambda d: {**d, "routes": [*d["routes"], 5]}),
        [],
        ["x.json", "route 3", "route is a JSON int"],
    ),
    "routes duplicate layer key": (
        "x.json",
        edit_routes(
            lambda d: (d["routes"][1]["layers"].update({"00": d["routes"][1]["layers"]["0"]}), d)[1]
        ),
        [],
        ["x.json", "route 1", "layer 0 appears twice (key '00')"],
    ),
    "routes missing token_id": (
        "x.json",
        edit_routes(lambda d: (d["routes"][1].pop("token_id"), d)[1]),
        [],
        ["x.json", "route 1", "no integer 'token_id'"],
    ),
    "routes not from token 0": (
        "x.json",
        edit_routes(lambda d: {**d, "routes": d["routes"][1:]}),
        [],
        ["x.json", "first route has token position 1", "positions from 0"],
    ),
    "routes weight typo": (
        "x.json",
        edit_routes(
            lambda d: (
                d["routes"][0]["layers"]["0"].update(
                    {"weight": d["routes"][0]["layers"]["0"].pop("weights")}
                ),
                d,
            )[1]
        ),
        [],
        ["x.json", "unknown field 'weight'", "'weights'"],
    ),
    "jsonl huge expert id": (
        "x.jsonl",
        edit_jsonl(set_record(1, experts=[10**30, 1])),
        [],
        ["x.jsonl", "line 2", "out of range", "-1..32767"],
    ),
    "jsonl huge weight": (
        "x.jsonl",
        edit_jsonl(set_record(1, weights=[10**400, 0.5])),
        [],
        ["x.jsonl", "line 2", "gate weight", "finite number"],
    ),
    "jsonl weight typo": (
        "x.jsonl",
        edit_jsonl(set_record(0, weight=[0.5, 0.5])),
        [],
        ["x.jsonl", "line 1", "unknown field 'weight'"],
    ),
    "jsonl phase conflict": (
        "x.jsonl",
        edit_jsonl(set_record(0, decode=True, phase="prefill")),
        [],
        ["x.jsonl", "line 1", "'decode' is True but 'phase' is 'prefill'"],
    ),
    "jsonl layers disagree on phase": (
        "x.jsonl",
        edit_jsonl(set_record(1, phase="decode")),
        [],
        ["x.jsonl", "disagree on prefill/decode", "one phase per token"],
    ),
    "jsonl not from token 0": (
        "x.jsonl",
        edit_jsonl(lambda ls: ls[2:]),
        [],
        ["x.jsonl", "starts at token 1", "tokens 0..0 are missing"],
    ),
    "jsonl synthetic as string": (
        "x.jsonl",
        edit_jsonl(lambda ls: ['{"meta": {"synthetic": "false"}}', *ls]),
        [],
        ["x.jsonl", "line 1", "'synthetic' is 'false'"],
    ),
    "npy every slot empty": (
        "x.npy",
        write_npy(np.full((2, 2, 2), -1)),
        [],
        ["x.npy", "every expert slot is empty"],
    ),
    "npy empty --seq-starts": (
        "x.npy",
        write_npy(GOOD3),
        ["--seq-starts", ""],
        ["--seq-starts is empty"],
    ),
    "jsonl with --seq-starts": (
        "x.jsonl",
        write_text(jsonl_text()),
        ["--seq-starts", "0,1"],
        ["x.jsonl", "--seq-starts applies to .npy input"],
    ),
    # native / any
    "empty file": ("x.npz", write_text(""), [], ["x.npz", "the file is empty"]),
    "unknown content": (
        "x.bin",
        write_text("hello"),
        [],
        ["x.bin", "not a recognised trace format"],
    ),
    "json array": ("x.json", write_text("[1, 2]"), [], ["x.json", "top-level JSON array"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_one_clear_error_and_exit_1(cli, tmp_path, name):
    filename, write, options, fragments = CASES[name]
    src = tmp_path / filename
    write(src)
    result = cli("import", src, "-o", tmp_path / "out.npz", *options)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.output.startswith("error: ")
    assert len(result.output.strip().splitlines()) == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, (fragment, result.output)
    assert not (tmp_path / "out.npz").exists()


def test_truncated_native_file_and_missing_file(cli, tmp_path):
    path = save_trace(synthesize(tokens=300, layers=4, experts=8, top_k=2), tmp_path / "t.npz")
    path.write_bytes(path.read_bytes()[:1000])
    result = cli("info", path)
    assert result.exit_code == 1 and "t.npz" in result.output and "truncated" in result.output
    result = cli("info", tmp_path / "absent.npz")
    assert result.exit_code == 1 and "absent.npz: no such file" in result.output


def test_the_good_versions_of_these_files_import(cli, tmp_path):
    export_jsonl(
        synthesize(tokens=30, layers=2, experts=4, top_k=2, sequences=2), tmp_path / "g.jsonl"
    )
    (tmp_path / "r.json").write_text(json.dumps(routes_doc()))
    np.save(tmp_path / "g.npy", GOOD3)
    (tmp_path / "h.jsonl").write_text(jsonl_text())
    for name in ("g.jsonl", "r.json", "g.npy", "h.jsonl"):
        result = cli("import", tmp_path / name, "-o", tmp_path / f"{name}.npz")
        assert result.exit_code == 0, result.output


def test_joining_inputs_with_and_without_weights(cli, tmp_path):
    (tmp_path / "w.jsonl").write_text(jsonl_text())
    np.save(tmp_path / "n.npy", GOOD3)
    result = cli("import", tmp_path / "w.jsonl", tmp_path / "n.npy", "-o", tmp_path / "o.npz",
                 "--num-experts", "7")
    assert result.exit_code == 1 and "has no gate weights" in result.output
    assert "--drop-partial" in result.output
    result = cli("import", tmp_path / "w.jsonl", tmp_path / "n.npy", "-o", tmp_path / "o.npz",
                 "--num-experts", "7", "--drop-partial")
    assert result.exit_code == 0, result.output


def test_unwritable_output_and_bad_synth_seed_are_one_line(cli, tmp_path):
    np.save(tmp_path / "g.npy", GOOD3)
    (tmp_path / "dir.npz").mkdir()
    for args in (("import", tmp_path / "g.npy", "-o", tmp_path / "dir.npz"),
                 ("synth", "-o", tmp_path / "s.npz", "--seed", "-1")):
        result = cli(*args)
        assert result.exit_code == 1, result.output
        assert result.output.startswith("error: ") and len(result.output.strip().splitlines()) == 1
        assert "Traceback" not in result.output


def test_npy_export_keeps_the_given_name_and_its_side_file(cli, tmp_path):
    cli("synth", "-o", tmp_path / "s.npz", "--tokens", "60", "--sequences", "3")
    result = cli("export", tmp_path / "s.npz", "-o", tmp_path / "many.bin", "--format", "npy")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "many.bin").exists() and (tmp_path / "many.seq_starts.npy").exists()
    result = cli(
        "import", tmp_path / "many.bin", "-o", tmp_path / "back.npz", "--num-experts", "64"
    )
    assert result.exit_code == 0, result.output
    assert "S=3" in result.output
