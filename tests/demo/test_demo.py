"""The main job: a reduced `stmoe demo --quick` on the shipped model, and the report's parts."""

from __future__ import annotations

import json
import re

import pytest

from stmoe.analysis.report import recall_at_set_size
from stmoe.demo.text import (
    VERDICT,
    ablation_reasons,
    details,
    headline,
    markdown_html,
    shipped_line,
)
from stmoe.evaluate.compare import against
from stmoe.models import SHIPPED_MODEL

# every metric the report uses, defined in one line where it first appears
DEFINED = ("decode tokens/s:", "hit rate:", "stall share:", "prefetch recall:",
           "prefetch precision:", "K:", "recall:", "set size:", "precision:",
           "hit rate (2K cache):", "normalized time:", "HT:", "CCT:")


def test_shipped_model_loads_with_plain_transformers():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    assert model.config.model_type == "qwen2_moe"
    assert 16 <= model.config.num_experts <= 64 and 8 <= model.config.num_hidden_layers <= 16
    assert len(tok("def f(x):\n    return x")["input_ids"]) > 3
    size = sum(p.stat().st_size for p in SHIPPED_MODEL.iterdir())
    assert size <= 50 * 2**20


def test_quick_demo_writes_the_report(quick_demo):
    result, folder = quick_demo
    assert result.exit_code == 0, result.output
    assert f"report: {folder.resolve() / 'index.html'}  (" in result.output  # where -o said
    page = (folder / "index.html").read_text()
    evaluation = json.loads((folder / "eval.json").read_text())
    assert set(evaluation["per_domain"]) == {"code", "prose", "math"}
    for fragment in ("Headline.", "At equal set size: compare predictors here",
                     "Each predictor at its own set size", "the budget curve", "Cross-domain",
                     "Simulator", "expected to be poor", "<pre>"):
        assert fragment in page
    # the equal-set-size table comes first, at each domain's ST-MoE set size
    assert page.index("At equal set size") < page.index("Each predictor at its own set size")
    for d, r in evaluation["per_domain"].items():
        equal = r["equal_set_size"]
        assert equal["set_size"] == pytest.approx(r["predictors"]["stmoe"]["set_size"])
        assert f"{d} {equal['set_size']:.2f}" in page
        if equal["recall"]["stmoe-plus"] is not None:
            assert f"{equal['recall']['stmoe-plus']:.3f}" in page
    text = " ".join(result.output.split())
    assert text.index("at equal set size: ST-MoE's own mean") < text.index(
        "at each predictor's own set size")
    for term in DEFINED:
        assert f"<dt>{term}</dt>" in page.replace("&#x27;", "'"), term
    for name in ("analysis/report.html", "simulator/normalized_time.png", "decode_speed.png",
                 "model-card.html", "model-card.md"):
        assert (folder / name).is_file(), name
    assert "href='model-card.html'" in page and "href='analysis/report.html'" in page


