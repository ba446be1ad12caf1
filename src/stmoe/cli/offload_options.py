"""The offloading options `stmoe generate` and `stmoe serve` share: one definition each
(their help, their defaults: ``OffloadOptions``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stmoe.cli.common import path_option
from stmoe.cli.pack import FORMAT_HELP, GROUP_HELP, IN_PLACE_HELP
from stmoe.runtime.options import OffloadOptions

_DEFAULT = OffloadOptions()  # the one place the offload defaults are written

ModelOpt = Annotated[
    Path | None,
    path_option(
        help="Local transformers MoE checkpoint folder. Default: stmoe's shipped model."
    ),
]

StoreOpt = Annotated[
    Path | None,
    path_option(
        help="Expert store from `stmoe pack`. Default: packed on first use into "
        "~/.cache/stmoe/stores (STMOE_CACHE overrides)."
    ),
]

CapacityOpt = Annotated[
    str | None,
    typer.Option(
        help="Cache size: experts per layer (8, at most the model's N), a share of "
        "the experts (50%, at most 100%), or a total size in bytes for the whole model "
        "(64MB; a larger budget than all experts caches them all). At least the router's "
        f"top-k. Default: {_DEFAULT.capacity} (or what --memory leaves)."
    ),
]

MemoryOpt = Annotated[
    str | None,
    typer.Option(
        help="A memory budget for the whole process, page cache included (e.g. 10GB): "
        "the expert cache is sized from it once the non-expert weights are loaded (the "
        "split is printed; on the gpu tiers the slots from the GPU's free memory, less the "
        "resident weights and KV cache). In place of --capacity."
    ),
]

PredictorOpt = Annotated[
    str,
    typer.Option(
        help="Prefetch predictor: stmoe, stmoe-plus, hybrid (tables + gate "
        "lookahead), gate-lookahead, ondemand (no prefetch), random, oracle (a first "
        "pass learns the routing), or any other `stmoe eval` predictor."
    ),
]

TablesOpt = Annotated[
    Path | None,
    path_option(
        help="Profiled tables (`stmoe profile`) for table predictors. Default: "
        "those shipped with the default model."
    ),
]

PolicyOpt = Annotated[
    str,
    typer.Option(
        help="Eviction: lru (never evicting an expert predicted for the coming layer; "
        "'predicted' is its former name), lfu, or none (no reuse: plain on-demand "
        "offloading). See stmoe.cache_policy."
    ),
]

MaxLoadsOpt = Annotated[
    int | None,
    typer.Option(
        help="Loads one prediction may start per layer (its most confident "
        "experts not yet cached; >= 0). Default: the capacity."
    ),
]

LookaheadOpt = Annotated[
    str,
    typer.Option(
        help="Gate lookahead of hybrid and gate-lookahead: late (the next layer's "
        "router on its own input, predicted as that layer starts: closer to the "
        "router, less time to load), early (on this layer's MoE input, predicted as "
        "this layer routes), or auto (late where the model's norms are recognised)."
    ),
]

AdmissionOpt = Annotated[
    bool,
    typer.Option(
        help="Decide per layer, from what the run measures (the predictor's precision "
        "by rank, the tier's read time and busy share, the layer's time), whether a "
        "prefetch is worth its bytes; a layer whose prefetch loses falls back to the "
        "plain cache and probes again later. --no-admission: every predicted load."
    ),
]

TierOpt = Annotated[
    str,
    typer.Option(
        help="disk (real reads, page cache bypassed), emulated (host memory "
        "behind a link of --bandwidth and --latency; EMULATED), gpu (the store in pinned "
        "host memory, the cache in the GPU's), or gpu-disk (disk reads through pinned "
        "bounce buffers to the GPU's cache: a model bigger than host RAM; --in-place too)."
    ),
]

BandwidthOpt = Annotated[
    str | None,
    typer.Option(
        help="Emulated link bandwidth in bytes/s, e.g. 200MB (at least 1KB; --tier "
        "emulated only)."
    ),
]

LatencyOpt = Annotated[
    str,
    typer.Option(
        help="Emulated link latency per transfer, e.g. 50us or 2ms (0 to 60 s; --tier "
        "emulated only)."
    ),
]

WorkersOpt = Annotated[
    int | None,
    typer.Option(
        help="Prefetch worker threads, 0 (no prefetching) to 64 (default: 2 for "
        "disk and gpu-disk, 1 for the single-link emulated and gpu tiers)."
    ),
]

ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        help="torch compute threads, 1 to 1024 (default: torch's, one per core; on 2 cores "
        "2 threads decoded 1.2-1.4x faster than 1 while prefetching: "
        "benchmarks/bench_threads.py)."
    ),
]

FormatOpt = Annotated[
    str | None,
    typer.Option("--format", help=FORMAT_HELP + " Default: the --store's own, else native "
                 "(a store in the format is packed on first use)."),
]

GroupSizeOpt = Annotated[int | None, typer.Option(help=GROUP_HELP)]

InPlaceOpt = Annotated[bool, typer.Option("--in-place", help=IN_PLACE_HELP)]

QuantizeResidentOpt = Annotated[
    str | None,
    typer.Option(help="Quantize the resident linears too (attention, shared experts, "
                 "lm_head), int8 or int4 (lossy; routers and gates stay native). Default: "
                 "native."),
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
    (``util.units.capacity_per_layer``: the grammar, a count above its N, a share or
    count below its top-k). A byte budget's count needs the store, so it comes later."""
    import json

    from stmoe.errors import StmoeError
    from stmoe.util.config_names import NUM_EXPERTS, TOP_K, config_int
    from stmoe.util.units import capacity_per_layer

    if capacity is None:
        return
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader says what is wrong with the folder
    experts, top_k = (config_int(config, names) for names in (NUM_EXPERTS, TOP_K))
    if not isinstance(config, dict) or experts is None or top_k is None:
        return  # the loader says what the config lacks; the runtime checks the capacity then
    capacity_per_layer(capacity, experts, top_k, error=StmoeError)
