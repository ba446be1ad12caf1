"""`stmoe pack`: write a model's routed experts as an expert store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from stmoe.cli.common import out, path_argument, path_option


def pack_cmd(
    model_dir: Annotated[Path, path_argument(metavar="MODEL_DIR", help="Local checkpoint folder.")],
    output: Annotated[Path, path_option("--output", "-o", help="Store folder to write.")],
) -> None:
    """Write every (layer, expert)'s weights as one contiguous, 4 KiB-aligned block.

    One expert is then one read (page-cache bypass possible); an index records
    offsets, shapes, checksums and the checkpoint files' SHA-256, so the store is
    only ever used with this model's weights. The experts are read one at a time
    from the safetensors shards, never the whole model in memory. Packing the same
    model twice gives the same bytes; packing over an existing store replaces it in
    one step (a killed pack leaves the old store whole).
    """
    from stmoe.runtime.store import ExpertStore, pack_folder

    path = pack_folder(model_dir, output)
    size = ExpertStore(path).data_path.stat().st_size
    out.print(f"wrote {path}: {size / 2**20:.1f} MiB of experts")
