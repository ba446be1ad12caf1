"""`stmoe profile` and `stmoe eval`: the documented flow and its errors."""

from __future__ import annotations

import json

import pytest

from conftest import CONTRACT_PREDICTORS, REAL_ROUTES, needs_shared, one_line_error

ALL = list(CONTRACT_PREDICTORS)


@needs_shared
def test_a_long_output_path_keeps_the_wrote_line_whole(cli, tmp_path):
    # off a terminal the line was wrapped at 160 columns: under pytest-xdist's longer
    # temporary folders "profiled on 82 tokens" broke across two lines
    tables = tmp_path / ("d" * 200) / "tables.npz"
    tables.parent.mkdir()
    result = cli("profile", REAL_ROUTES, "--split", "0.5", "-o", tables)
    assert result.exit_code == 0, result.output
    assert result.output == f"wrote {tables}: CCT for L=40 layers, N=256 experts, top-8, " \
        "row width 8, profiled on 82 tokens\n"


@needs_shared
def test_profile_first_half_eval_rest_on_the_real_sample(cli, tmp_path):
    tables, report = tmp_path / "tables.npz", tmp_path / "eval.json"
    result = cli("profile", REAL_ROUTES, "--split", "0.5", "-o", tables)
    assert result.exit_code == 0, result.output
    assert "profiled on 82 tokens" in result.output
    result = cli(
        "eval",
        REAL_ROUTES,
        "--tables",
        tables,
        "--split",
        "0.5",
        "--capacity",
        "16",
        "--json",
        report,
    )
    assert result.exit_code == 0, result.output
    for name in ALL:
        assert name in result.output
    data = json.loads(report.read_text())
    assert data["scope"] == "decode tokens, layers 1..39"
    assert data["trace"]["tokens"] == 82
    assert list(data["predictors"]) == ALL
    for entry in data["predictors"].values():
        assert {"recall", "precision", "set_size", "cache", "budget_curve"} <= set(entry)
    assert data["predictors"]["oracle"]["recall"] == 1.0
    assert data["predictors"]["ondemand"]["recall"] == 0.0
    # ST-MoE beats guessing by a wide margin on real routing.
    assert data["predictors"]["stmoe"]["recall"] > 3 * data["predictors"]["random"]["recall"]


def test_eval_json_to_stdout_and_without_tables(cli, tmp_path):
    trace = tmp_path / "s.npz"
    cli(
        "synth",
        "-o",
        trace,
        "--tokens",
        "300",
        "--layers",
        "4",
        "--experts",
        "16",
        "--top-k",
        "2",
        "--sequences",
        "3",
        "--domains",
        "3",
    )
    result = cli("eval", trace, "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["predictors"]) == {"ondemand", "previous-token", "random", "oracle"}
    assert "skipping stmoe" in result.stderr


def test_eval_cross_domain_matrix(cli, tmp_path):
    trace, tables = tmp_path / "s.npz", tmp_path / "t.npz"
    cli(
        "synth",
        "-o",
        trace,
        "--tokens",
        "900",
        "--layers",
        "4",
        "--experts",
        "16",
        "--top-k",
        "2",
        "--sequences",
        "6",
        "--domains",
        "3",
    )
    cli("profile", trace, "-o", tables)
    result = cli(
        "eval", trace, "--tables", tables, "--predictor", "stmoe", "--cross-domain", "--json", "-"
    )
    data = json.loads(result.stdout)
    assert len(data["cross_domain"]["recall"]) == 3
    assert list(data["predictors"]) == ["stmoe"]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--predictor", "magic"], "unknown predictor 'magic'"),
        (["--predictor", "stmoe"], "needs profiled tables"),
        (["--capacity", "1"], "--capacity '1' gives 1 experts per layer, below the router's top-2"),
        (
            ["--tables", "{other}"],
            "profiled for L=4 layers, N=8 experts, top-2 but the trace or model has "
            "L=4 layers, N=16 experts, top-2",
        ),
        (["--tables", "{missing}"], "no such tables file"),
        (["--tables", "{trace}"], "not an stmoe tables file"),
        (["--domain", "web"], "no sequence has domain 'web'"),
        (["--policy", "belady"], "--policy belady is the cache replay's: give --capacity C"),
    ],
)
def test_eval_errors_are_one_clear_line(cli, tmp_path, args, fragment):
    trace, other = tmp_path / "s.npz", tmp_path / "o.npz"
    cli("synth", "-o", trace, "--tokens", "100", "--layers", "4", "--experts", "16", "--top-k", "2")
    cli(
        "synth",
        "-o",
        tmp_path / "small.npz",
        "--tokens",
        "100",
        "--layers",
        "4",
        "--experts",
        "8",
        "--top-k",
        "2",
    )
    cli("profile", tmp_path / "small.npz", "-o", other)
    paths = {"other": other, "missing": tmp_path / "none.npz", "trace": trace}
    args = [a.format(**paths) for a in args]
    result = cli("eval", trace, *args)
    assert result.exit_code == 1, result.output
    assert fragment in result.output and "Traceback" not in result.output


