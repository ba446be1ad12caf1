"""Layer ranges (issue 27): `N` or `A:B` of a trace's MoE layers, for profile, make-model and
generate --routing, so a cut from the middle of a model can be measured."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stmoe import synthesize
from stmoe.errors import TraceError
from stmoe.trace import SynthSpec, save_trace
from stmoe.trace.select import first_layers, select_layers
from stmoe.util.units import UnitError, parse_layer_range


def test_the_grammar():
    assert parse_layer_range("8", 24) == (0, 8) and parse_layer_range(8, 24) == (0, 8)
    assert parse_layer_range("8:16", 24) == (8, 16) and parse_layer_range(" 0:24 ", 24) == (0, 24)
    for bad in ("0", "16:8", "8:8", "20:30", "-1:4", "a:b", "8-16", ""):
        with pytest.raises(UnitError, match="--layers"):
            parse_layer_range(bad, 24)


def test_a_middle_cut_keeps_those_layers_renumbered_from_zero():
    trace = synthesize(SynthSpec(tokens=50, layers=12, experts=16, top_k=2, sequences=1, seed=3))
    cut = select_layers(trace, "4:9")
    assert cut.num_layers == 5 and cut.meta.num_layers == 5
    assert np.array_equal(cut.experts, trace.experts[:, 4:9])
    assert np.array_equal(cut.weights, trace.weights[:, 4:9])
    assert select_layers(trace, 5).experts.tolist() == first_layers(trace, 5).experts.tolist()
    assert select_layers(trace, "0:12") is trace
    with pytest.raises(TraceError, match="there are 12 MoE layers"):
        select_layers(trace, "4:13")


def test_profile_and_make_model_take_a_range(cli, tmp_path):
    trace = synthesize(SynthSpec(tokens=400, layers=12, experts=16, top_k=2,
                                 sequences=2, seed=1))
    save_trace(trace, tmp_path / "t.npz")
    done = cli("profile", tmp_path / "t.npz", "--layers", "4:9", "-o", tmp_path / "tab.npz")
    assert done.exit_code == 0, done.output
    from stmoe.predictors import load_tables

    assert load_tables(tmp_path / "tab.npz").shape.num_layers == 5
    bad = cli("profile", tmp_path / "t.npz", "--layers", "9:4", "-o", tmp_path / "x.npz")
    assert bad.exit_code == 1 and "expected N in 1..12 or A:B" in bad.output
    made = cli("make-model", "--like", "qwen1.5-moe-a2.7b", "--layers", "8:16", "-o",
               tmp_path / "m", "--dry-run")
    assert made.exit_code == 0 and "8 MoE layers" in made.output, made.output
    over = cli("make-model", "--like", "qwen1.5-moe-a2.7b", "--layers", "20:30", "-o",
               tmp_path / "m", "--dry-run")
    assert over.exit_code == 1 and "there are 24 MoE layers" in over.output


def test_generate_replays_a_middle_cut_of_a_deeper_trace(cli, tmp_path):
    """The shipped model (8 MoE layers, 16 experts, top-4) replays layers 8..15 of a
    16-layer trace of its width; a cut of another depth is one clear line."""
    pytest.importorskip("torch")
    trace = synthesize(SynthSpec(tokens=30, layers=16, experts=16, top_k=4,
                                 sequences=1, seed=2))
    save_trace(trace, tmp_path / "deep.npz")
    common = ("generate", "--routing", tmp_path / "deep.npz", "--max-new-tokens", "4",
              "--tier", "emulated", "--bandwidth", "1GB", "--predictor", "ondemand")
    done = cli(*common, "--layers", "8:16", "--json", tmp_path / "r.json")
    assert done.exit_code == 0, done.output
    wrong = cli(*common, "--layers", "8:12")
    assert wrong.exit_code == 1 and "4 MoE layers of the trace for a model of 8" in wrong.output
    made = cli("profile", tmp_path / "deep.npz", "--layers", "0:8", "-o", tmp_path / "tab.npz")
    assert made.exit_code == 0, made.output
    other = cli(*common[:-1], "stmoe", "--tables", tmp_path / "tab.npz", "--layers", "8:16")
    assert other.exit_code == 1 and "MoE layers 0-7 but the trace replays layers 8-15" in \
        other.output, other.output
    alone = cli("generate", "--prompt", "x", "--layers", "0:8")
    assert alone.exit_code == 1 and "--layers applies to --routing" in alone.output


def test_a_cut_names_the_model_layers_it_kept():
    """A cut keeps its layers' model numbers (composed over cuts, and over a trace that
    names its own), so tables profiled on one cut are told from another's; a cut from
    layer 0 names none, as the whole trace does."""
    trace = synthesize(SynthSpec(tokens=20, layers=12, experts=8, top_k=2, sequences=1, seed=1))
    assert select_layers(trace, "4:9").meta.extra["model_layer_ids"] == [4, 5, 6, 7, 8]
    assert select_layers(select_layers(trace, "4:9"), "1:3").meta.extra["model_layer_ids"] == [5, 6]
    assert "model_layer_ids" not in first_layers(trace, 5).meta.extra
    named = dataclasses.replace(trace, meta=dataclasses.replace(
        trace.meta, extra={"model_layer_ids": list(range(1, 13))}))
    assert select_layers(named, "0:3").meta.extra["model_layer_ids"] == [1, 2, 3]


def test_tables_of_one_cut_are_refused_for_another(cli, tmp_path):
    """`profile --layers 4:9` tables have the shape of layers 0-4 too: replaying those with
    them (eval, simulate) is refused naming both, the same cut is accepted, and tables
    without the record (older files) are checked by shape only."""
    from stmoe.evaluate.replay import replay
    from stmoe.predictors import PredictorError, load_tables, profile, save_tables

    trace = synthesize(SynthSpec(tokens=400, layers=12, experts=60, top_k=4, sequences=2,
                                 seed=1))  # qwen1.5-moe-a2.7b's width, for simulate
    save_trace(trace, tmp_path / "t.npz")
    save_trace(select_layers(trace, "4:9"), tmp_path / "cut.npz")
    done = cli("profile", tmp_path / "t.npz", "--layers", "4:9", "-o", tmp_path / "tab.npz")
    assert done.exit_code == 0, done.output
    tables = load_tables(tmp_path / "tab.npz")
    assert tables.info["model_layer_ids"] == [4, 5, 6, 7, 8]
    front = select_layers(trace, 5)
    with pytest.raises(PredictorError, match=r"MoE layers 4-8 but the trace replays layers 0-4"):
        replay(front, ["stmoe"], tables)
    assert replay(select_layers(trace, "4:9"), ["stmoe"], tables).results
    save_trace(front, tmp_path / "front.npz")
    for command in (("eval", tmp_path / "front.npz", "--tables", tmp_path / "tab.npz"),
                    ("simulate", tmp_path / "front.npz", "--tables", tmp_path / "tab.npz",
                     "--model", "qwen1.5-moe-a2.7b", "--layers", "5")):
        refused = cli(*command)
        assert refused.exit_code == 1 and "layers 4-8" in refused.output, refused.output
        assert "the same --layers" in refused.output
    ok = cli("eval", tmp_path / "cut.npz", "--tables", tmp_path / "tab.npz", "--predictor",
             "stmoe")
    assert ok.exit_code == 0, ok.output
    old = profile(select_layers(trace, "4:9"))
    del old.info["model_layer_ids"]
    save_tables(old, tmp_path / "old.npz")
    assert replay(front, ["stmoe"], load_tables(tmp_path / "old.npz")).results
