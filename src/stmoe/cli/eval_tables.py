"""What `stmoe eval` prints: the predictors at equal set size first (the comparison that
holds), then each at its own set size with the cache replay, then the cross-domain grid."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from stmoe.cli.common import clean_label, out
from stmoe.trace import RoutingTrace


def _num(value: float | None, spec: str) -> str:
    """A figure, or '-' where it is undefined (None: nothing to divide by)."""
    return "-" if value is None else format(value, spec)


def equal_size_table(equal: dict[str, Any]) -> Table:
    """Recall of every predictor at the reference's mean set size, and the points each
    gains or loses against the reference ('-': its sets never get that large)."""
    ref, size = equal["reference"], equal["set_size"]
    table = Table(title=f"At equal set size: {size:.2f} experts per prediction ({ref}'s "
                  "mean)", title_justify="left")
    for col in ("predictor", "recall", f"vs {ref} (points)", "own set size"):
        table.add_column(col, justify="left" if col == "predictor" else "right")
    base = equal["recall"][ref]
    for name, value in equal["recall"].items():
        gain = "" if name == ref or value is None else f"{100 * (value - base):+.1f}"
        table.add_row(clean_label(name), "-" if value is None else f"{value:.3f}", gain,
                      f"{equal['own_set_size'][name]:.2f}")
    return table


def print_results(data: dict[str, Any], trace: RoutingTrace) -> None:
    synthetic = " [SYNTHETIC]" if trace.meta.synthetic else ""
    title = f"{clean_label(trace.meta.model)}{synthetic}: {clean_label(data['scope'])}"
    equal = data.get("equal_set_size")
    if equal:
        out.print(equal_size_table(equal))
        out.print("Recall grows with the experts a prediction names: compare predictors here, "
                  "at one set size (each prediction cut to its best experts, read off its "
                  "recall-versus-budget curve; '-': its sets never get that large). Below, "
                  "each at its own set size, with the cache replay.", soft_wrap=True)
    table = Table(title=f"{title}: each predictor at its own set size" if equal else title,
                  title_justify="left")
    # recall is over the scope's tokens (decode tokens where the trace has any: the title
    # says which); prefill recall beside it (a decode column would repeat recall)
    for col in ("predictor", "recall", "precision", "set size", "prefill recall"):
        table.add_column(col, justify="left" if col == "predictor" else "right")
    has_cache = any("cache" in e for e in data["predictors"].values())
    if has_cache:
        for col in ("hit rate", "bound", "moved/token", "wasted/token", "read amp"):
            table.add_column(col, justify="right")
    for name, e in data["predictors"].items():
        row = [clean_label(name), _num(e["recall"], ".3f"), _num(e["precision"], ".3f"),
               _num(e["set_size"], ".2f"), _num(e["prefill"]["recall"], ".3f")]
        if has_cache:
            c = e["cache"]
            row += [f"{c['hit_rate']:.3f}", f"{c['bound_hit_rate']:.3f}",
                    f"{c['moved_per_token']:.1f}",
                    f"{c['wasted_per_token']:.1f}", _num(c["read_amplification"], ".2f")]
        table.add_row(*row)
    out.print(table)
    if has_cache:  # (recall's scope is the title's; the cache serves every layer)
        out.print("The cache columns replay every layer, layer 0 included, over the same "
                  "tokens: a cache serves each layer's experts, predicted or not. bound: the "
                  "most hits any eviction could make with the same prefetches (belady, "
                  "knowing the trace).", soft_wrap=True)
    matrix = data.get("cross_domain")
    if matrix:
        grid = Table(title=f"cross-domain recall ({clean_label(matrix['predictor'])}): rows "
                     "profiled on, columns evaluated on", title_justify="left")
        grid.add_column("")
        for d in matrix["evaluated_on"]:
            grid.add_column(clean_label(d), justify="right")
        for d, row in zip(matrix["profiled_on"], matrix["recall"], strict=True):
            grid.add_row(clean_label(d), *("-" if x is None else f"{x:.3f}" for x in row))
        out.print(grid)
