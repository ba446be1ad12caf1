"""``stmoe split-capacity``: each MoE layer's cache size from held-out routing, the same total
(``stmoe.evaluate.layer_capacity``), printed as the counts ``--capacity`` takes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stmoe.cache_policy import REPLAY, RUNTIME, policy_code
from stmoe.cli.common import check_inputs, check_range, err, out, path_argument
from stmoe.errors import StmoeError
from stmoe.evaluate.layer_capacity import size_split
from stmoe.predictors import names
from stmoe.trace import import_files
from stmoe.trace.select import select_layers
from stmoe.util.progress import byte_progress
from stmoe.util.units import capacity_per_layer


def split_capacity_cmd(
    traces: Annotated[list[Path], path_argument(
        metavar="TRACE...", help="Routing of the model (`stmoe capture`, or any format "
        "`stmoe import` reads): several sequences, or one long one.")],
    capacity: Annotated[str, typer.Option(
        help="The cache to split: experts per layer (30) or a share of them (50%), the same "
        "total over every layer.")] = "50%",
    predictor: Annotated[str, typer.Option(
        help="The predictor the runtime will prefetch with.")] = "stmoe-plus",
    policy: Annotated[str, typer.Option(
        help="The runtime's cache policy: lru, lfu or score.")
    ] = "lru",
    layers: Annotated[str | None, typer.Option(
        help="MoE layers N (the first N) or A:B only, as `stmoe profile --layers`: for a "
        "model of those layers.")] = None,
    folds: Annotated[int, typer.Option(
        help="Parts of the sequences, each replayed with tables of the others.")] = 5,
) -> None:
    """Size each MoE layer's expert cache from held-out hit-rate curves, the same total.

    A layer whose experts the predictor names well needs few slots beyond its prefetch
    set, one it cannot (the first layers, say) needs many. Measured so far: more hits in
    the cache replay (+0.02 to +0.04 for stmoe-plus on Qwen1.5's held-out prompts), none
    yet on the runtime, whose admission and prompt loads the curves leave out
    (docs/benchmarks.md): try it against one size on your own routing.

    The curves of each layer's hits against its cache size come from the traces'
    sequences, each replayed with tables profiled on the others (held out; a trace of one
    sequence: its decode tail from 60% of its tokens on, or from its first generated token if
    later, with tables of the tokens before); the split
    spends the total where they rise most per slot. Prints the counts, one per MoE layer,
    for `--capacity` of `stmoe generate` and `stmoe serve` (or
    `stmoe.offload(capacity=...)`); the hit rates on stderr are those of the curves the
    split was fitted to, an estimate that favours it.
    """
    check_inputs("a trace file", traces)
    check_range("--folds", folds, 2)
    if predictor not in names():
        raise StmoeError(f"unknown predictor {predictor!r}; choose from {', '.join(names())}")
    policy_code(policy, REPLAY, StmoeError)  # (and the runtime's: not belady)
    policy_code(policy, RUNTIME, StmoeError)
    trace = import_files(traces)
    if layers is not None:
        trace = select_layers(trace, layers)
    uniform = capacity_per_layer(capacity, trace.num_experts, trace.top_k,
                                 forms=("count", "share"), name="--capacity", error=StmoeError)
    with byte_progress(min(folds, trace.num_sequences), "replaying held-out parts",
                       in_bytes=False) as advance:
        split = size_split(trace, uniform, predictor, policy, folds,
                           lambda done, of: advance(1))
    total = uniform * trace.num_layers
    err.print(f"{uniform} of {trace.num_experts} experts a layer over {trace.num_layers} MoE "
              f"layers ({total} slots), split for {predictor} with {policy} eviction; curves "
              f"from {_parts(split.folds, trace.num_sequences)}"
              f"{' (SYNTHETIC)' if trace.meta.synthetic else ''}: hit rate "
              f"{split.uniform_hit_rate:.3f} -> {split.hit_rate:.3f} on them (fitted to "
              "them: an estimate that favours the split)", soft_wrap=True)
    out.print(",".join(map(str, split.capacities)))


def _parts(folds: int, sequences: int) -> str:
    if sequences == 1:
        return ("its one sequence's decode tail (from 60% of its tokens, or its first generated "
                "one if later) replayed with tables of the tokens before")
    return f"{folds} held-out parts of {sequences} sequences"