def test_quick_demo_measures_rounds_and_checks_the_tokens(quick_demo):
    result, folder = quick_demo
    off = json.loads((folder / "offload.json").read_text())  # the headline's: real sizes
    shipped = json.loads((folder / "offload-shipped.json").read_text())
    assert off["expert_mib"] == pytest.approx(6.0) and shipped["expert_mib"] < 0.25
    assert "held out" in off["tables"] and "replayed" in off["routing"] and off["layers"] == 2
    assert set(off["systems"]) == {"on-demand", "lru-only", "stmoe", "stmoe-plus",
                                   "stmoe-plus-all", "oracle"}
    for section in (off, shipped):
        assert section["rounds"] == 2 and section["new_tokens"] == 8
        assert len(section["reference_tokens"]) == 8 and section["identical_tokens"] is True
        for name, row in section["systems"].items():
            runs = row["decode_tokens_per_s_runs"]
            assert len(runs) == 2 and row["identical_to_reference"] is True, name
            assert row["decode_tokens_per_s_range"] == [min(runs), max(runs)]
            assert row["decode_tokens_per_s"] == pytest.approx(sum(runs) / 2)  # median of 2
    page = (folder / "index.html").read_text()
    # the headline: one sentence with ST-MoE's, stmoe-plus's and lru-only's medians, as
    # offload.json has them; the other systems in the paragraph after the figure
    sentence = re.search(r"<p class='headline' id='headline'><b>Headline.</b> (.*?)</p>",
                         page).group(1).replace("&#x27;", "'")
    assert sentence.count(". ") == 0 and sentence.endswith(".")
    for name in ("lru-only", "stmoe", "stmoe-plus"):
        assert f"{off['systems'][name]['decode_tokens_per_s']:.1f}" in sentence, name
    assert details(off).replace("'", "&#x27;") in page
    for name in ("on-demand", "oracle", "stmoe-plus-all"):
        assert f"{name} {off['systems'][name]['decode_tokens_per_s']:.1f}" in details(off)
    # printed unwrapped: the headline on one line, the generated text exactly as generated
    lines = result.output.splitlines()
    assert headline(off) in lines and details(off) in lines, result.output
    assert any(x.startswith("At the shipped model's own sizes (216 KiB experts")
               for x in lines), result.output
    # two rounds: each verdict by the rule (compare.against) in plain words, never an
    # unearned "faster"
    for name in ("stmoe", "stmoe-plus"):
        mine = off["systems"][name]["decode_tokens_per_s_runs"]
        base = off["systems"]["lru-only"]["decode_tokens_per_s_runs"]
        assert f"({VERDICT[against(mine, base)]})" in sentence, name
    assert shipped["prompt"] + shipped["text"] in result.output


def test_quick_demo_marks_the_lossy_system(quick_demo):
    _, folder = quick_demo
    page = (folder / "index.html").read_text()
    sim = json.loads((folder / "simulator" / "simulate.json").read_text())
    dropped = sim["systems"]["adap-gating"]["quality"]["dropped_gate_mass"]
    row = re.search(r"<tr><td>adap-gating</td>.*?</tr>", page).group(0)
    assert "LOSSY: runs" in row and f"dropping {dropped:.1%} of the gate weight" in row
    oracle = sim["systems"]["oracle"]["normalized_time"]
    adap = sim["systems"]["adap-gating"]["normalized_time"]
    assert "adap-gating is lossy: it runs fewer experts than the router chose" in page
    assert (f"Here it beats even the lossless oracle ({adap:.3f} against {oracle:.3f})" in page
            ) is (adap < oracle)


def test_recall_at_set_size_reads_the_curve():
    curve = {"set_size": [1.0, 2.0, 3.0, 3.5, 3.5], "recall": [0.2, 0.4, 0.5, 0.55, 0.55]}
    assert recall_at_set_size(curve, 2.0) == pytest.approx(0.4)
    assert recall_at_set_size(curve, 2.5) == pytest.approx(0.45)  # linear between budgets
    assert recall_at_set_size(curve, 0.5) == pytest.approx(0.1)  # from (0, 0)
    assert recall_at_set_size(curve, 3.5) == pytest.approx(0.55)
    assert recall_at_set_size(curve, 4.0) is None  # its sets never get that large


def _offload(rounds: int, same: bool = True) -> dict:
    speeds = {"on-demand": 4.0, "lru-only": 30.0, "stmoe": 45.25, "stmoe-plus": 41.0,
              "hybrid": 40.0, "oracle": 60.0}
    return {"capacity": "50%", "link": "1GB", "rounds": rounds, "identical_tokens": same,
            "reference": "the same routing with every expert cached", "expert_mib": 6.0,
            "routing": "the shipped model's routing of demo prompt 0, replayed",
            "systems": {n: {"decode_tokens_per_s": v, "decode_tokens_per_s_range": [v - 1, v + 2],
                            "decode_tokens_per_s_runs": [v - 1, v, v + 2][:max(rounds, 1)]}
                        for n, v in speeds.items()}}


