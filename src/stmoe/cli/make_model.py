"""`stmoe make-model`: a random-weight checkpoint with a real model's dimensions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli.common import check_range, clean_label, out, path_option
from stmoe.errors import StmoeError
from stmoe.sim.specs import preset_names
from stmoe.util.units import UnitError, parse_layer_range


def make_model_cmd(
    like: Annotated[
        str,
        typer.Option(
            "--like",
            help=f"A simulator model preset ({', '.join(preset_names('models'))}) or a "
            "spec .toml file.",
        ),
    ],
    output: Annotated[Path, path_option("--output", "-o", help="Checkpoint folder to write.")],
    layers: Annotated[
        str | None,
        typer.Option(
            "--layers",
            help="Only N MoE layers (default: all of the preset's): N, or A:B for layers A "
            "to B-1 (the same shape: with random weights any B-A layers are alike; the "
            "range is for the routing, `profile` / `generate --routing` --layers A:B).",
        ),
    ] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="Weight dtype: bfloat16, float16 or float32.")
    ] = "bfloat16",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights (>= 0).")] = 0,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the shape and size only; write nothing.")
    ] = False,
) -> None:
    """Write a transformers checkpoint with RANDOM weights and a real model's dimensions.

    Hidden size, expert width, experts, top-k and attention heads come from the
    preset; the vocabulary is the shipped tokenizer's. `stmoe pack` and `stmoe
    generate` run on it unchanged. Its text and its own routing are meaningless:
    measure with real routing through it (`stmoe generate --routing TRACE`).
    Written one shard at a time, with a progress bar, into a folder beside the
    output that takes its place once whole: a killed or failed run (a full disk)
    leaves the old checkpoint as it was.
    """
    from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint

    check_range("--seed", seed, 0)
    count = None
    if layers is not None:
        total = plan_checkpoint(like, None, dtype).spec.layers
        try:
            start, stop = parse_layer_range(layers, total)
        except UnitError as exc:
            raise StmoeError(str(exc)) from None
        count = stop - start
    plan = plan_checkpoint(like, count, dtype)
    spec, cfg = plan.spec, plan.config
    expert_mib = 3 * spec.hidden * spec.expert_intermediate * (2 if dtype != "float32" else 4)
    out.print(f"{clean_label(like)}: {cfg.model_type}, {cfg.num_hidden_layers} MoE layers x "
              f"{spec.num_experts} experts (top-{spec.top_k}), experts of "
              f"{expert_mib / 2**20:.1f} MiB, {plan.nbytes / 2**30:.2f} GiB in all ({dtype}, "
              "RANDOM weights)")
    if dry_run:
        return
    path = make_checkpoint(plan, output, seed=seed)
    out.print(f"wrote {clean_label(path)}")
