"""The main job: the whole pipeline on stmoe's own small MoE model, in one report.

capture (3 domains) -> per-domain tables -> replay of every predictor and the
cross-domain matrix -> correlation analysis -> simulator -> ``DIR/index.html``.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.capture_generate import Prompt
from stmoe.errors import StmoeError
from stmoe.models import SHIPPED_MODEL, SHIPPED_TABLES
from stmoe.trace.schema import RoutingTrace

DEMO_PROMPTS = (
    Prompt('def read_config(path):\n    """Read a configuration file."""\n', "code"),
    Prompt("class Queue:\n    def __init__(self):\n", "code"),
    Prompt("import os\nimport sys\n\n\ndef main():\n", "code"),
    Prompt("    for item in items:\n        if item is None:\n", "code"),
    Prompt("The with statement is used to wrap the execution of a block", "prose"),
    Prompt("An object is hashable if it has a hash value which never changes", "prose"),
    Prompt("Exceptions can be raised and handled in several ways. When an error", "prose"),
    Prompt("A module is a file containing definitions and statements that", "prose"),
    Prompt(
        "Problem: How many positive integers less than 100 are divisible by 3 or 5?\nSolution:",
        "math",
    ),
    Prompt(
        "Problem: Prove that for every positive integer n, n^3 - n is divisible by 6.\nSolution:",
        "math",
    ),
    Prompt("Problem: Find all real x such that x^2 - 5x + 6 = 0.\nSolution:", "math"),
    Prompt("Fact: For non-negative a and b, (a + b) / 2 >= sqrt(ab).", "math"),
)


def run_demo(
    out_dir: str | Path,
    *,
    quick: bool = False,
    model_dir: str | Path = SHIPPED_MODEL,
    stage: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run every stage, write ``out_dir/index.html`` and return the headline figures."""
    from stmoe.analysis.report import write_report
    from stmoe.capture_generate import capture_text, load_model
    from stmoe.predictors import names_for, profile, save_tables
    from stmoe.replay import cross_domain_matrix, replay
    from stmoe.sim import plots as sim_plots
    from stmoe.sim.simulate import simulate
    from stmoe.sim.specs import load_hardware, model_spec_from_config
    from stmoe.trace import save_trace, select_domain, split_auto

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (Path(model_dir) / "config.json").exists():
        raise StmoeError(f"{model_dir}: the shipped model is missing from this install")
    prompts = [p for i, p in enumerate(DEMO_PROMPTS) if not quick or i % 4 == 0]
    stage(f"capturing routing from the shipped model on {len(prompts)} prompts")
    model, tokenizer = load_model(model_dir)
    trace = capture_text(model, tokenizer, prompts, max_new_tokens=8 if quick else 64,
                         batch_size=4, model_name=Path(model_dir).resolve().name)  # fmt: skip
    save_trace(trace, out / "trace.npz")

    stage("profiling per-domain tables and replaying every predictor")
    domains = list(dict.fromkeys(trace.domains))
    per_domain = {}
    for d in domains:
        first, rest = split_auto(select_domain(trace, d), 0.5)
        tables = profile(first)
        save_tables(tables, out / f"tables-{d}.npz")
        result = replay(rest, names_for(rest), tables, capacity=2 * trace.top_k,
                        options={"seed": 0})  # fmt: skip
        per_domain[d] = result.to_dict()
    matrix = cross_domain_matrix(trace, "stmoe")
    (out / "eval.json").write_text(json.dumps({"per_domain": per_domain, "cross_domain": matrix},
                                              indent=1) + "\n")  # fmt: skip

    stage("analysing the spatial and temporal correlations")
    analysis = write_report(trace, out / "analysis", with_json=True)

    stage("simulating the pipeline on the paper-like accelerator")
    spec = model_spec_from_config(model.config, trace.num_layers, "stmoe-tiny-moe")
    sim = simulate(trace, spec, load_hardware("stmoe-asic"))
    (out / "simulator").mkdir(exist_ok=True)
    sim_plots.normalized_time(sim, out / "simulator" / "normalized_time.png")
    sim_plots.ablation(sim, out / "simulator" / "ablation.png")
    (out / "simulator" / "simulate.json").write_text(json.dumps(sim, indent=1) + "\n")

    stage("generating with the experts offloaded (emulated link, half the experts cached)")
    offloaded = offload_section(model, model_dir, out, new_tokens=8 if quick else 32)

    summary = _summary(trace, per_domain, matrix, analysis, sim)
    summary["offload"] = offloaded
    samples = _samples(trace, tokenizer)
    (out / "index.html").write_text(_index(summary, per_domain, matrix, analysis, sim, samples))
    return summary


OFFLOAD_LINK = "200MB"  # EMULATED link bandwidth of the demo's offloaded generation


