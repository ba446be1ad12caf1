"""`stmoe train-tiny`: the recipe of the shipped model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli._common import out


def train_tiny_cmd(
    output: Annotated[Path, typer.Option("--output", "-o", help="Checkpoint folder to write.")],
    minutes: Annotated[float, typer.Option(help="Wall-clock training budget.", min=0.1)] = 38.0,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Train stmoe's small Qwen2-MoE model on CPU from text the package registries ship.

    Code: the Python standard library's sources; prose: Python's reference
    documentation (pydoc_data); math: the CHAMP problems (champ-dataset, MIT).
    Writes a transformers checkpoint, its tokenizer and training_report.json.
    """
    import dataclasses

    from stmoe.train_tiny import TrainSpec, train

    report = train(output, dataclasses.replace(TrainSpec(), minutes=minutes, seed=seed),
                   log=out.print)  # fmt: skip
    out.print(f"wrote {output}: {report['steps']} steps, validation loss "
              f"{report['validation_loss']}")  # fmt: skip
