"""`stmoe pack`: write a model's routed experts as an expert store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli.common import out, path_argument, path_option

FORMAT_HELP = ("Experts' weight format: native (the checkpoint's dtype, bf16 for real "
               "checkpoints; lossless; bf16 is accepted as its name), int8 (one scale per "
               "output channel) or int4 (a scale and zero per group of --group-size weights). "
               "int8 and int4 are lossy: outputs are then bit-identical to the resident model "
               "in that format, not to the original; docs/benchmarks.md gives their quality.")
GROUP_HELP = ("int4's group size: 32, 64, 128 or 256 weights per scale and zero (default: the "
              "largest of 128, 64, 32 that divides every expert matrix's input width).")


def pack_cmd(
    model_dir: Annotated[Path, path_argument(metavar="MODEL_DIR", help="Local checkpoint folder.")],
    output: Annotated[Path, path_option("--output", "-o", help="Store folder to write.")],
    weights: Annotated[str, typer.Option("--format", help=FORMAT_HELP)] = "native",
    group_size: Annotated[int | None, typer.Option(help=GROUP_HELP)] = None,
) -> None:
    """Write every (layer, expert)'s weights as one contiguous, 4 KiB-aligned block.

    One expert is then one read (page-cache bypass possible); an index records
    offsets, shapes, checksums and the checkpoint files' SHA-256, so the store is
    only ever used with this model's weights. The experts are read one at a time
    from the safetensors shards, never the whole model in memory. Packing the same
    model twice gives the same bytes; packing over an existing store replaces it in
    one step (a killed pack leaves the old store whole).
    """
    from stmoe.quant import parse_format
    from stmoe.runtime.store import ExpertStore, pack_folder

    path = pack_folder(model_dir, output, weights=parse_format(weights, group_size))
    store = ExpertStore(path)
    size = store.data_path.stat().st_size
    out.print(f"wrote {path}: {size / 2**20:.1f} MiB of experts, {store.weights.label}",
              markup=False)