def offload_section(model: Any, model_dir: str | Path, out: Path, new_tokens: int) -> dict:
    """Pack the experts, then generate with each system at 50% capacity (bit-identical)."""
    from stmoe.predictors import load_tables
    from stmoe.runtime.api import offload
    from stmoe.runtime.store import pack
    from stmoe.runtime.systems import COMPARED_SYSTEMS, compared_predictor

    store = pack(model, out / "store", source=model_dir)  # model: model_dir, as loaded
    tables = load_tables(Path(model_dir) / SHIPPED_TABLES)
    prompt = DEMO_PROMPTS[1].text
    rows = {}
    for name, (predictor, policy) in COMPARED_SYSTEMS.items():
        with offload(model_dir, store, capacity="50%", policy=policy,
                     predictor=compared_predictor(predictor, tables),
                     tier="emulated", bandwidth=OFFLOAD_LINK) as om:  # fmt: skip
            r = om.generate(prompt, max_new_tokens=new_tokens)
        rows[name] = {k: getattr(r, k) for k in ("decode_tokens_per_s", "stall_share",
                                                  "hit_rate", "prefetch_recall",
                                                  "prefetch_precision", "bytes_moved",
                                                  "bytes_wasted", "tokens")}  # fmt: skip
    same = all(r["tokens"] == rows["on-demand"]["tokens"] for r in rows.values())
    result = {"link": OFFLOAD_LINK, "capacity": "50%", "prompt": prompt, "systems": rows,
              "identical_tokens": same}  # fmt: skip
    (out / "offload.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _summary(trace: RoutingTrace, per_domain: dict, matrix: dict, analysis: dict,
             sim: dict) -> dict[str, Any]:  # fmt: skip
    rows = {d: {n: e["recall"] for n, e in r["predictors"].items()} for d, r in per_domain.items()}
    return {
        "tokens": trace.num_tokens,
        "decode_tokens": int(np.count_nonzero(trace.is_decode)),
        "recall": rows,
        "pairs_significant": analysis["spatial"]["pairs_significant"],
        "pairs_total": analysis["spatial"]["pairs_total"],
        "overlap_ratio": analysis["temporal"]["overlap_ratio"],
        "stmoe_normalized_time": sim["systems"]["stmoe"]["normalized_time"],
        "oracle_normalized_time": sim["systems"]["oracle"]["normalized_time"],
        "cross_domain": matrix,
    }


def _samples(trace: RoutingTrace, tok: Any) -> list[tuple[str, str, str]]:
    """(domain, prompt, generated text) of each sequence."""
    rows = []
    for s, sl in trace.sequences():
        ids, dec = trace.token_ids[sl], trace.is_decode[sl]
        rows.append((trace.domains[s], tok.decode(ids[~dec]), tok.decode(ids[dec])))
    return rows


def _table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><tr>{cells}</tr>{body}</table>"


def _index(summary: dict, per_domain: dict, matrix: dict, analysis: dict, sim: dict,
           samples: list[tuple[str, str, str]]) -> str:  # fmt: skip
    predictors = list(next(iter(per_domain.values()))["predictors"])

    def by_domain(value: Callable[[dict], float]) -> str:
        rows = [[p, *(f"{value(per_domain[d]['predictors'][p]):.3f}" for d in per_domain)]
                for p in predictors]  # fmt: skip
        return _table(["predictor", *per_domain], rows)

    recall = by_domain(lambda e: e["recall"])
    cache = by_domain(lambda e: e["cache"]["hit_rate"])
    pairs = zip(matrix["profiled_on"], matrix["recall"], strict=True)
    cross_rows = [[a, *("-" if x is None else f"{x:.3f}" for x in row)] for a, row in pairs]
    cross = _table(["profiled on / evaluated on", *matrix["evaluated_on"]], cross_rows)
    systems = _table(["system", "normalized time", "energy (J)", "EDP"],
                     [[n, f"{s['normalized_time']:.3f}", f"{s['energy']:.4g}", f"{s['edp']:.4g}"]
                      for n, s in sim["systems"].items()])  # fmt: skip
    gen = _table(["domain", "prompt", "generated (greedy)"], [list(r) for r in samples])
    offload = _table(
        ["system", "decode tokens/s", "stall share", "hit rate", "prefetch recall",
         "prefetch precision", "MiB moved", "MiB wasted"],
        [[n, f"{r['decode_tokens_per_s']:.1f}", f"{r['stall_share']:.1%}", f"{r['hit_rate']:.3f}",
          f"{r['prefetch_recall']:.3f}", f"{r['prefetch_precision']:.3f}",
          f"{r['bytes_moved'] / 2**20:.1f}", f"{r['bytes_wasted'] / 2**20:.1f}"]
         for n, r in summary["offload"]["systems"].items()],
    )  # fmt: skip
    s = summary
    parts = [
        "<h1>stmoe demo: ST-MoE on stmoe's own small MoE model</h1>",
        f"<p>{s['tokens']} tokens ({s['decode_tokens']} generated) captured from the shipped "
        "Qwen2-MoE model (docs/model-card.md) on prompts of three domains.</p>",
        "<h2>Prediction (replay, held-out half of each domain)</h2>", "<h3>Recall</h3>", recall,
        "<h3>Cache hit rate (per-layer LRU cache of 2K experts)</h3>", cache,
        "<h3>Cross-domain recall of ST-MoE</h3>", cross,
        "<h2>Correlation analysis</h2>",
        f"<p>{s['pairs_significant']} of {s['pairs_total']} adjacent layer pairs reject "
        f"independence (p &lt; {analysis['spatial']['alpha']}); consecutive tokens share "
        f"{s['overlap_ratio']:.2f}x the "
        "experts random routing would. <a href='analysis/report.html'>Full report</a>.</p>",
        "<img src='analysis/spatial_tests.png'><img src='analysis/temporal_overlap.png'>",
        "<img src='analysis/predictability.png'>",
        "<h2>Simulator (stmoe-asic preset; GPU baseline = 1)</h2>", systems,
        "<img src='simulator/normalized_time.png'><img src='simulator/ablation.png'>",
        "<h2>Offloaded generation (EMULATED link "
        f"{s['offload']['link']}/s, half of each layer's experts cached)</h2>", offload,
        f"<p>Every system generated the same tokens: {s['offload']['identical_tokens']} "
        "(offloading is lossless).</p>",
        "<h2>What the model generates</h2>", gen,
    ]  # fmt: skip
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}img{max-width:100%}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
             "padding:2px 8px;vertical-align:top;white-space:pre-wrap;font-size:.9em}")  # fmt: skip
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>stmoe demo</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")  # fmt: skip
