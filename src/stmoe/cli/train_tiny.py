"""`stmoe train-tiny`: the recipe of the shipped model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli.common import check_range, clean_label, out, path_option


def train_tiny_cmd(
    output: Annotated[Path, path_option("--output", "-o", help="Checkpoint folder to write.")],
    minutes: Annotated[
        float, typer.Option(help="Wall-clock training budget, 0.1 to 10080 (a week).")
    ] = 38.0,
    seed: Annotated[int, typer.Option(help="Random seed (>= 0).")] = 0,
) -> None:
    """Train stmoe's small Qwen2-MoE model on CPU from text the package registries ship.

    Code: the Python standard library's sources; prose: Python's reference
    documentation (pydoc_data); math: the CHAMP problems (champ-dataset, MIT).
    Writes a transformers checkpoint, its tokenizer and training_report.json.
    """
    import dataclasses

    check_range("--minutes", minutes, 0.1, 10080.0)
    check_range("--seed", seed, 0)

    from stmoe.hf.train_tiny import TrainSpec, train

    report = train(output, dataclasses.replace(TrainSpec(), minutes=minutes, seed=seed),
                   log=lambda line: out.print(clean_label(line)))
    out.print(f"wrote {clean_label(output)}: {report['steps']} steps, validation loss "
              f"{report['validation_loss']}")
