"""Layer ranges (issue 27): `N` or `A:B` of a trace's MoE layers, for profile, make-model and
generate --routing, so a cut from the middle of a model can be measured."""

from __future__ import annotations

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
    alone = cli("generate", "--prompt", "x", "--layers", "0:8")
    assert alone.exit_code == 1 and "--layers applies to --routing" in alone.output
