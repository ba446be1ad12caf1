"""Correlation analysis: calibrated on null traces, sensitive on correlated ones, and a
report that opens on the real sample."""

from __future__ import annotations

import json

import numpy as np
import pytest

import stmoe
from conftest import REAL_ROUTES, needs_shared
from stmoe.analysis.evidence import spatial, temporal
from stmoe.analysis.stats import batch_means_ci, reuse_distances, spatial_test


def test_independent_generator_gives_no_more_significant_pairs_than_chance():
    # 5 seeds x 15 pairs = 75 tests at alpha 0.01: 0.75 expected by chance;
    # P(>= 5 | Binomial(75, 0.01)) < 0.001.
    significant, ratios_cover_one = 0, 0
    for seed in range(5):
        trace = stmoe.synthesize(tokens=2000, layers=16, experts=32, top_k=4, sequences=4,
                                 spatial=0.0, temporal=0.0, skew=0.5 * seed, seed=seed)
        s = spatial(trace)
        assert s["pairs_total"] == 15
        significant += s["pairs_significant"]
        if seed == 0:  # uniform load: E[overlap] is exactly K^2/N
            lo, hi = temporal(trace)["overlap_ratio_ci"]
            ratios_cover_one += lo <= 1.0 <= hi
    assert significant <= 4
    assert ratios_cover_one == 1


def test_correlated_generator_gives_significant_pairs_and_a_high_overlap_ratio():
    trace = stmoe.synthesize(tokens=2000, layers=8, experts=32, top_k=4, sequences=4,
                             spatial=0.8, temporal=0.5, seed=3)
    s, t = spatial(trace), temporal(trace)
    assert s["pairs_significant"] == s["pairs_total"] == 7
    assert t["overlap_ratio"] > 3 and t["overlap_ratio_ci"][0] > 3


def test_with_one_expert_per_token_the_statistic_is_pearsons_chi_square():
    trace = stmoe.synthesize(tokens=3000, layers=2, experts=4, top_k=1, sequences=1,
                             spatial=0.3, temporal=0.0, seed=1)
    test = spatial_test(np.asarray(trace.experts), 0, 4)
    assert test.statistic == pytest.approx(test.pearson_statistic, rel=1e-9)
    assert test.dof == 9 and test.rows_pooled == 0


def test_sparse_counts_are_pooled_until_cochrans_rule_holds():
    trace = stmoe.synthesize(tokens=150, layers=2, experts=64, top_k=2, sequences=1,
                             spatial=0.9, temporal=0.0, skew=1.0, seed=2)
    test = spatial_test(np.asarray(trace.experts), 0, 64)
    used = int((np.bincount(trace.experts[:, 0].ravel(), minlength=64) > 0).sum())
    assert test.rows_kept + test.rows_pooled == used
    assert test.rows_pooled > 0 and test.rows_empty == 64 - used


def test_batch_means_interval_widens_with_autocorrelation():
    rng = np.random.default_rng(0)
    iid = rng.normal(size=4000)
    sticky = np.repeat(rng.normal(size=200), 20)  # same mean and variance, long runs
    a, b = batch_means_ci(iid), batch_means_ci(sticky)
    assert a.ci_low < 0 < a.ci_high
    assert (b.ci_high - b.ci_low) > 2 * (a.ci_high - a.ci_low)


def test_reuse_distance_by_hand():
    # One layer, K=1: expert 3 at t=0,2,3; expert 1 at t=1 -> distances 2 and 1.
    ex = np.array([[[3]], [[1]], [[3]], [[3]]], dtype=np.int16)
    trace = stmoe.RoutingTrace(ex, np.array([0]), np.zeros(4, bool),
                               stmoe.TraceMeta(num_experts=4, top_k=1, num_layers=1))
    hist = reuse_distances(trace, max_distance=4)
    assert hist.tolist() == [0, 1, 1, 0, 0]


def test_report_with_domains(cli, tmp_path):
    trace = tmp_path / "s.npz"
    cli("synth", "-o", trace, "--tokens", "1200", "--layers", "4", "--experts", "16",
        "--top-k", "2", "--sequences", "6", "--domains", "3")
    rep = tmp_path / "rep"
    result = cli("analyze", trace, "-o", rep, "--json", rep / "analysis.json")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "rep" / "analysis.json").read_text())
    assert set(data["domains"]["per_domain"]) == {"synth-0", "synth-1", "synth-2"}
    assert len(data["domains"]["js_divergence_per_layer"]["synth-0 vs synth-1"]) == 4
    assert (tmp_path / "rep" / "domains.png").exists()
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "SYNTHETIC" in report
    assert "## 4. Domains" in report and "## 5. Predictability" in report
    one = tmp_path / "one.npz"  # one domain: no Domains section, and no gap in the numbers
    cli("synth", "-o", one, "--tokens", "600", "--layers", "4", "--experts", "16",
        "--top-k", "2", "--sequences", "4", "--domains", "1")
    assert cli("analyze", one, "-o", tmp_path / "rep1").exit_code == 0
    titles = [line for line in (tmp_path / "rep1" / "report.md").read_text().splitlines()
              if line.startswith("## ")]
    assert titles == ["## Summary", "## 1. Spatial (cross-layer) correlation",
                      "## 2. Temporal (cross-token) correlation", "## 3. Load and skew",
                      "## 4. Predictability"], titles


