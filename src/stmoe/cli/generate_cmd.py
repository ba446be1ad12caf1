"""`stmoe generate`: generate text with the experts offloaded, and measure it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli._common import key_value_table, out
from stmoe.errors import StmoeError


def generate_cmd(
    prompt: Annotated[str, typer.Option(help="The prompt text.")],
    model: Annotated[
        Path | None,
        typer.Option(
            help="Local transformers MoE checkpoint folder. Default: stmoe's shipped model."
        ),
    ] = None,
    store: Annotated[
        Path | None,
        typer.Option(
            help="Expert store from `stmoe pack`. Default: packed on first use into "
            "~/.cache/stmoe/stores (STMOE_CACHE overrides)."
        ),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.", min=1)] = 32,
    capacity: Annotated[
        str,
        typer.Option(
            help="Cache size: experts per layer (8), a share of the experts (50%), "
            "or a total size in bytes for the whole model (64MB). At least the router's "
            "top-k."
        ),
    ] = "50%",
    predictor: Annotated[
        str,
        typer.Option(
            help="Prefetch predictor: stmoe, stmoe-plus, hybrid (tables + gate "
            "lookahead), gate-lookahead, ondemand (no prefetch), random, oracle (a first "
            "pass learns the routing), or any other `stmoe eval` predictor."
        ),
    ] = "stmoe",
    tables: Annotated[
        Path | None,
        typer.Option(
            help="Profiled tables (`stmoe profile`) for table predictors. Default: "
            "those shipped with the default model."
        ),
    ] = None,
    policy: Annotated[
        str,
        typer.Option(
            help="Eviction: lru (never evicting an expert predicted for the coming layer; "
            "'predicted' is its former name), lfu, or none (no reuse: plain on-demand "
            "offloading). See stmoe.cache_policy."
        ),
    ] = "lru",
    max_loads: Annotated[
        int | None,
        typer.Option(
            help="Loads one prediction may start per layer (its most confident "
            "experts not yet cached). Default: the capacity.",
            min=0,
        ),
    ] = None,
    lookahead: Annotated[
        str,
        typer.Option(
            help="Gate lookahead of hybrid and gate-lookahead: late (the next layer's "
            "router on its own input, predicted as that layer starts: closer to the "
            "router, less time to load), early (on this layer's MoE input, predicted as "
            "this layer routes), or auto (late where the model's norms are recognised)."
        ),
    ] = "auto",
    tier: Annotated[
        str,
        typer.Option(
            help="disk (real reads, page cache bypassed), emulated (host memory "
            "behind a link of --bandwidth and --latency; EMULATED), or gpu (pinned "
            "host memory to a CUDA cache)."
        ),
    ] = "disk",
    bandwidth: Annotated[
        str | None, typer.Option(help="Emulated link bandwidth in bytes/s, e.g. 200MB.")
    ] = None,
    latency: Annotated[
        str, typer.Option(help="Emulated link latency per transfer, e.g. 50us or 2ms.")
    ] = "0",
    workers: Annotated[
        int | None,
        typer.Option(
            help="Prefetch worker threads (default: 2 for disk, 1 for the "
            "single-link emulated and gpu tiers).",
            min=0,
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch compute threads (default: torch's). One leaves a core to the "
            "prefetch workers on small machines.",
            min=1,
        ),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the measurements (and tokens) as JSON.")
    ] = None,
) -> None:
    """Generate greedily with the model's routed experts offloaded, and measure it.

    Experts live in an expert store; a bounded per-layer cache holds some in
    memory and the predictor loads the next layer's experts while the current
    layer computes. Output tokens are bit-identical to the resident model's.
    Prints the text, then decode tokens/s, time to first token, hit rate,
    prefetch recall and precision, bytes moved and wasted, and stall share.
    """
    try:
        import torch

        from stmoe.runtime.api import offload
        from stmoe.runtime.tiers import parse_seconds
    except ImportError as exc:
        raise StmoeError(f"generate needs torch and transformers ({exc}); install them with "
                         "pip install -e '.[hf]'") from None  # fmt: skip
    if model is None:
        from stmoe.models import SHIPPED_MODEL

        model = SHIPPED_MODEL
    if threads is not None:
        torch.set_num_threads(threads)
    with offload(model, store, capacity=capacity, predictor=predictor, tables=tables,
                 policy=policy, tier=tier, bandwidth=bandwidth, latency=parse_seconds(latency),
                 workers=workers, max_loads=max_loads, lookahead=lookahead) as om:  # fmt: skip
        result = om.generate(prompt, max_new_tokens=max_new_tokens)
    out.print(prompt + result.text, markup=False)
    c = result.config
    tier_label = c["tier"] + (" (EMULATED)" if c["emulated"] else "")
    rows = [
        ("tier", tier_label),
        ("cache", f"{c['capacity']} of {c['num_experts']} experts per layer "
                  f"({c['cache_bytes'] / 2**20:.1f} MiB), policy {c['policy']}"),
        ("predictor", f"{c['predictor']} (at most {c['max_loads']} loads per prediction"
                      + (f", {c['lookahead']} gate lookahead)" if c["lookahead"] else ")")),
        ("tokens", f"{result.prompt_tokens} prompt + {len(result.tokens)} generated"),
        ("time to first token", f"{result.ttft_s * 1000:.1f} ms"),
        ("decode", f"{result.decode_tokens_per_s:.1f} tokens/s"),
        ("hit rate (decode)", f"{result.hit_rate:.3f}"),
        ("prefetch recall / precision", f"{result.prefetch_recall:.3f} / "
                                        f"{result.prefetch_precision:.3f}"),
        ("bytes moved / wasted", f"{result.bytes_moved / 2**20:.1f} / "
                                 f"{result.bytes_wasted / 2**20:.1f} MiB"),
        ("stall (decode)", f"{result.stall_s:.3f} s = {result.stall_share:.1%} of decode time"),
    ]  # fmt: skip
    out.print(key_value_table("offloaded generation", rows))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        out.print(f"wrote {json_out}")
