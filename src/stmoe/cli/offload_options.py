"""The offloading options `stmoe generate` and `stmoe serve` share: one definition each
(their help, their defaults: ``OffloadOptions``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli.common import path_option
from stmoe.cli.pack import FORMAT_HELP, GROUP_HELP
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
        "split is printed). In place of --capacity."
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
        "behind a link of --bandwidth and --latency; EMULATED), or gpu (pinned "
        "host memory to a CUDA cache)."
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
        "disk, 1 for the single-link emulated and gpu tiers)."
    ),
]

ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        help="torch compute threads, 1 to 1024 (default: torch's). One leaves a core "
        "to the prefetch workers on small machines."
    ),
]

FormatOpt = Annotated[
    str | None,
    typer.Option("--format", help=FORMAT_HELP + " Default: the --store's own, else native "
                 "(a store in the format is packed on first use)."),
]

GroupSizeOpt = Annotated[int | None, typer.Option(help=GROUP_HELP)]

QuantizeResidentOpt = Annotated[
    str | None,
    typer.Option(help="Quantize the resident linears too (attention, shared experts, "
                 "lm_head), int8 or int4 (lossy; routers and gates stay native). Default: "
                 "native."),
]


def check_capacity_early(model: Path | None, capacity: str | None) -> None:
    """A --capacity the model cannot take, refused from its config.json alone, before
    torch and the model load (seconds): the grammar, a count above its N, a share or
    count below its top-k. A byte budget's check needs the store, so it comes later."""
    import json

    from stmoe.errors import OffloadError, StmoeError
    from stmoe.runtime.options import _TOP_K_NAMES, resolve_capacity
    from stmoe.util.units import UnitError, parse_capacity

    if capacity is None:
        return
    try:
        parsed = parse_capacity(capacity)
    except UnitError as exc:
        raise StmoeError(str(exc)) from None
    if parsed.kind == "bytes":
        return
    if model is None:
        from stmoe.models import SHIPPED_MODEL

        model = SHIPPED_MODEL
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader says what is wrong with the folder
    configs = [config, config.get("text_config") or {}]
    experts = next((c[k] for c in configs for k in ("num_experts", "num_local_experts",
                                                      "n_routed_experts")
                    if isinstance(c.get(k), int)), None)
    top_k = next((c[k] for c in configs for k in _TOP_K_NAMES if isinstance(c.get(k), int)),
                 None)
    if experts is None or top_k is None:
        return
    try:
        resolve_capacity(capacity, 1, experts, top_k, 1)
    except OffloadError as exc:
        raise StmoeError(str(exc)) from None