def test_headline_is_one_sentence_with_plain_verdicts():
    text = headline(_offload(5))
    assert text == ("At real expert sizes (6.0 MiB experts, RANDOM weights, 50% of each "
                    "layer's cached, an EMULATED 1GB/s link), ST-MoE prefetching decodes at "
                    "45.2 tokens/s (faster: ranges apart) and stmoe-plus at 41.0 (faster: "
                    "ranges apart), against 30.0 for an LRU cache alone (medians of 5 rounds).")
    more = details(_offload(5))
    assert "on-demand 4.0 (range 3.0-6.0); lru-only 30.0 (range 29.0-32.0)" in more
    assert "oracle 60.0 (range 59.0-62.0)" in more
    assert "Against the LRU cache alone: stmoe 1.51x (faster: ranges apart)" in more
    assert "stmoe-plus 1.37x (faster: ranges apart)" in more
    assert "identical to the same routing with every expert cached" in more
    assert "on-demand loading waits" not in more  # the fixture has no stall share
    single = _offload(1, same=False)
    assert "(one run each: --rounds N gives medians and ranges)" in headline(single)
    assert "(one run: no verdict)" in headline(single) and "(range" not in details(single)
    assert "NOT every run's tokens matched" in details(single)


def test_the_headline_claims_a_win_over_lru_only_only_outside_the_noise():
    off = _offload(3)
    runs = {"lru-only": [29.0, 30.0, 31.0], "stmoe": [29.5, 30.5, 32.0],
            "stmoe-plus": [27.0, 28.0, 28.5]}
    for name, speeds in runs.items():
        off["systems"][name].update(decode_tokens_per_s=speeds[1],
                                    decode_tokens_per_s_runs=speeds)
    text = headline(off)
    assert "decodes at 30.5 tokens/s (no clear difference: ranges overlap)" in text
    assert "stmoe-plus at 28.0 (slower: ranges apart)" in text
    assert "stmoe 1.02x (no clear difference: ranges overlap)" in details(off)
    off["systems"]["stmoe-plus"]["decode_tokens_per_s_runs"] = [28.0, 29.5, 30.0]
    assert "stmoe-plus at 28.0 (no clear difference: ranges overlap)" in headline(off)
    assert "faster" not in headline(off)
    off["systems"]["stmoe-plus"]["decode_tokens_per_s_runs"] = [27.0, 28.5]  # two rounds:
    assert "stmoe-plus at 28.0 (too few rounds for a verdict)" in headline(off)  # no call


def _step(time: float, compute: float, loaded: int, wasted: int) -> dict:
    return {"time": time, "speedup_vs_baseline": 1.0 / time, "experts_loaded": loaded,
            "experts_prefetched": wasted * 2, "experts_wasted": wasted, "hit_rate": 0.5,
            "breakdown": {"compute": compute, "stall": time - compute,
                          "communication": time - compute, "prediction": 0.0}}


def test_ablation_reasons_come_from_the_numbers():
    sim = {"ablation": {"static": _step(1.0, 0.2, 100, 0), "dynamic": _step(0.9, 0.1, 100, 0),
                        "+ HT": _step(0.95, 0.1, 120, 20)}}
    lines = ablation_reasons(sim)
    assert lines[0].startswith("dynamic: 10.0% faster than static")
    assert "Compute -100 ms" in lines[0]
    assert lines[1].startswith("+ HT: 5.6% slower than dynamic")
    assert "experts moved 100 -> 120 (40 prefetched, 20 of them unused)" in lines[1]
    assert lines[2].startswith("Why: on this model the link is the bottleneck")
    assert lines[3].startswith("The on-chip buffer keeps no expert across tokens")
    compute_bound = {"ablation": {"a": _step(1.0, 0.8, 10, 0), "b": _step(0.9, 0.8, 10, 0)},
                     "buffer": {"experts_per_layer": 4}}
    lines = ablation_reasons(compute_bound)
    assert lines[-2].startswith("Why: compute takes 89%")
    assert lines[-1].startswith("The on-chip buffer keeps 4 experts per layer across tokens")
    assert "docs/simulator.md ('Where the paper's figures hold')" in lines[-1]


