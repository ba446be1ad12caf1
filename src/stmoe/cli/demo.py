"""``stmoe demo``: the main job, on stmoe's own shipped MoE model, with no arguments."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from stmoe.cli._common import clean_label, err, out, path_option
from stmoe.errors import StmoeError


def demo(
    output_dir: Annotated[
        Path, path_option("--output", "-o", help="Folder for the report and its files.")
    ] = Path("stmoe-demo"),
    quick: Annotated[
        bool, typer.Option(help="A reduced run: 3 prompts, 8 new tokens (for tests and CI).")
    ] = False,
) -> None:
    """Run the whole pipeline on the shipped model and write one report.

    Captures routing from stmoe's own small Qwen2-MoE model on built-in code, prose
    and math prompts, profiles per-domain ST-MoE tables, replays every predictor and
    the cross-domain matrix, analyses the correlations, simulates the accelerator,
    generates with the experts offloaded (on-demand, LRU, ST-MoE, oracle prefetch on
    an emulated link) and writes DIR/index.html.
    """
    try:
        from stmoe.demo import run_demo
    except ImportError as exc:
        raise StmoeError(f"the demo needs torch and transformers ({exc}); install them with "
                         "pip install -e '.[hf]'") from None  # fmt: skip
    start = time.perf_counter()
    with err.status("starting") as status:

        def stage(text: str) -> None:
            out.print(f"[{time.perf_counter() - start:5.1f} s] {clean_label(text)}")
            status.update(clean_label(text))

        summary = run_demo(output_dir, quick=quick, stage=stage)
    table = Table(title="ST-MoE recall per domain (held-out half)", title_justify="left")
    table.add_column("predictor")
    domains = list(summary["recall"])
    for d in domains:
        table.add_column(clean_label(d), justify="right")
    for name in summary["recall"][domains[0]]:
        table.add_row(clean_label(name), *(f"{summary['recall'][d][name]:.3f}" for d in domains))
    out.print(table)
    out.print(
        f"{summary['pairs_significant']}/{summary['pairs_total']} layer pairs reject independence; "
        f"consecutive-token overlap {summary['overlap_ratio']:.2f}x random; simulated decode time "
        f"ST-MoE {summary['stmoe_normalized_time']:.2f}x, oracle "
        f"{summary['oracle_normalized_time']:.2f}x the GPU baseline"
    )
    off = summary["offload"]["systems"]
    out.print(
        f"offloaded generation at 50% capacity (EMULATED {summary['offload']['link']}/s link): "
        + ", ".join(f"{n} {r['decode_tokens_per_s']:.1f}" for n, r in off.items())
        + f" tokens/s; identical tokens: {summary['offload']['identical_tokens']}"
    )
    out.print(
        f"report: {clean_label(output_dir / 'index.html')}  ({time.perf_counter() - start:.0f} s)"
    )
