"""The main job: the whole pipeline on stmoe's own small MoE model, in one report.

capture (3 domains) -> per-domain tables -> replay of every predictor and the
cross-domain matrix -> correlation analysis -> simulator -> offloaded generation
(``demo.offload``: the shipped model, then the captured routing through a model with
real-size experts; interleaved rounds, every run's tokens checked) ->
``DIR/index.html`` (its HTML is ``stmoe.demo.report``'s).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.demo.offload import SHIPPED_LINK, real_size_section, shipped_section
from stmoe.errors import StmoeError
from stmoe.hf.capture_generate import Prompt
from stmoe.models import SHIPPED_MODEL
from stmoe.trace.schema import RoutingTrace
from stmoe.util.fileio import atomic_write_text

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


# how long it takes (docs/benchmarks.md, the demo's running time): `stmoe demo --help` and
# the README say the same (tests/demo/test_demo.py)
ESTIMATE = ("3.5 to 5.5 minutes on 2 cores, the CPU deciding (--quick: under one), up to 1.5 "
            "more the first time")


def run_demo(
    out_dir: str | Path,
    *,
    quick: bool = False,
    rounds: int | None = None,
    model_dir: str | Path = SHIPPED_MODEL,
    stage: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run every stage, write ``out_dir/index.html`` and return the headline figures.

    ``rounds``: interleaved rounds of the offloaded generation (default 5, 2 when
    ``quick``); speeds are their medians, with the range."""
    from stmoe.analysis.report import write_report
    from stmoe.demo.report import write_index
    from stmoe.evaluate.equal_size import equal_set_size
    from stmoe.evaluate.replay import cross_domain_matrix, replay
    from stmoe.hf.capture_generate import capture_text
    from stmoe.hf.loading import load_model
    from stmoe.predictors import names_for, profile, save_tables
    from stmoe.sim.accelerator import plots as sim_plots
    from stmoe.sim.accelerator.simulate import simulate
    from stmoe.sim.specs import hardware_preset, model_spec_from_config
    from stmoe.trace import save_trace, select_domain, split_auto

    rounds = (2 if quick else 5) if rounds is None else rounds
    if rounds < 1:
        raise StmoeError(f"--rounds {rounds}: expected at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (Path(model_dir) / "config.json").exists():
        raise StmoeError(f"{model_dir}: the shipped model is missing from this install")
    stage(f"the demo takes {ESTIMATE}")
    prompts = [p for i, p in enumerate(DEMO_PROMPTS) if not quick or i % 4 == 0]
    stage(f"capturing routing from the shipped model on {len(prompts)} prompts")
    model, tokenizer = load_model(model_dir)
    trace = capture_text(model, tokenizer, prompts, max_new_tokens=8 if quick else 64,
                         batch_size=4, model_name=Path(model_dir).resolve().name)
    save_trace(trace, out / "trace.npz")

    stage("profiling per-domain tables and replaying every predictor")
    per_domain = {}
    for d in dict.fromkeys(trace.domains):
        first, rest = split_auto(select_domain(trace, d), 0.5)
        tables = profile(first)
        save_tables(tables, out / f"tables-{d}.npz")
        result = replay(rest, names_for(rest), tables, capacity=2 * trace.top_k,
                        options={"seed": 0})
        per_domain[d] = result.to_dict()
        per_domain[d]["equal_set_size"] = equal_set_size(rest, per_domain[d]["predictors"],
                                                         tables, {"seed": 0})
    matrix = cross_domain_matrix(trace, "stmoe")
    _write_json(out / "eval.json", {"per_domain": per_domain, "cross_domain": matrix})

    stage("analysing the spatial and temporal correlations")
    analysis = write_report(trace, out / "analysis", with_json=True)

    stage("simulating the pipeline on the paper-like accelerator")
    spec = model_spec_from_config(model.config, trace.num_layers, "stmoe-tiny-moe")
    sim = simulate(trace, spec, hardware_preset("stmoe-asic"))
    (out / "simulator").mkdir(exist_ok=True)
    sim_plots.normalized_time(sim, out / "simulator" / "normalized_time.png")
    sim_plots.ablation(sim, out / "simulator" / "ablation.png")
    _write_json(out / "simulator" / "simulate.json", sim)

    stage(f"generating with the experts offloaded: {rounds} interleaved rounds of every system "
          f"on the shipped model (EMULATED {SHIPPED_LINK}/s link, half the experts cached)")
    shipped = shipped_section(model, tokenizer, Path(model_dir), out, DEMO_PROMPTS[1].text,
                              new_tokens=8 if quick else 32, rounds=rounds)
    _write_json(out / "offload-shipped.json", shipped)
    stage("generating at real expert sizes: the captured routing replayed through a "
          "RANDOM-weight model with 6 MiB experts")
    real = real_size_section(trace, sequence=0, layers=2 if quick else 8,
                             new_tokens=8 if quick else 24, rounds=rounds, stage=stage)
    _write_json(out / "offload.json", real)

    summary = _summary(trace, per_domain, matrix, analysis, sim)
    summary["offload"] = real
    summary["offload_shipped"] = shipped
    summary["parameters"] = int(sum(p.numel() for p in model.parameters()))
    write_index(out, summary, per_domain, analysis, sim, _samples(trace, tokenizer))
    return summary


def _write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def _summary(trace: RoutingTrace, per_domain: dict, matrix: dict, analysis: dict,
             sim: dict) -> dict[str, Any]:
    def by_domain(key: str) -> dict[str, dict[str, float]]:
        return {d: {n: e[key] for n, e in r["predictors"].items()} for d, r in per_domain.items()}

    return {
        "tokens": trace.num_tokens,
        "decode_tokens": int(np.count_nonzero(trace.is_decode)),
        "top_k": trace.top_k,
        "num_experts": trace.num_experts,
        "num_layers": trace.num_layers,
        "recall": by_domain("recall"),
        "set_size": by_domain("set_size"),
        "equal_set_size": {d: r["equal_set_size"] for d, r in per_domain.items()},
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