def test_model_card_markdown_renders_its_parts():
    text = ("# Card\n\nSome **bold** and `code` <b>.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
            "- one\n  more\n- two\n\n```python\nx = 1 < 2\n```\n")
    out = markdown_html(text)
    assert "<h1>Card</h1>" in out
    assert "<p>Some <b>bold</b> and <code>code</code> &lt;b&gt;.</p>" in out
    assert "<tr><th>a</th><th>b</th></tr><tr><td>1</td><td>2</td></tr>" in out
    assert "<ul><li>one more</li><li>two</li></ul>" in out
    assert "<pre><code>x = 1 &lt; 2</code></pre>" in out


def test_p_value_chart_caps_its_axis_and_has_no_legend_over_the_bars(monkeypatch, tmp_path):
    from stmoe.analysis import plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    pairs = [{"layer": 0, "p_value": 1e-300, "significant": True, "cramers_v": 0.4},
             {"layer": 1, "p_value": 0.5, "significant": False, "cramers_v": 0.01}]
    data = {
        "trace": {"synthetic": False},
        "spatial": {"alpha": 0.01, "pairs_significant": 1, "pairs_total": 2, "pairs": pairs},
    }
    plots.spatial_tests(data, tmp_path / "s.png")
    ax = figs[0].axes[0]
    assert ax.get_ylim()[1] == pytest.approx(plots.LOGP_CAP * 1.3)
    assert [b.get_height() for b in ax.patches] == pytest.approx([plots.LOGP_CAP, 0.30103])
    assert ax.get_legend() is None
    assert {">20\n(300)", "0.3", "p = 0.01"} <= {t.get_text() for t in ax.texts}


def test_budget_curves_have_one_colour_each_and_the_legend_outside(monkeypatch, tmp_path):
    from stmoe.analysis import plots
    from stmoe.predictors import REGISTRY

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    names = list(REGISTRY)
    curve = {"budget": [1, 2], "set_size": [1.0, 2.0], "recall": [0.3, 0.5]}
    data = {"trace": {"synthetic": False, "top_k": 4},
            "predictability": {"scope": "all", "profiled_tokens": 1, "evaluated_tokens": 1,
                               "curves": dict.fromkeys(names, curve)}}
    plots.predictability(data, tmp_path / "p.png")
    ax = figs[0].axes[0]
    colours = {line.get_color() for line in ax.get_lines() if line.get_label() in names}
    assert len(colours) == len(names) >= 11
    legend = ax.get_legend()
    assert legend is not None and legend.get_bbox_to_anchor().x0 > ax.bbox.x1  # right of it


def test_normalized_time_chart_marks_the_lossy_system(monkeypatch, tmp_path, quick_demo):
    from stmoe.sim.accelerator import plots as sim_plots

    figs = []
    monkeypatch.setattr(sim_plots, "_save", lambda fig, path: figs.append(fig) or path)
    sim = json.loads((quick_demo[1] / "simulator" / "simulate.json").read_text())
    sim_plots.normalized_time(sim, tmp_path / "n.png")
    fig = figs[0]
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == [n + "\n(LOSSY)" if n == "adap-gating" else n for n in sim["systems"]]
    hatches = [str(p.get_hatch() or "") for p in fig.axes[0].patches]  # compute, then stall
    expected = ["//" if n == "adap-gating" else "" for n in sim["systems"]]
    assert hatches == expected + expected
    assert any(t.get_text().startswith("adap-gating: LOSSY: runs") and "not comparable"
               in t.get_text() for t in fig.texts)


