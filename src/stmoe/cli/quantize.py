"""`stmoe quantize`: a checkpoint's routed experts in int8, in the format vLLM loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli.common import clean_label, out, path_argument, path_option


def quantize_cmd(
    model_dir: Annotated[Path, path_argument(metavar="MODEL_DIR",
                                             help="A float transformers checkpoint folder.")],
    output: Annotated[Path, path_option("--output", "-o",
                                        help="Checkpoint folder to write (new or empty).")],
    weights: Annotated[str, typer.Option(
        "--format", help="The experts' format: int8 (symmetric, one scale per output row: "
        "stmoe's int8). The only one vLLM's CPU kernel the plugin serves takes.")] = "int8",
) -> None:
    """Write MODEL_DIR with its routed experts in int8, for vLLM (compressed-tensors W8A8).

    Each expert matrix is quantized as `stmoe pack --format int8` does; everything
    else (attention, router, shared experts, lm_head) is copied as it is. vLLM's CPU
    build then computes the experts with its int8 kernel, which also quantizes each
    token's activations to int8 as it runs (W8A8). LOSSY, the user's choice: the
    stmoe vLLM plugin serves it bit for bit as plain vLLM does, and docs/vllm.md
    gives its quality against the float model. Written one shard at a time into a
    folder beside OUTPUT that takes its place once whole.
    """
    from stmoe.quant.vllm_checkpoint import quantize_checkpoint

    report = quantize_checkpoint(model_dir, output, weights)
    out.print(f"wrote {clean_label(str(report.out))}: {report.matrices} expert matrices in "
              f"int8 W8A8 (LOSSY: mean relative weight error {report.mean_relative_error:.4f}), "
              f"experts {report.experts_bytes_before / 2**20:.1f} MiB -> "
              f"{report.experts_bytes_after / 2**20:.1f} MiB; serve it with vLLM "
              "(--dtype bfloat16), the stmoe plugin on or off")
