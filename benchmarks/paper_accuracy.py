"""Issue 32, item 1: which reading of "prediction accuracy" reaches the paper's 80-89%?

The paper reports prediction accuracy above 80% in every setting, 85% on average and
85-89% on the DeepSeek models, without a definition public to this project. This runs
ST-MoE (the ``stmoe`` predictor, default configuration, docs/method.md) and computes
every reading the field uses (``stmoe.analysis.accuracy``) on:

* the three real Qwen1.5-MoE-A2.7B prompts of ``<traces>/qwen15``: HELD-OUT, tables
  profiled on the other two prompts, the third replayed (the result); and IN-SAMPLE,
  tables profiled on the replayed prompt itself (overstates: the tables saw the answer);
* the real Qwen3.6-35B-A3B sample (one prompt, split in halves by token: profiled on
  the first, the second replayed);
* a SYNTHETIC trace of Qwen1.5-MoE's shape as docs/simulator.md makes it (``stmoe
  synth --tokens 6000 --layers 24 --experts 60 --top-k 4 --sequences 8 --spatial 0.9
  --temporal 0.4 --skew 0.8 --seed 5``), profiled on its first half of sequences and
  the second replayed, as ``stmoe simulate`` does (``split_auto``).

Every reading covers decode tokens at layers 1..L-1 (the project's scope); a second
table includes layer 0. Beside ST-MoE: the ``previous-token`` predictor's recall and
a random set's recall at ST-MoE's mean set size (s/N), as references.

    python benchmarks/paper_accuracy.py [--traces DIR] [--json OUT] [--synth-tokens 6000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.analysis.accuracy import Readings, accuracy, null_readings
from stmoe.predictors import REGISTRY, ModelShape, ProfiledTables, make, profile
from stmoe.trace import RoutingTrace, SynthSpec, import_files, split_auto, synthesize

SHARED = Path(os.environ.get("STMOE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
PROMPTS = ("cooking_1", "history_1", "ml_moe_1")
QWEN36 = "qwen3.6-35b-a3b_chat-1prompt.npz"
BAND = (0.80, 0.89)  # the paper: above 80% everywhere, 85-89% on DeepSeek
READINGS = {  # field of Readings: column title
    "recall": "recall",
    "hit_rate_with_previous": "hit rate, HT resident",
    "precision": "precision",
    "top_k_overlap": "top-K overlap",
    "top1_covered": "top-1 covered",
}
SHORT = {"recall": "recall", "hit_rate_with_previous": "hit-rate+H", "precision": "precision",
         "top_k_overlap": "top-K", "top1_covered": "top-1"}


def synth_spec(tokens: int) -> SynthSpec:
    """docs/simulator.md's Qwen1.5-MoE-shaped synthetic trace (``stmoe synth`` there)."""
    return SynthSpec(tokens=tokens, layers=24, experts=60, top_k=4, sequences=8,
                     spatial=0.9, temporal=0.4, skew=0.8, seed=5)


