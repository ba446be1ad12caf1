"""`stmoe generate`: generate text with the experts offloaded, and measure it."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from stmoe.cli.common import (
    check_inputs,
    check_range,
    json_to_stdout,
    key_value_table,
    out,
    path_option,
    plain_label,
    print_json,
    write_json,
)
from stmoe.cli.generate_report import rows, summary
from stmoe.cli.help_panels import MODEL, OUTPUT
from stmoe.cli.offload_options import (
    AdmissionOpt,
    BandwidthOpt,
    CapacityOpt,
    FormatOpt,
    GroupSizeOpt,
    InPlaceOpt,
    LatencyOpt,
    LookaheadOpt,
    MaxLoadsOpt,
    MemoryOpt,
    ModelOpt,
    PolicyOpt,
    PredictorOpt,
    QuantizeResidentOpt,
    StoreOpt,
    TablesOpt,
    ThreadsOpt,
    TierOpt,
    WorkersOpt,
    checked_model,
    offload_for,
)
from stmoe.errors import StmoeError, StmoeNote, TraceError
from stmoe.runtime.options import OffloadOptions
from stmoe.runtime.warm_up import warm_up

if TYPE_CHECKING:
    from stmoe.runtime.api import OffloadedModel
    from stmoe.trace import RoutingTrace

_DEFAULT = OffloadOptions()  # the one place the offload defaults are written


def generate_cmd(
    prompt: Annotated[
        str | None, typer.Option(help="The prompt (or --routing).", rich_help_panel=MODEL)
    ] = None,
    model: ModelOpt = None,
    store: StoreOpt = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(help="Tokens to generate (>= 1). Default: 32; with --routing the "
                     "sequence's decode tokens + 1.", rich_help_panel=MODEL),
    ] = None,
    routing: Annotated[
        Path | None,
        path_option(help="Replay a trace's routing (any `stmoe import` format) in place of "
                    "the router, e.g. on a `stmoe make-model` checkpoint (the text is then "
                    "meaningless: not shown).", rich_help_panel=MODEL),
    ] = None,
    sequence: Annotated[
        int, typer.Option(help="Which sequence of --routing (0 = first).",
                          rich_help_panel=MODEL)
    ] = 0,
    layers: Annotated[
        str | None,
        typer.Option(help="The trace's layers replayed: N (the first N) or A:B, as many as "
                     "the model has. Default: its first.", rich_help_panel=MODEL),
    ] = None,
    capacity: CapacityOpt = None,
    memory: MemoryOpt = None,
    predictor: PredictorOpt = _DEFAULT.predictor,
    tables: TablesOpt = _DEFAULT.tables,
    policy: PolicyOpt = _DEFAULT.policy,
    max_loads: MaxLoadsOpt = _DEFAULT.max_loads,
    lookahead: LookaheadOpt = _DEFAULT.lookahead,
    admission: AdmissionOpt = _DEFAULT.admission,
    tier: TierOpt = _DEFAULT.tier,
    bandwidth: BandwidthOpt = _DEFAULT.bandwidth,
    latency: LatencyOpt = f"{_DEFAULT.latency:g}",
    workers: WorkersOpt = _DEFAULT.workers,
    threads: ThreadsOpt = None,
    weights: FormatOpt = _DEFAULT.format,
    group_size: GroupSizeOpt = _DEFAULT.group_size,
    in_place: InPlaceOpt = _DEFAULT.in_place,
    quantize_resident: QuantizeResidentOpt = _DEFAULT.quantize_resident,
    repeat: Annotated[
        int,
        typer.Option(help="Runs (1 to 1000), each from an empty cache: median [min, max].",
                     rich_help_panel=OUTPUT),
    ] = 1,
    json_out: Annotated[
        Path | None,
        path_option("--json", help="Write the measurements and tokens as JSON ('-': on "
                    "stdout, instead of the text and tables).", rich_help_panel=OUTPUT),
    ] = None,
) -> None:
    """Generate greedily with the model's routed experts offloaded, and measure it.

    A per-layer cache holds some experts; the predictor loads the next layer's while
    a layer computes. Tokens are bit-identical to the resident model's. Prints the
    text, then speed, time to first token, hit rate, recall, bytes and stall share
    (the predictor's kernels compiled before the timed run).
    """
    _check_generate_options(max_new_tokens, max_loads, workers, threads)
    check_range("--repeat", repeat, 1, 1000)
    check_range("--sequence", sequence, 0)
    check_inputs("a tables file (write one with `stmoe profile`)", tables)
    check_inputs("a routing trace", routing)
    if (prompt is None) == (routing is None):
        raise StmoeError("give either --prompt (generate from text) or --routing (replay a "
                         "trace's routing), not both" if prompt is not None
                         else "give --prompt TEXT, or --routing TRACE to replay a trace's "
                         "routing")
    if layers is not None and routing is None:
        raise StmoeError("--layers applies to --routing (which of the trace's layers to replay)")
    if sequence != 0 and routing is None:
        raise StmoeError("--sequence applies to --routing (which of the trace's sequences to "
                         "replay)")
    model = checked_model(model, capacity, memory)
    to_stdout = json_to_stdout(json_out)
    with offload_for("generate", model, store, capacity, threads, memory=memory,
                     predictor=predictor, tables=tables, policy=policy, tier=tier,
                     bandwidth=bandwidth, latency=latency, workers=workers,
                     max_loads=max_loads, lookahead=lookahead, admission=admission,
                     format=weights, group_size=group_size, in_place=in_place,
                     quantize_resident=quantize_resident) as om:
        compiled = warm_up(om)  # outside the timer: numba's first calls compile or load
        random_weights = bool(getattr(om.model.config, "stmoe_random_weights", False))
        replayed, profiled = None, None
        if routing is not None:
            run, replayed = _replay(om, routing, sequence, max_new_tokens, layers)
            if tables is not None:  # profiled on these layers of the model (before any run)
                from stmoe.predictors import load_tables

                profiled = load_tables(tables)
                profiled.check_trace(replayed)
        else:
            assert prompt is not None
            run = functools.partial(om.generate, prompt, max_new_tokens=max_new_tokens or 32)
        runs = [run() for _ in range(repeat)]  # each cold: the same measurement N times
    for i, r in enumerate(runs[1:], 2):
        if r.tokens != runs[0].tokens:  # lossless offloading gives the same tokens every run
            raise StmoeError(f"run {i} generated other tokens than run 1; the offloaded "
                             "output must not change between runs")
    synthetic = replayed is not None and replayed.meta.synthetic
    if replayed is not None and profiled is not None:  # (once the runs succeeded: no note
        from stmoe.cli.table_notes import note_tables  # before a refusal)

        note_tables(replayed, profiled)
    data = summary(runs)
    data["warm_up_s"] = compiled
    data["random_weights"], data["synthetic_routing"] = random_weights, synthetic
    if to_stdout:
        print_json(data)
        return
    if random_weights:
        out.print("the model's weights are RANDOM (`stmoe make-model`): its text means nothing; "
                  "the speeds and the offloaded bits are the runtime's", markup=False)
    if routing is not None:
        out.print(f"replayed the {'SYNTHETIC ' if synthetic else ''}routing of "
                  f"{plain_label(str(routing))}, sequence {sequence} (the generated text is "
                  "meaningless: not shown)", markup=False)
    else:  # unwrapped (soft_wrap): copied code keeps its lines
        out.print(plain_label((prompt or "") + runs[0].text, multiline=True), markup=False,
                  soft_wrap=True)
    out.print(key_value_table("offloaded generation", rows(runs)))
    out.print("a single run: speed figures swing between runs on a shared machine; "
              "--repeat N reports their median and [min, max]" if repeat == 1 else
              f"median [min, max] of {repeat} runs, each from an empty cache; the same "
              "tokens in every run", markup=False)
    out.print(f"before timing: the predictor's and the cache's kernels compiled or loaded "
              f"({compiled:.1f} s; compiled once per install, then loaded from numba's cache)",
              markup=False)
    write_json(data, json_out)


def _replay(om: OffloadedModel, routing: Path, sequence: int, max_new_tokens: int | None,
            layers: str | None = None) -> tuple[Callable[[], Any], RoutingTrace]:
    """One replay of the trace's sequence (its ``layers``) through the offloaded model
    (``OffloadedModel.force_routing``), as a call to repeat, and the routing it replays (that
    sequence, the model's layers of it)."""
    from stmoe.runtime.forced_routing import plan_routing
    from stmoe.trace import load_trace
    from stmoe.trace.select import first_layers, select_layers, select_sequences

    trace = load_trace(routing)
    c = om.config
    if layers is not None:
        try:
            trace = select_layers(trace, layers)
        except TraceError as exc:
            raise exc.in_file(routing) from None
        if trace.num_layers != c["num_layers"]:
            raise StmoeError(f"{routing}: --layers {layers}: {trace.num_layers} MoE layers of "
                             f"the trace for a model of {c['num_layers']}; give as many as "
                             "the model has")
    vocab = int(getattr(om.model.config, "vocab_size", 0) or 1)
    plan = plan_routing(trace, sequence, c["num_layers"], c["num_experts"], c["top_k"], vocab,
                        source=routing)
    if max_new_tokens is not None and max_new_tokens > plan.new_tokens:
        warnings.warn(f"{routing}: sequence {sequence} holds the routing of "
                      f"{plan.new_tokens} new tokens, so {plan.new_tokens} are generated, not "
                      f"--max-new-tokens {max_new_tokens}", StmoeNote, stacklevel=2)
    replayed = select_sequences(trace, [sequence])  # as the plan takes it: its first L layers
    if replayed.num_layers > c["num_layers"]:
        replayed = first_layers(replayed, c["num_layers"])
    return functools.partial(om.force_routing, plan, max_new_tokens), replayed


def _check_generate_options(max_new_tokens: int | None, max_loads: int | None, workers: int | None,
                            threads: int | None) -> None:
    """The numeric options, refused before the model loads."""
    check_range("--max-new-tokens", max_new_tokens, 1)
    check_range("--max-loads", max_loads, 0)
    check_range("--workers", workers, 0, 64)
    check_range("--threads", threads, 1, 1024)