def test_eval_tables_says_which_predictors_a_trace_without_lookahead_cannot_run(cli, tmp_path):
    trace, tables = tmp_path / "s.npz", tmp_path / "t.npz"
    cli("synth", "-o", trace, "--tokens", "300", "--layers", "4", "--experts", "16",
        "--top-k", "2", "--sequences", "2")
    assert cli("profile", trace, "-o", tables).exit_code == 0
    result = cli("eval", trace, "--tables", tables, "--json", "-")
    assert result.exit_code == 0, result.output
    ran = set(json.loads(result.stdout)["predictors"])
    assert not ran & {"hybrid", "gate-lookahead", "stmoe-mix"} and "stmoe-plus" in ran
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: skipping")]
    assert notes == [
        "note: skipping gate-lookahead, hybrid: the trace records no gate lookahead "
        "(`stmoe capture` of a transformers model records it)",
        "note: skipping stmoe-mix: run it by name (--predictor stmoe-mix) with tables of "
        "`stmoe profile --by-domain`",
    ]


def test_profiling_tables_that_cannot_fit_in_memory_is_one_line(cli, tmp_path, monkeypatch):
    """Issue 30, item 8: a declared N of 32767 is a valid trace, but its N x N count tables
    (56 GiB for 2 layers) are refused before anything is allocated."""
    import numpy as np

    from stmoe.trace import RoutingTrace, TraceMeta, save_trace

    ex = np.array([[[0, 32766], [5, 9]], [[7, 1], [32000, 2]]], np.int16)
    trace = RoutingTrace(ex, np.array([0]), np.zeros(2, bool),
                         TraceMeta(num_experts=32767, top_k=2, num_layers=2))
    save_trace(trace, tmp_path / "wide.npz")
    monkeypatch.setattr("stmoe.predictors.profiling.available_memory", lambda: 16 << 30)
    result = cli("profile", tmp_path / "wide.npz", "-o", tmp_path / "t.npz")
    one_line_error(result, "N=32767 experts", "needs about 224.0 GiB at its peak",
                   "56.0 GiB of N x N count tables", "16.0 GiB of memory is available",
                   "--layers")
    assert not (tmp_path / "t.npz").exists()
    from stmoe.predictors.base import ModelShape
    from stmoe.predictors.profiling import PEAK_FACTOR, check_table_memory, table_bytes

    assert table_bytes(ModelShape(8, 64, 2)) < 2**21  # ordinary models are far below
    check_table_memory(ModelShape(8, 64, 2))
    # the peak, not the counts alone, must fit: a quarter of it was let through before
    monkeypatch.setattr("stmoe.predictors.profiling.available_memory",
                        lambda: 2 * table_bytes(ModelShape(2, 2048, 2)))
    with pytest.raises(Exception, match="at its peak"):
        check_table_memory(ModelShape(2, 2048, 2))
    assert PEAK_FACTOR > 2


def test_eval_without_tables_gives_each_skipped_predictor_its_own_reason(cli, tmp_path):
    """A trace that records the gate lookahead: hybrid is skipped for want of tables (it
    needs both), not for a lookahead the trace has; gate-lookahead runs."""
    pytest.importorskip("torch")
    prompts, trace = tmp_path / "p.txt", tmp_path / "c.npz"
    prompts.write_text("def fib(n):\nThe river\n")
    assert cli("capture", "--prompts", prompts, "-o", trace, "--max-new-tokens", "4").exit_code == 0
    result = cli("eval", trace, "--json", "-")
    assert result.exit_code == 0, result.output
    assert "gate-lookahead" in json.loads(result.stdout)["predictors"]
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: skipping")]
    assert not any("records no gate lookahead" in n for n in notes), notes
    assert any(n.startswith("note: skipping") and "hybrid" in n and "no --tables" in n
               for n in notes), notes


def test_eval_table_has_no_column_that_repeats_recall(cli, tmp_path):
    trace = tmp_path / "s.npz"
    cli("synth", "-o", trace, "--tokens", "200", "--layers", "3", "--experts", "8",
        "--top-k", "2", "--sequences", "2")
    header = next(line for line in cli("eval", trace).output.splitlines() if "recall" in line)
    assert "prefill recall" in header and "decode" not in header, header