def test_an_interrupted_demo_says_so_and_keeps_the_previous_report(cli, tmp_path, monkeypatch):
    import stmoe.demo

    report = tmp_path / "demo"
    report.mkdir()
    (report / "index.html").write_text("previous run")

    def interrupted(out_dir, **kwargs):
        (out_dir / "index.html").write_text("half of a new run")
        raise KeyboardInterrupt

    monkeypatch.setattr(stmoe.demo, "run_demo", interrupted)
    result = cli("demo", "-o", report)
    assert result.exit_code == 130
    assert f"interrupted; the report in {report} is from the previous run" in result.output
    assert (report / "index.html").read_text() == "previous run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no half-written folder


def test_the_details_name_the_sizes_the_wait_and_the_admission_off_run():
    off = _offload(3)
    off["systems"]["on-demand"].update(stall_share=0.8, stall_share_range=[0.63, 0.82])
    off["systems"]["stmoe-plus-all"] = dict(off["systems"]["stmoe-plus"],
                                            decode_tokens_per_s=50.0,
                                            decode_tokens_per_s_runs=[49.0, 50.0, 51.0])
    text = details(off)
    assert ("on-demand loading waits for weights 80% of its decode, 63%-82% over the "
            "rounds)") in text
    assert "stmoe-plus-all 1.67x (faster: ranges apart)" in text
    assert "waits" not in headline(off)  # the headline is the speeds and the verdicts
    shipped = {k: v for k, v in off.items() if k != "routing"} | {"expert_mib": 0.2109375}
    assert "At the shipped model's own sizes (216 KiB experts, 50% of each" in headline(shipped)
    assert "at the shipped model's own sizes (216 KiB experts; on-demand" in details(shipped)
    assert shipped_line(shipped).startswith("At the shipped model's own sizes (216 KiB")


def test_the_real_size_model_is_refused_in_one_line_when_the_disk_cannot_hold_it(
        tmp_path, monkeypatch):
    import shutil

    from stmoe.demo.offload import real_model
    from stmoe.errors import StmoeError

    monkeypatch.setenv("STMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 0, 2**20))
    said = []
    with pytest.raises(StmoeError, match=r"the demo's real-size model needs about 0\.4 GiB "
                       r"and .* has 0\.0 GiB free; free some space or set STMOE_CACHE"):
        real_model(2, said.append)
    assert said == [] and not (tmp_path / "demo").exists()


def test_the_real_size_model_takes_the_disk_it_announces(quick_demo):
    """What the demo says it writes into STMOE_CACHE/demo (and the README, for 8 layers)."""
    import os
    from pathlib import Path

    from stmoe.demo.offload import disk_needed

    root = Path(os.environ["STMOE_CACHE"]) / "demo"
    written = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert written == pytest.approx(disk_needed(2), rel=0.02)  # the quick demo's 2 layers
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert f"written once, {disk_needed(8) / 2**30:.1f} GiB in `~/.cache/stmoe/demo`" in readme


def test_the_demo_help_the_readme_and_its_own_estimate_agree(cli, quick_demo):
    from pathlib import Path

    from stmoe.demo.run import ESTIMATE

    result, _ = quick_demo
    assert f"the demo takes {ESTIMATE}" in result.output
    help_text = " ".join(cli("demo", "--help").output.split())
    assert ("3.5 to 5.5 minutes on 2 cores, the CPU deciding (--quick: under one), up to 1.5 "
            "more the first time") in help_text
    assert ESTIMATE == ("3.5 to 5.5 minutes on 2 cores, the CPU deciding (--quick: under one), "
                        "up to 1.5 more the first time")
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert "3.3 minutes the second" in readme and "`--quick`: under one" in readme


def test_the_chart_labels_each_prefetching_bar_with_its_verdict():
    from stmoe.demo.plots import tick

    off = _offload(3)
    off["systems"]["stmoe"]["decode_tokens_per_s_runs"] = [29.5, 30.5, 32.0]  # overlaps lru
    assert tick(off, "stmoe") == "stmoe\nno clear\ndifference"
    assert tick(off, "stmoe-plus") == "stmoe-plus\nfaster"  # 40-43 against 29-32
    assert tick(off, "lru-only") == "lru-only" and tick(off, "oracle") == "oracle"
