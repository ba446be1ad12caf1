"""The main job: the whole pipeline on stmoe's own small MoE model, in one report.

capture (3 domains) -> per-domain tables -> replay of every predictor and the
cross-domain matrix -> correlation analysis -> simulator -> offloaded generation
(interleaved rounds, every run checked against the resident model) ->
``DIR/index.html`` (its HTML is ``stmoe.demo.report``'s).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import StmoeError
from stmoe.hf.capture_generate import Prompt
from stmoe.models import SHIPPED_MODEL, SHIPPED_TABLES
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
          "(EMULATED link, half the experts cached)")
    offloaded = offload_section(model, tokenizer, model_dir, out,
                                new_tokens=8 if quick else 32, rounds=rounds)

    summary = _summary(trace, per_domain, matrix, analysis, sim)
    summary["offload"] = offloaded
    summary["parameters"] = int(sum(p.numel() for p in model.parameters()))
    write_index(out, summary, per_domain, analysis, sim, _samples(trace, tokenizer))
    return summary


OFFLOAD_LINK = "200MB"  # EMULATED link bandwidth of the demo's offloaded generation
# per-run figures kept (medians over the rounds); tokens are checked, not averaged
_MEASURED = ("decode_tokens_per_s", "stall_share", "hit_rate", "prefetch_recall",
             "prefetch_precision", "bytes_moved", "bytes_wasted")


def offload_section(model: Any, tokenizer: Any, model_dir: str | Path, out: Path, *,
                    new_tokens: int, rounds: int) -> dict[str, Any]:
    """Generate with each system at 50% capacity in ``rounds`` interleaved rounds.

    Interleaving (each round runs every system once, in a rotated order) spreads a
    shared machine's slow spells over all systems instead of one; an untimed warm-up
    run of each system comes first. Every run's tokens
    are compared with the resident model's greedy output: offloading must be lossless."""
    from stmoe.evaluate.systems import OFFLOAD_SYSTEMS, compared_predictor
    from stmoe.predictors import load_tables
    from stmoe.runtime.api import offload
    from stmoe.runtime.store import pack

    prompt = DEMO_PROMPTS[1].text
    reference = resident_tokens(model, tokenizer, prompt, new_tokens)
    store = pack(model, out / "store", source=model_dir)  # model: model_dir, as loaded
    tables = load_tables(Path(model_dir) / SHIPPED_TABLES)
    names = list(OFFLOAD_SYSTEMS)
    runs: dict[str, list[Any]] = {n: [] for n in names}
    with ExitStack() as stack:
        models = {name: stack.enter_context(
            offload(model_dir, store, capacity="50%", policy=policy, tier="emulated",
                    predictor=compared_predictor(predictor, tables), bandwidth=OFFLOAD_LINK))
            for name, (predictor, policy) in OFFLOAD_SYSTEMS.items()}
        for om in models.values():  # untimed: first calls pay one-off set-up costs
            om.generate(prompt, max_new_tokens=2)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(models[name].generate(prompt, max_new_tokens=new_tokens))
    systems = {}
    for name, results in runs.items():
        row: dict[str, Any] = {k: statistics.median(getattr(x, k) for x in results)
                               for k in _MEASURED}
        speeds = [x.decode_tokens_per_s for x in results]
        row["decode_tokens_per_s_range"] = [min(speeds), max(speeds)]
        row["decode_tokens_per_s_runs"] = speeds
        row["identical_to_resident"] = all(x.tokens == reference for x in results)
        systems[name] = row
    result = {
        "link": OFFLOAD_LINK, "capacity": "50%", "prompt": prompt, "new_tokens": new_tokens,
        "rounds": rounds, "statistic": "median over the rounds (range: min-max)",
        "reference_tokens": reference, "text": tokenizer.decode(reference),
        "identical_tokens": all(s["identical_to_resident"] for s in systems.values()),
        "systems": systems,
    }
    _write_json(out / "offload.json", result)
    return result


def resident_tokens(model: Any, tokenizer: Any, prompt: str, new_tokens: int) -> list[int]:
    """The resident (not offloaded) model's greedy tokens: what every system must match."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad)
    return out[0, ids.shape[1] :].tolist()


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