def test_eval_prints_the_equal_set_size_comparison_first(cli, tmp_path):
    """Recall grows with set size: `stmoe eval` shows every predictor at ST-MoE's mean set
    size first (issue 45), each figure the one its budget curve gives there."""
    from stmoe import load_trace
    from stmoe.evaluate.equal_size import recall_at_set_size
    from stmoe.evaluate.replay import replay
    from stmoe.predictors import load_tables
    from stmoe.trace import split_auto

    trace, tables, report = tmp_path / "s.npz", tmp_path / "t.npz", tmp_path / "e.json"
    cli("synth", "-o", trace, "--tokens", "600", "--layers", "4", "--experts", "16",
        "--top-k", "4", "--sequences", "2", "--seed", "3", "--spatial", "0.8")
    cli("profile", trace, "--split", "0.5", "-o", tables)
    result = cli("eval", trace, "--tables", tables, "--split", "0.5", "--json", report)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    equal = data["equal_set_size"]
    size = data["predictors"]["stmoe"]["set_size"]
    assert equal["reference"] == "stmoe" and equal["set_size"] == pytest.approx(size)
    assert next(iter(equal["recall"])) == "stmoe" and "ondemand" not in equal["recall"]
    assert equal["recall"]["stmoe"] == pytest.approx(data["predictors"]["stmoe"]["recall"])
    # stmoe-plus names K = 4 by default, ST-MoE more: at ST-MoE's size stmoe-plus's recall
    # is that of its sets cut from 4K to the size, not its default's
    held_out = split_auto(load_trace(trace), 0.5)[1]
    wide = replay(held_out, ["stmoe-plus"], load_tables(tables), options={"set_size": 16})
    curve = wide.to_dict()["predictors"]["stmoe-plus"]["budget_curve"]
    assert equal["recall"]["stmoe-plus"] == pytest.approx(recall_at_set_size(curve, size))
    assert equal["own_set_size"]["stmoe-plus"] == pytest.approx(4.0) and size > 4.5
    assert equal["recall"]["stmoe-plus"] > data["predictors"]["stmoe-plus"]["recall"]
    # printed first, labelled, then the table at each predictor's own set size
    text = " ".join(result.output.split())  # titles wrap at their table's width
    first = text.index(f"At equal set size: {size:.2f} experts per prediction (stmoe's mean)")
    assert first < text.index("each predictor at its own set size")
    gain = 100 * (equal["recall"]["stmoe-plus"] - equal["recall"]["stmoe"])
    assert f"{gain:+.1f}" in text[first:text.index("each predictor at its own set size")]
    # the user's own sizes: no second comparison
    again = cli("eval", trace, "--tables", tables, "--split", "0.5", "--set-size", "3",
                "--json", report)
    assert "At equal set size" not in again.output
    assert "equal_set_size" not in json.loads(report.read_text())


def test_eval_notes_tables_of_another_model_or_of_synthetic_routing(cli, tmp_path):
    """Tables of the same shape are taken whoever they were profiled on; the note says when
    that was another model's routing, or SYNTHETIC routing."""
    import dataclasses

    import stmoe

    mine = stmoe.synthesize(tokens=60, layers=3, experts=8, top_k=2, sequences=2, seed=1)
    real = dataclasses.replace(mine, meta=dataclasses.replace(mine.meta, model="model-a",
                                                              synthetic=False))
    other = dataclasses.replace(real, meta=dataclasses.replace(real.meta, model="model-b"))
    paths = {name: tmp_path / f"{name}.npz" for name in ("syn", "a", "b")}
    for name, trace in (("syn", mine), ("a", real), ("b", other)):
        stmoe.save_trace(trace, paths[name])
        assert cli("profile", paths[name], "-o", tmp_path / f"t-{name}.npz").exit_code == 0
    for tables, says in (("syn", "profiled on SYNTHETIC routing"),
                         ("b", "profiled on 'model-b''s routing"), ("a", None)):
        res = cli("eval", paths["a"], "--tables", tmp_path / f"t-{tables}.npz",
                  "--predictor", "stmoe")
        assert res.exit_code == 0, res.output
        notes = [line for line in res.output.splitlines() if "were profiled on" in line]
        assert (says in " ".join(notes)) if says else not notes, (tables, res.output)


def test_eval_says_what_the_cross_domain_matrix_and_the_cache_columns_cover(cli, tmp_path):
    """(A review: the matrix left out a domain the --split kept for profiling, and dropped
    --horizon, without a word; the cache columns count layer 0, recall does not.)"""
    trace = tmp_path / "s.npz"
    cli("synth", "-o", trace, "--tokens", "900", "--layers", "4", "--experts", "16",
        "--top-k", "2", "--sequences", "6", "--domains", "3")
    res = cli("eval", trace, "--predictor", "random", "--cross-domain", "--domain",
              "synth-1")
    said = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "synth-0, synth-2 left out by --split or --domain" in said, said
    res = cli("eval", trace, "--predictor", "random", "--capacity", "4")
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "The cache columns replay every layer, layer 0 included" in said