@needs_shared
def test_report_on_the_real_sample(cli, tmp_path):
    out = tmp_path / "rep"
    result = cli("analyze", REAL_ROUTES, "-o", out, "--json", out / "analysis.json")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "analysis.json").read_text())
    assert data["spatial"]["pairs_total"] == 39
    assert data["spatial"]["pairs_significant"] >= 30
    assert data["temporal"]["overlap_ratio"] > 2
    for name in ("spatial_grid", "spatial_example", "spatial_tests", "temporal_overlap",
                 "reuse_distance", "load", "predictability"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"{name}.png" in (out / "report.md").read_text()
        assert f'src="{name}.png"' in (out / "report.html").read_text()


def test_the_predictability_curves_show_every_predictor_ranked_to_4k():
    from stmoe.analysis.evidence import predictability

    trace = stmoe.synthesize(tokens=400, layers=4, experts=16, top_k=2, sequences=4, seed=2)
    p = predictability(trace)
    assert {"stmoe", "stmoe-plus", "frequency", "oracle"} <= set(p["curves"])
    plus = p["curves"]["stmoe-plus"]
    assert plus["set_size"][-1] > 2 * trace.top_k  # ranked beyond K for the curve
    assert abs(p["set_size"]["stmoe-plus"] - trace.top_k) < 1e-9  # the table: its default size


def test_a_layer_whose_every_slot_is_empty_is_reported_not_a_crash(cli, tmp_path):
    """Issue 30, item 8: -1 in every slot of a layer is legal (docs/trace-format.md); the
    layer pairs with it have nothing to test, said in a note, and the rest is tested."""
    import dataclasses

    from stmoe.trace import save_trace

    trace = stmoe.synthesize(tokens=300, layers=4, experts=8, top_k=2, sequences=2, seed=1)
    ex = np.array(trace.experts)
    ex[:, 2] = -1
    trace = dataclasses.replace(trace, experts=ex, weights=None)
    for layer in (1, 2):
        test = spatial_test(ex, layer, 8)
        assert (test.dof, test.p_value, test.significant) == (0, 1.0, False)
    save_trace(trace, tmp_path / "t.npz")
    result = cli("analyze", tmp_path / "t.npz", "-o", tmp_path / "rep", "--json",
                 tmp_path / "a.json")
    assert result.exit_code == 0, result.output
    assert "note: layer 2 routed no token (every slot -1)" in result.output
    data = json.loads((tmp_path / "a.json").read_text())
    assert data["spatial"]["pairs_total"] == 3
    assert [p["dof"] > 0 for p in data["spatial"]["pairs"]] == [True, False, False]


def test_a_trace_of_one_token_sequences_has_no_temporal_evidence(cli, tmp_path):
    """No two tokens follow each other: the report says so, not an overlap of 0.00x."""
    stmoe.save_trace(stmoe.synthesize(tokens=3, layers=4, experts=8, top_k=2, sequences=3),
                     tmp_path / "t.npz")
    result = cli("analyze", tmp_path / "t.npz", "-o", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    assert "no consecutive tokens to compare" in result.output and "0.00x" not in result.output
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "no consecutive pairs to compare" in report and "0.00x" not in report


def test_a_layer_that_routed_nothing_stays_out_of_the_temporal_headline():
    """Random routing is 1.0x random at every routed layer; an all-empty layer has no
    ratio (null) and no longer pulls the headline down (it read 0.84x: a review)."""
    trace = stmoe.synthesize(tokens=2000, layers=6, experts=16, top_k=2, sequences=2,
                             spatial=0.0, temporal=0.0, seed=4)
    experts = trace.experts.copy()
    experts[:, 3] = -1
    empty = stmoe.RoutingTrace(experts, trace.seq_starts, trace.is_decode, trace.meta,
                               domains=trace.domains)
    t = temporal(empty)
    assert t["per_layer"][3]["ratio"] is None and t["per_layer"][3]["ratio_vs_load"] is None
    full = temporal(trace)
    assert t["overlap_ratio"] > 0.85 and abs(t["overlap_ratio"] - full["overlap_ratio"]) < 0.1
