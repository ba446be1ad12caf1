"""``stmoe demo``: the main job, on built-in data, with no arguments.

Until the project's own trained model ships (see the model issue), the demo runs
the pipeline that exists end to end on a SYNTHETIC trace: generate, save, export
to foreign formats, import back and verify the round trip; then profile ST-MoE's
tables on half the sequences and replay every predictor on the other half.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from stmoe.cli._common import key_value_table, out
from stmoe.cli.predict_cmds import print_results
from stmoe.errors import StmoeError
from stmoe.predictors import load_tables, names, profile, save_tables
from stmoe.replay import replay
from stmoe.trace import import_file, load_trace, save_trace, split, summarize, synthesize
from stmoe.trace.export import export_jsonl, export_npy

DEMO_SPEC = {
    "tokens": 6000,
    "layers": 16,
    "experts": 64,
    "top_k": 4,
    "sequences": 12,
    "domains": 3,
    "spatial": 0.8,
    "temporal": 0.3,
    "skew": 0.5,
    "seed": 0,
}


def demo(
    output_dir: Annotated[
        Path, typer.Option("--output", "-o", help="Folder for the demo's files.")
    ] = Path("stmoe-demo"),
) -> None:
    """Run the main job on built-in data (no arguments needed).

    For now: a SYNTHETIC 3-domain trace is generated, saved, exported to JSON Lines
    and .npy, imported back and checked bit for bit, and described; ST-MoE tables
    are profiled on half its sequences and every predictor is replayed on the rest;
    the correlation analysis writes a report with figures.
    """
    start = time.perf_counter()
    output_dir.mkdir(parents=True, exist_ok=True)
    trace = synthesize(**DEMO_SPEC)
    native = save_trace(trace, output_dir / "synthetic.npz")
    out.print(f"[1/6] generated and saved {native} (SYNTHETIC data)")

    jsonl_path = export_jsonl(trace, output_dir / "synthetic.jsonl")
    npy_path = export_npy(trace, output_dir / "synthetic.npy")
    out.print(f"[2/6] exported {jsonl_path} and {npy_path}")

    reread = load_trace(native, mmap=True)
    from_jsonl = import_file(jsonl_path, num_experts=trace.num_experts)
    from_npy = import_file(npy_path, num_experts=trace.num_experts)
    checks = {
        "native": np.array_equal(reread.experts, trace.experts)
        and np.array_equal(reread.weights, trace.weights),
        "jsonl": np.array_equal(from_jsonl.experts, trace.experts)
        and np.array_equal(from_jsonl.weights, trace.weights)
        and np.array_equal(from_jsonl.is_decode, trace.is_decode)
        and from_jsonl.domains == trace.domains,
        "npy": np.array_equal(from_npy.experts, trace.experts)
        and np.array_equal(from_npy.seq_starts, trace.seq_starts),
    }
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise StmoeError(f"round trip changed the trace for: {', '.join(failed)}")
    out.print("[3/6] imported all three back: identical expert ids, weights, sequences")

    s = summarize(reread)
    rows = [
        ("model", f"{s['model']} [SYNTHETIC]"),
        ("shape", f"T={s['tokens']}, L={s['layers']}, K={s['top_k']}, N={s['num_experts']}"),
        ("sequences / domains", f"{s['sequences']} / {', '.join(s['domains'])}"),
        ("prefill / decode", f"{s['prefill_tokens']} / {s['decode_tokens']}"),
        ("load max/mean (layer 0)", f"{s['load_balance_max_over_mean'][0]:.2f}"),
    ]
    out.print("[4/6] summary")
    out.print(key_value_table(str(native), rows))

    profiling, evaluation = split(reread, 0.5)
    tables = save_tables(profile(profiling), output_dir / "tables.npz")
    result = replay(evaluation, names(), load_tables(tables), capacity=2 * trace.top_k)
    report = output_dir / "eval.json"
    report.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    out.print(
        f"[5/6] profiled {tables} on {profiling.num_sequences} sequences, replayed every "
        f"predictor on the other {evaluation.num_sequences} (cache of "
        f"{2 * trace.top_k} experts per layer); {report}"
    )
    print_results(result.to_dict(), evaluation)

    from stmoe.analysis.report import write_report  # matplotlib loads only here

    data = write_report(reread, output_dir / "report", with_json=True)
    out.print(
        f"[6/6] analysis: {data['spatial']['pairs_significant']}/{data['spatial']['pairs_total']} "
        f"layer pairs reject independence, consecutive-token overlap "
        f"{data['temporal']['overlap_ratio']:.2f}x random; {output_dir / 'report' / 'report.html'}"
    )
    out.print(f"done in {time.perf_counter() - start:.1f} s; files in {output_dir}/")
