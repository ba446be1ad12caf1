"""Each layer's cache size from held-out hit-rate curves, against one size for every layer.

The same total of cache slots (25% or 50% of every layer's experts), split two ways: the
same at every layer, or by ``stmoe.evaluate.layer_capacity.allocate`` from curves of each
layer's hits against its capacity. Every figure is HELD OUT twice over:

* the curves are cross-fitted: measured on routing replayed with tables profiled on OTHER
  routing (the tables' own routing makes the later layers look predictable, and a split
  from such curves starves them: -0.01 to -0.03 in a first try, journal 2026-12-06);
* the split is judged on routing neither the tables nor the curves saw.

Qwen1.5-MoE-A2.7B (60 experts, top-4), the three prompts of ``<shared>/traces/qwen15`` in
rotation: the tables from the other two, the curves from each of those two replayed with
tables from the other; its MoE layers 8..15 and all 24. Qwen3.6-35B-A3B (256, top-8), the
one prompt split as the GPU check splits it (tables from tokens 0..99, the decode tokens
after replayed); the curves from the head's own tail (tokens 60..99 with tables from
0..59); its first 4 and 8 layers. Systems: on-demand with LRU (``lru-only``) and
stmoe-plus's prefetches (1.5K a layer) with LRU and with score eviction.

Targets (set after a first exploration on these same traces, so read them as a check
that the result holds in the committed code, not as a prediction): for stmoe-plus with
either policy, the split's hit rate >= the uniform one's in >= 3/4 of the Qwen1.5 cases,
and their median gain >= +0.01.

    python benchmarks/bench_layer_capacity.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from bench_eviction import PROMPTS, QWEN15, QWEN36, SHARES, SPLIT_AT, SPLIT_PROMPT

from stmoe.evaluate.cache_replay import replay_cache
from stmoe.evaluate.layer_capacity import allocate, default_grid, layer_hits
from stmoe.evaluate.systems import PLUS_SET_SIZE_IN_K
from stmoe.predictors import ModelShape, make, profile
from stmoe.trace import load_trace
from stmoe.trace.importers import import_files
from stmoe.trace.schema import RoutingTrace
from stmoe.trace.select import held_out_tail, select_layers

SYSTEMS = (("lru-only", "lru"), ("stmoe-plus", "lru"), ("stmoe-plus", "score"))
CURVE_SPLIT = 60  # Qwen3.6: the curves from the head's tokens 60.. (tables from 0..59)


def _plan(system: str, trace: RoutingTrace, tables):
    shape = ModelShape.of(trace)
    if system == "lru-only":
        return make("ondemand", shape, tables).plan(trace), None
    return make("stmoe-plus", shape, tables,
                set_size=PLUS_SET_SIZE_IN_K * shape.top_k).scored_plan(trace)


def case(judged: RoutingTrace, tables_from: list[RoutingTrace],
         curves_from: list[tuple[RoutingTrace, list[RoutingTrace]]], share: float) -> dict:
    """Every system's hit rate and moves on ``judged`` (tables from ``tables_from``), its
    cache the same at every layer and split by curves of ``curves_from`` ((replayed,
    tables from) pairs)."""
    shape = ModelShape.of(judged)
    uniform = max(shape.top_k, round(share * shape.num_experts))
    total = uniform * shape.num_layers
    grid = default_grid(shape.num_experts, shape.top_k)
    tables = profile(tables_from)
    mask = np.asarray(judged.is_decode)
    out: dict = {"uniform": uniform}
    for system, policy in SYSTEMS:
        curves = np.zeros((shape.num_layers, len(grid)))
        for replayed, sources in curves_from:
            plan, scores = _plan(system, replayed, profile(sources))
            curves += layer_hits(replayed, plan, grid, policy, np.asarray(replayed.is_decode),
                                 scores)[0]
        caps = allocate(curves, grid, total, shape.num_experts)
        plan, scores = _plan(system, judged, tables)
        row = {}
        for name, capacity in (("uniform", uniform), ("split", caps.tolist())):
            s = replay_cache(judged, plan, capacity, policy, mask, scores)
            row[name] = {"hit_rate": round(s.hit_rate, 4),
                         "moved_per_token": round(s.moved_per_token, 2)}
        row["capacities"] = caps.tolist()
        out[f"{system}/{policy}"] = row
    return out


def qwen15_cases() -> list[tuple[str, dict]]:
    traces = {p: import_files([QWEN15 / f"{p}.routes.json"]) for p in PROMPTS}
    rows = []
    for layers in ("8:16", "24"):
        cut = {p: select_layers(t, layers) for p, t in traces.items()}
        for judged in PROMPTS:
            others = [p for p in PROMPTS if p != judged]
            curves_from = [(cut[p], [cut[q] for q in others if q != p]) for p in others]
            for share in SHARES:
                rows.append((f"qwen1.5 layers {layers}, {judged}, {share:.0%}",
                             case(cut[judged], [cut[p] for p in others], curves_from, share)))
    return rows


def qwen36_cases() -> list[tuple[str, dict]]:
    full = load_trace(QWEN36)
    rows = []
    for layers in ("4", "8"):
        head, tail = held_out_tail(select_layers(full, layers), SPLIT_AT, SPLIT_PROMPT)
        early, late = held_out_tail(head, CURVE_SPLIT, SPLIT_PROMPT)
        for share in SHARES:
            rows.append((f"qwen3.6 layers {layers}, held-out tail, {share:.0%}",
                         case(tail, [head], [(late, [early])], share)))
    return rows


def show(label: str, r: dict) -> None:
    cells = "  ".join(f"{k} {v['uniform']['hit_rate']:.3f} -> {v['split']['hit_rate']:.3f} "
                      f"({v['uniform']['moved_per_token']:.1f} -> "
                      f"{v['split']['moved_per_token']:.1f} moved)"
                      for k, v in r.items() if k != "uniform")
    print(f"{label} (uniform {r['uniform']}): {cells}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every figure here")
    a = parser.parse_args()
    print("hit rate, uniform -> split (experts moved per decode token); HELD-OUT tables and "
          "curves")
    q15, q36 = qwen15_cases(), []
    for label, r in q15:
        show(label, r)
    q36 = qwen36_cases()
    for label, r in q36:
        show(label, r)
    met = True
    for system, policy in SYSTEMS:
        key = f"{system}/{policy}"
        gain = [r[key]["split"]["hit_rate"] - r[key]["uniform"]["hit_rate"] for _, r in q15]
        up = sum(g >= 0 for g in gain)
        print(f"\n{key}: qwen1.5 split - uniform {min(gain):+.3f} .. {max(gain):+.3f} "
              f"(median {float(np.median(gain)):+.3f}), >= in {up}/{len(gain)}")
        g36 = [r[key]["split"]["hit_rate"] - r[key]["uniform"]["hit_rate"] for _, r in q36]
        print(f"{key}: qwen3.6 split - uniform {', '.join(f'{g:+.3f}' for g in g36)}")
        if system == "stmoe-plus":
            ok = 4 * up >= 3 * len(gain) and float(np.median(gain)) >= 0.01
            met &= ok
            print(f"{key}: split >= uniform in >= 3/4 of qwen1.5 cases and median gain >= "
                  f"+0.01: {'MET' if ok else 'NOT MET'}")
    print(f"\nall targets: {'MET' if met else 'NOT MET'}")
    if a.json:
        a.json.write_text(json.dumps({"qwen1.5": dict(q15), "qwen3.6": dict(q36)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
