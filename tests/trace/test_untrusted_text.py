"""What an import option or a file's own metadata says, held against the data: a
``--num-experts`` that contradicts the file's N, a routes or JSON Lines file whose
phases or counts disagree with its metadata (or whose layer keys are not plain numbers),
traces of other model layers joined. Each is refused in one line naming the file, the
position and what was expected.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_engine_files import expert_drop_records, moedropt
from test_importers import routes_doc

from conftest import one_line_error
from stmoe import TraceError, synthesize
from stmoe.trace import save_trace
from stmoe.trace.export import export_jsonl
from stmoe.trace.select import concat


def test_num_experts_option_must_agree_with_the_files_own(cli, tmp_path):
    """Where a file says N, --num-experts may repeat it, never override it."""
    (tmp_path / "r.json").write_text(json.dumps(routes_doc()))  # meta: num_experts 5
    export_jsonl(synthesize(tokens=12, layers=2, experts=6, top_k=2), tmp_path / "j.jsonl")
    ne, recs = expert_drop_records()
    (tmp_path / "d.bin").write_bytes(moedropt(ne, recs))
    files = {"r.json": 5, "j.jsonl": 6, "d.bin": ne}
    for name, n in files.items():
        out = tmp_path / f"{name}.npz"
        one_line_error(cli("import", tmp_path / name, "-o", out, "--num-experts", n + 3),
                       name, f"--num-experts {n + 3} contradicts the file's {n}",
                       f"expected --num-experts {n} or none: the file says N")
        assert not out.exists()
        done = cli("import", tmp_path / name, "-o", out, "--num-experts", n)
        assert done.exit_code == 0, done.output


def test_num_experts_option_must_agree_with_router_logits_width(cli, tmp_path):
    torch = pytest.importorskip("torch")
    torch.save(tuple(torch.randn(4, 8) for _ in range(2)), tmp_path / "logits.pt")
    one_line_error(cli("import", tmp_path / "logits.pt", "-o", tmp_path / "o.npz",
                       "--top-k", "2", "--num-experts", "16"),
                   "logits.pt", "--num-experts 16 contradicts the file's 8")
    done = cli("import", tmp_path / "logits.pt", "-o", tmp_path / "o.npz", "--top-k", "2",
               "--num-experts", "8")
    assert done.exit_code == 0, done.output
    assert np.load(tmp_path / "o.npz")["experts"].shape == (4, 2, 2)


def test_joining_traces_of_other_model_layers_is_refused(cli, tmp_path):
    trace = synthesize(tokens=12, layers=2, experts=6, top_k=2)
    at = {name: trace.with_meta(extra={**trace.meta.extra, "model_layer_ids": ids})
          for name, ids in (("a", [1, 3]), ("b", [1, 2]), ("c", [1, 3]))}
    with pytest.raises(TraceError, match=r"trace 1: trace 1 has model_layer_ids \[1, 2\] but "
                       r"trace 0 has \[1, 3\] \(expected traces of the same model layers\)"):
        concat([at["a"], at["b"]])
    with pytest.raises(TraceError, match=r"model_layer_ids \[0, 1\] but trace 0 has \[1, 3\]"):
        concat([at["a"], trace])  # no ids: layers 0..L-1
    assert concat([at["a"], at["c"]]).meta.extra["model_layer_ids"] == [1, 3]
    for name, t in at.items():
        save_trace(t, tmp_path / f"{name}.npz")
    one_line_error(cli("import", tmp_path / "a.npz", tmp_path / "b.npz", "-o",
                       tmp_path / "out.npz"), "a.npz", "b.npz", "cannot be joined",
                   "trace 1 has model_layer_ids [1, 2] but trace 0 has [1, 3]")
    assert not (tmp_path / "out.npz").exists()


def test_routes_phases_and_declared_counts_must_hold(cli, tmp_path):
    """routes_doc: token 0 prefill, the rest decode."""
    def refused(doc, *fragments):
        (tmp_path / "r.json").write_text(json.dumps(doc))
        one_line_error(cli("import", tmp_path / "r.json", "-o", tmp_path / "out.npz"),
                       "r.json", *fragments)
        assert not (tmp_path / "out.npz").exists()

    doc = routes_doc(n_tokens=4)
    doc["routes"][2]["phase"] = "prefill"  # a prefill route among decode ones
    refused(doc, "route 2 (token_pos 2)", "a prefill token after a decode token of its "
            "sequence", "prefill tokens, then decode tokens, in each sequence")
    cut = routes_doc(n_tokens=4, total_tokens=6, prompt_len=1, generated_len=5)
    refused(cut, "meta: the metadata says total_tokens 6 but the file holds 4 routes",
            "expected 6 routes", "truncated")
    refused(routes_doc(n_tokens=4, prompt_len=2), "the metadata says prompt_len 2 but the "
            "file holds 1 prefill routes")
    refused(routes_doc(n_tokens=4, generated_len=4), "the metadata says generated_len 4 but "
            "the file holds 3 decode routes")
    refused(routes_doc(n_tokens=4, prompt_len="1"), "metadata 'prompt_len' is '1'",
            "an integer >= 0")
    whole = routes_doc(n_tokens=4, total_tokens=4, prompt_len=1, generated_len=3)
    (tmp_path / "ok.json").write_text(json.dumps(whole))
    assert cli("import", tmp_path / "ok.json", "-o", tmp_path / "ok.npz").exit_code == 0


def test_jsonl_prefill_after_decode_is_refused(cli, tmp_path):
    rows = [{"seq": s, "token": t, "layer": 0, "experts": [t % 4, (t + 1) % 4],
             "phase": "decode" if (s, t) in ((0, 2), (1, 0)) else "prefill"}
            for s in (0, 1) for t in range(3)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one_line_error(cli("import", path, "-o", tmp_path / "out.npz"), "p.jsonl",
                   "line 5, sequence 1, token 1", "a prefill token after a decode token")
    rows[3]["phase"] = "prefill"  # sequence 0 ends decode; sequence 1 starts prefill: fine
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli("import", path, "-o", tmp_path / "out.npz").exit_code == 0


def test_routes_layer_keys_are_plain_digits(cli, tmp_path):
    """int() reads "1_0" as 10 and " 1" as 1: another spelling of a layer number."""
    for key in ("1_0", " 1", "+1"):
        doc = routes_doc(n_tokens=2, layers=(0, 10))
        for route in doc["routes"]:
            route["layers"][key] = route["layers"].pop("10")
        (tmp_path / "r.json").write_text(json.dumps(doc))
        one_line_error(cli("import", tmp_path / "r.json", "-o", tmp_path / "out.npz"),
                       "r.json", f"route 0: layer key {key!r}", "integer layer numbers")
    assert not (tmp_path / "out.npz").exists()
