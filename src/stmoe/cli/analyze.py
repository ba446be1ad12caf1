"""`stmoe analyze`: the spatial and temporal evidence, as a report with figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from stmoe.cli.common import (
    JSON_HELP,
    check_inputs,
    clean_label,
    json_to_stdout,
    out,
    path_argument,
    path_option,
    write_json,
)


def analyze_cmd(
    traces: Annotated[list[Path], path_argument(metavar="TRACE...", help="Traces of one model.")],
    output: Annotated[Path, path_option("--output", "-o", help="Folder for the report.")],
    json_out: Annotated[Path | None, path_option("--json", help=JSON_HELP)] = None,
) -> None:
    """Test and plot the correlations ST-MoE relies on, on your own routing.

    Writes DIR/report.md and DIR/report.html with PNG figures: cross-layer
    co-activation and chi-square independence tests per adjacent layer pair,
    consecutive-token overlap against random routing (K^2/N) with confidence
    intervals, reuse distances, expert load skew, per-domain differences when the
    trace has several domains, and the predictors' recall-versus-budget curves.
    """
    from stmoe.analysis.report import write_report  # matplotlib loads only here
    from stmoe.trace import import_files

    check_inputs("a trace file", traces)
    json_to_stdout(json_out)
    trace = import_files(traces)
    data = write_report(trace, output)
    if write_json(data, json_out):
        return
    s, t = data["spatial"], data["temporal"]
    synthetic = " [SYNTHETIC]" if trace.meta.synthetic else ""
    out.print(
        f"{clean_label(trace.meta.model)}{synthetic}: {s['pairs_significant']}/"
        f"{s['pairs_total']} layer pairs reject independence (p < {s['alpha']}); "
        + (f"consecutive-token overlap {t['overlap_ratio']:.2f}x random" if t["token_pairs"]
           else "no consecutive tokens to compare (every sequence holds one)")
    )
    report = clean_label(output / "report")
    out.print(f"wrote {report}.html and {report}.md")