def cases(traces: Path, synth_tokens: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Every row to measure: label, kind, what the tables saw and the replayed trace."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    q15 = {p: traces / "qwen15" / f"{p}.routes.json" for p in PROMPTS}
    if all(f.is_file() for f in q15.values()):
        loaded = {p: import_files([f]) for p, f in q15.items()}
        for p in PROMPTS:
            others = [o for o in PROMPTS if o != p]
            rows.append({"label": f"Qwen1.5-MoE {p}", "kind": "held-out",
                         "profiled_on": " + ".join(others),
                         "profile": [loaded[o] for o in others], "eval": loaded[p]})
        for p in PROMPTS:
            rows.append({"label": f"Qwen1.5-MoE {p}", "kind": "IN-SAMPLE, overstates",
                         "profiled_on": f"{p} itself", "profile": [loaded[p]],
                         "eval": loaded[p]})
    else:
        notes.append(f"Qwen1.5-MoE prompts not found under {traces / 'qwen15'}: rows skipped")
    q36 = traces / QWEN36
    if q36.is_file():
        first, rest = split_auto(import_files([q36]), 0.5)
        rows.append({"label": "Qwen3.6-35B-A3B chat", "kind": "one prompt, split in halves",
                     "profiled_on": "first half of its tokens", "profile": [first],
                     "eval": rest})
    else:
        notes.append(f"{q36} not found: row skipped")
    first, rest = split_auto(synthesize(synth_spec(synth_tokens)), 0.5)
    rows.append({"label": "Qwen1.5-MoE shape", "kind": "SYNTHETIC",
                 "profiled_on": "first half of its sequences", "profile": [first], "eval": rest})
    return rows, notes


def plan_readings(name: str, trace: RoutingTrace, tables: ProfiledTables) -> dict[str, Readings]:
    """Predictor ``name`` (defaults) replayed from a fresh start; its readings."""
    given = tables if REGISTRY[name].needs_tables else None
    acc = accuracy(trace, make(name, ModelShape.of(trace), given).plan(trace))
    return {"scope": acc.scope, "with_layer0": acc.with_layer0, "text": acc.scope_text}


def bands(r: Readings) -> dict[str, list[str]]:
    """Which readings fall in the paper's 80-89% band, and which are at or above 80%
    (judged on the percentage as printed, one decimal, so the table and verdict agree)."""
    values = {k: round(100 * getattr(r, k), 1) for k in READINGS if getattr(r, k) is not None}
    low, high = (100 * b for b in BAND)
    return {"in_band": [k for k, v in values.items() if low <= v <= high],
            "at_least_80": [k for k, v in values.items() if v >= low]}


def measure(row: dict[str, Any]) -> dict[str, Any]:
    tables = profile(row["profile"], fit_plus=False)  # ST-MoE reads only the CCT
    tr: RoutingTrace = row["eval"]
    st = plan_readings("stmoe", tr, tables)
    prev = plan_readings("previous-token", tr, tables)
    out: dict[str, Any] = {k: row[k] for k in ("label", "kind", "profiled_on")}
    out.update(model=tr.meta.model, synthetic=tr.meta.synthetic, scope=st["text"],
               decode_tokens=int(np.count_nonzero(tr.is_decode)), tokens=tr.num_tokens,
               num_experts=tr.num_experts, top_k=tr.top_k)
    for part in ("scope", "with_layer0"):
        r: Readings = st[part]
        out[part] = {"stmoe": r.to_dict(), "previous_token": prev[part].to_dict(),
                     "random_set": null_readings(tr.num_experts, tr.top_k, r.set_size),
                     **bands(r)}
    return out


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}"


def table(results: list[dict[str, Any]], part: str) -> str:
    head = (["trace", "tables", "decode tokens", *READINGS.values(), "set size",
             "prev-token recall", "random-set recall", "in 80-89%", ">= 80%"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        p = res[part]
        st = p["stmoe"]
        cells = [f"{res['label']} ({res['kind']})", res["profiled_on"], str(res["decode_tokens"]),
                 *(pct(st[k]) for k in READINGS), f"{st['set_size']:.2f}",
                 pct(p["previous_token"]["recall"]), pct(p["random_set"]["recall"]),
                 ", ".join(SHORT[k] for k in p["in_band"]) or "none",
                 ", ".join(SHORT[k] for k in p["at_least_80"]) or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def held_out_mean(results: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of each reading over the held-out Qwen1.5 prompts (the paper quotes means)."""
    rows = [r["scope"]["stmoe"] for r in results if r["kind"] == "held-out"]
    return {k: float(np.mean([r[k] for r in rows])) for k in READINGS} if rows else {}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=SHARED / "traces",
                    help="folder holding qwen15/ and the Qwen3.6 npz (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    ap.add_argument("--synth-tokens", type=int, default=6000,
                    help="tokens of the synthetic trace (default: %(default)s)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows, notes = cases(args.traces, args.synth_tokens)
    results = [measure(row) for row in rows]
    mean = held_out_mean(results)
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# ST-MoE prediction accuracy, every reading ({date})\n")
    for n in notes:
        print(f"note: {n}")
    scope = "decode tokens, layers 1..L-1"
    print(f"\n## Scope: {scope} (percent)\n\n{table(results, 'scope')}\n")
    if mean:
        print("held-out Qwen1.5-MoE, mean of the prompts: "
              + ", ".join(f"{READINGS[k]} {pct(v)}" for k, v in mean.items()) + "\n")
    print(f"## Layer 0 included (same tokens, percent)\n\n{table(results, 'with_layer0')}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": date, "band": BAND, "notes": notes,
                                         "held_out_mean": mean, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
