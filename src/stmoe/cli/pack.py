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
IN_PLACE_HELP = ("Read the native experts where the checkpoint's safetensors hold them: no "
                 "store is written, only a small index (made once, every expert read once "
                 "for its checksum). For a checkpoint too big to copy; the disk and gpu-disk "
                 "tiers and --format native only.")
VERIFY_HELP = ("Write nothing: prove OUTPUT is what packing MODEL_DIR gives (every checkpoint "
               "file hashed again, every block re-derived and compared with the store's entry "
               "and bytes; for an in-place index, its extents and every block's checksum). "
               "The cost of one pack's read; for a store from someone else.")
GROUP_HELP = ("int4's weights per scale and zero: 32, 64, 128 or 256. Default: the largest of "
              "128, 64, 32 dividing every expert matrix's input width.")


def pack_cmd(
    output: Annotated[Path, path_option("--output", "-o", help="Store folder to write.")],
    model_dir: Annotated[Path | None, path_argument(
        metavar="MODEL_DIR", help="Local checkpoint folder. Default: stmoe's shipped model.",
        show_default=False)] = None,
    weights: Annotated[str, typer.Option("--format", help=FORMAT_HELP)] = "native",
    group_size: Annotated[int | None, typer.Option(help=GROUP_HELP)] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help=IN_PLACE_HELP + " Writes "
                                           "only OUTPUT/index.json.")] = False,
    verify: Annotated[bool, typer.Option("--verify", help=VERIFY_HELP)] = False,
) -> None:
    """Write every (layer, expert)'s weights as one contiguous, 4 KiB-aligned block.

    One expert is then one read (page-cache bypass possible); an index records
    offsets, shapes, checksums and the checkpoint files' SHA-256, so the store is
    only ever used with this model's weights. The experts are read one at a time
    from the safetensors shards, never the whole model in memory. Packing the same
    model twice gives the same bytes; packing over an existing store replaces it in
    one step (a killed pack leaves the old store whole). With --verify nothing is
    written: an existing OUTPUT is proven to be MODEL_DIR's (docs/runtime.md says
    what an index edited by hand can and cannot do without it).
    """
    from stmoe.models import SHIPPED_MODEL
    from stmoe.quant import parse_format
    from stmoe.runtime.store import ExpertStore, StoreError, pack_folder

    model_dir = Path(SHIPPED_MODEL) if model_dir is None else model_dir

    if verify:
        from stmoe.runtime.store.verify import verify_store

        store = verify_store(model_dir, output)
        kind = "in-place index" if store.in_place else "store"
        out.print(f"verified {output}: every block of this {kind} is {model_dir}'s own "
                  f"({len(store.blocks)} blocks, {store.weights.label})", markup=False)
        return
    fmt = parse_format(weights, group_size)
    _refuse_bf16_of_another_dtype(weights, model_dir)
    if in_place:
        from stmoe.runtime.store.in_place_index import make_in_place

        if fmt.quantized:
            raise StoreError(f"--in-place reads the checkpoint's own bytes; {fmt.label} "
                             "experts are packed (leave out --in-place)")
        path = make_in_place(model_dir, output)
        store = ExpertStore(path)
        out.print(f"wrote {path / 'index.json'}: {store.index.data_bytes / 2**20:.1f} MiB of "
                  f"experts read in place from {model_dir}, {store.weights.label}",
                  markup=False)
        return
    path = pack_folder(model_dir, output, weights=fmt)
    store = ExpertStore(path)
    assert store.data_path is not None
    size = store.data_path.stat().st_size
    out.print(f"wrote {path}: {size / 2**20:.1f} MiB of experts, {store.weights.label}",
              markup=False)


def _refuse_bf16_of_another_dtype(weights: str, model_dir: Path) -> None:
    """``--format bf16`` names the native format of a bf16 checkpoint (stmoe converts no
    dtype): asked of a checkpoint of another dtype, it would write that dtype, labelled
    native, which is not what was asked. Refused where the config names its dtype."""
    import json

    from stmoe.runtime.store import StoreError

    if weights.strip().lower() not in ("bf16", "bfloat16"):
        return
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # (the pack itself says what is wrong with the folder)
    dtype = (config.get("torch_dtype") or config.get("dtype")) if isinstance(config, dict) \
        else None
    if isinstance(dtype, str) and dtype not in ("bfloat16", "bf16"):
        raise StoreError(f"--format {weights}: {model_dir}'s weights are {dtype}; bf16 is the "
                         "native format of a bf16 checkpoint (stmoe converts no dtype): use "
                         "--format native to keep them, or int8/int4")
