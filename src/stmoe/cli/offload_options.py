"""The offloading options `stmoe generate` and `stmoe serve` share: one definition each
(their help, their defaults: ``OffloadOptions``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stmoe.cli.common import path_option
from stmoe.cli.help_panels import CACHE, MODEL, TIER, WEIGHTS
from stmoe.cli.pack import GROUP_HELP
from stmoe.runtime.options import OffloadOptions

_DEFAULT = OffloadOptions()  # the one place the offload defaults are written

ModelOpt = Annotated[
    Path | None,
    path_option(help="Local transformers MoE checkpoint folder. Default: stmoe's shipped "
                "model.", rich_help_panel=MODEL),
]

StoreOpt = Annotated[
    Path | None,
    path_option(help="Expert store (`stmoe pack`). Default: a copy of the model's experts "
                "packed on first use into ~/.cache/stmoe/stores (STMOE_CACHE overrides).",
                rich_help_panel=MODEL),
]

CapacityOpt = Annotated[
    str | None,
    typer.Option(help="Experts cached per layer (8), a share (50%) or bytes for the whole "
                 "model (64MB); >= top-k. Or one count per MoE layer (48,60,12). Default: "
                 f"{_DEFAULT.capacity}.", rich_help_panel=CACHE),
]

MemoryOpt = Annotated[
    str | None,
    typer.Option(help="Instead of --capacity: a budget for the whole process, page cache "
                 "included (10GB); the cache gets what the other weights leave (printed; gpu "
                 "tiers: of the GPU's free memory).", rich_help_panel=CACHE),
]

PredictorOpt = Annotated[
    str,
    typer.Option(help="stmoe-plus (ST-MoE with the additions of docs/predictors.md), stmoe "
                 "(the paper's, exactly), hybrid (+ gate lookahead), gate-lookahead, ondemand "
                 "(no prefetch), random, oracle, or any `stmoe eval` predictor.",
                 rich_help_panel=CACHE),
]

TablesOpt = Annotated[
    Path | None,
    path_option(help="Tables from `stmoe profile`. Default: the shipped model's.",
                rich_help_panel=CACHE),
]

PolicyOpt = Annotated[
    str,
    typer.Option(help="Eviction: lru (keeping what is predicted next; alias: predicted), lfu, "
                 "none (no reuse) or score (the expert the predictor scores lowest: "
                 "stmoe-plus, hybrid, stmoe-mix).", rich_help_panel=CACHE),
]

MaxLoadsOpt = Annotated[
    int | None,
    typer.Option(help="Loads one prediction may start per layer (>= 0). Default: the "
                 "capacity.", rich_help_panel=CACHE),
]

LookaheadOpt = Annotated[
    str,
    typer.Option(help="hybrid's and gate-lookahead's: late (the next layer's router on its "
                 "input), early (on this layer's MoE input) or auto (late where known).",
                 rich_help_panel=CACHE),
]

AdmissionOpt = Annotated[
    bool,
    typer.Option(help="Per layer, prefetch only while the run measures that it pays; "
                 "--no-admission: every predicted load.", rich_help_panel=CACHE),
]

TierOpt = Annotated[
    str,
    typer.Option(help="disk (page cache bypassed), emulated (host memory behind --bandwidth "
                 "and --latency; EMULATED), gpu (pinned host store, GPU cache) or gpu-disk "
                 "(disk to the GPU's cache through pinned buffers: a model bigger than host "
                 "RAM; --in-place too).", rich_help_panel=TIER),
]

BandwidthOpt = Annotated[
    str | None,
    typer.Option(help="Emulated link's bytes/s, e.g. 200MB (>= 1KB).", rich_help_panel=TIER),
]

LatencyOpt = Annotated[
    str,
    typer.Option(help="Emulated link's latency per transfer, e.g. 50us (0 to 60 s).",
                 rich_help_panel=TIER),
]

WorkersOpt = Annotated[
    int | None,
    typer.Option(help="Prefetch threads, 0 to 64. Default: 2 (disk, gpu-disk), 1 (emulated, "
                 "gpu).", rich_help_panel=TIER),
]

ThreadsOpt = Annotated[
    int | None,
    typer.Option(help="torch threads, 1 to 1024. Default: one per core "
                 "(benchmarks/bench_threads.py).",
                 rich_help_panel=TIER),
]

FormatOpt = Annotated[
    str | None,
    typer.Option("--format", help="Expert weights: native (lossless), int8 or int4 (lossy: "
                 "docs/benchmarks.md). Default: the --store's, else native.",
                 rich_help_panel=WEIGHTS),
]

GroupSizeOpt = Annotated[int | None, typer.Option(
    help=GROUP_HELP + " Alone (no --format): int4 in groups of that size, e.g. an int4 "
    "--store's.", rich_help_panel=WEIGHTS)]

InPlaceOpt = Annotated[
    bool,
    typer.Option("--in-place", help="No copy: read the native experts from the checkpoint's "
                 "safetensors (an index made once). Disk tiers.", rich_help_panel=WEIGHTS),
]

QuantizeResidentOpt = Annotated[
    str | None,
    typer.Option(help="int8 or int4 for attention, shared experts and lm_head too (lossy). "
                 "Default: native.", rich_help_panel=WEIGHTS),
]


def checked_model(model: Path | None, capacity: str | None, memory: str | None) -> Path:
    """The model folder (the shipped model by default), with what can be refused before
    torch and the model load (seconds): --capacity beside --memory, a --model that is not
    a folder, a --capacity the model cannot take (``check_capacity_early``)."""
    from stmoe.errors import StmoeError

    if memory is not None and capacity is not None:
        raise StmoeError("give --capacity or --memory, not both (--memory sizes the cache)")
    if model is not None and not model.is_dir():
        raise StmoeError(f"{model}: not a folder; --model expects a local transformers "
                         "checkpoint folder")
    if model is None:
        from stmoe.models import SHIPPED_MODEL

        model = Path(SHIPPED_MODEL)
    check_capacity_early(model, capacity)
    return model


def offload_for(command: str, model: Path, store: Path | None, capacity: str | None,
                threads: int | None, **options: Any) -> Any:
    """``stmoe.offload`` of ``model`` for a command: torch's threads set, the capacity's
    default applied, a missing torch or transformers said in one line."""
    from stmoe.errors import StmoeError

    try:
        import torch

        from stmoe.runtime.api import offload
    except ImportError as exc:
        raise StmoeError(f"{command} needs torch and transformers ({exc}); install them with "
                         "pip install -e '.[hf]'") from None
    if threads is not None:
        torch.set_num_threads(threads)
    return offload(model, store, capacity=capacity or _DEFAULT.capacity, **options)


def check_capacity_early(model: Path, capacity: str | None) -> None:
    """A --capacity the model cannot take, refused from its config.json alone
    (``util.units.layer_capacities``: the grammar, a count above its N, a share or
    count below its top-k). A byte budget's count needs the store, and a split's number of
    counts the model's MoE layers, so they come later."""
    import json

    from stmoe.errors import StmoeError
    from stmoe.util.config_names import NUM_EXPERTS, TOP_K, config_int
    from stmoe.util.units import layer_capacities

    if capacity is None:
        return
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader says what is wrong with the folder
    experts, top_k = (config_int(config, names) for names in (NUM_EXPERTS, TOP_K))
    if not isinstance(config, dict) or experts is None or top_k is None:
        return  # the loader says what the config lacks; the runtime checks the capacity then
    layer_capacities(capacity, experts, top_k, num_layers=None, error=StmoeError)
