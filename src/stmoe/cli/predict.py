"""Prediction commands: profile (Algorithm 1) and eval (replay of predictors)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

from stmoe.cache_policy import REPLAY, policy_code
from stmoe.cli.common import (
    check_inputs,
    check_range,
    clean_label,
    err,
    json_to_stdout,
    npz_output,
    out,
    path_argument,
    path_option,
    print_json,
    write_json,
)
from stmoe.cli.eval_tables import print_results
from stmoe.cli.table_notes import note_tables
from stmoe.errors import StmoeError, StmoeNote
from stmoe.evaluate.equal_size import equal_set_size
from stmoe.evaluate.replay import ReplayResult, cross_domain_matrix, replay
from stmoe.predictors import (
    REGISTRY,
    accepted_options,
    load_tables,
    names,
    names_for,
    profile,
    rank_readers,
    save_tables,
)
from stmoe.predictors.tables import ProfiledTables
from stmoe.trace import RoutingTrace, import_files, select_domain, split_auto
from stmoe.trace.ranks import is_ranked
from stmoe.trace.select import select_layers
from stmoe.util.units import capacity_per_layer

SplitOpt = Annotated[
    float | None,
    typer.Option(
        help="Use the first FRACTION (strictly between 0 and 1) of the trace for profiling "
        "and the rest for evaluation (by sequence when there are several, else by token). "
        "Give the same value to `profile` and `eval`.",
    ),
]
_NAMES = ", ".join(names())
DomainOpt = Annotated[str | None, typer.Option(help="Only the sequences of this domain.")]


def _select(
    trace: RoutingTrace, domain: str | None, split: float | None, part: int
) -> RoutingTrace:
    if domain is not None:
        trace = select_domain(trace, domain)
    if split is None:
        return trace
    parts = split_auto(trace, split)
    share = parts[0].num_tokens / trace.num_tokens
    if abs(share - split) > 0.05:  # several sequences split whole, not at the fraction asked
        warnings.warn(f"--split {split:g} splits the trace's {trace.num_sequences} sequences "
                      f"whole: the first part holds {parts[0].num_tokens} of its "
                      f"{trace.num_tokens} tokens ({share:.0%})", StmoeNote, stacklevel=2)
    return parts[part]


def profile_cmd(
    traces: Annotated[list[Path], path_argument(metavar="TRACE...", help="Traces of one model.")],
    output: Annotated[Path, path_option("--output", "-o", help="Tables file to write (.npz).")],
    row_width: Annotated[
        int | None, typer.Option(help="Candidates kept per CCT row (default: the model's top-k).")
    ] = None,
    split: SplitOpt = None,
    domain: DomainOpt = None,
    by_domain: Annotated[
        bool,
        typer.Option(help="Also keep tables of each domain (needed by stmoe-mix)."),
    ] = False,
    layers: Annotated[
        str | None,
        typer.Option(
            help="Profile MoE layers N (the first N) or A:B (layers A to B-1, a cut from the "
            "middle) only, renumbered from 0: for a model of those layers, e.g. `stmoe "
            "make-model --layers N`, replayed with `generate --routing --layers` alike."
        ),
    ] = None,
) -> None:
    """Build ST-MoE's tables from routing traces (docs/method.md Algorithm 1).

    Counts which experts of layer l+1 follow each expert of layer l and keeps the
    most frequent as the cross-layer correlation table, plus per-layer expert
    frequencies for the frequency baseline, the counts stmoe-plus and hybrid use
    (layer pairs up to 4 apart, consecutive tokens, the last 1,024 tokens) and their
    signal weights, fitted on the last fifth of the profiling tokens.
    """
    check_inputs("a trace file", traces)
    npz_output(output, "tables file")
    check_range("--split", split, 0, 1, exclusive=True)
    trace = _select(import_files(traces), domain, split, 0)
    if layers is not None:
        trace = select_layers(trace, layers)
    check_range("--row-width", row_width, 1, trace.num_experts,
                why=f"the trace has {trace.num_experts} experts per layer")
    tables = profile(trace, row_width=row_width, by_domain=by_domain)
    save_tables(tables, output)
    out.print(
        f"wrote {clean_label(output)}: CCT for {tables.shape.describe()}, row width "
        f"{tables.row_width}, profiled on {trace.num_tokens} tokens"
        + (" (SYNTHETIC)" if trace.meta.synthetic else "")
    )


def _default_predictors(trace: RoutingTrace, tables: ProfiledTables | None) -> list[str]:
    """Every predictor this trace and these tables can run, with a note naming the others
    and why (a default run never drops a predictor silently)."""
    chosen, notes = names_for(trace), []
    # each skipped predictor named once, with its own reason
    look = [n for n in names() if REGISTRY[n].uses_lookahead and n not in chosen]
    if tables is None:
        notes.append(("no --tables", [n for n in chosen if REGISTRY[n].needs_tables]))
        chosen = [n for n in chosen if not REGISTRY[n].needs_tables]
    notes.append(("the trace records no gate lookahead (`stmoe capture` of a transformers "
                  "model records it)", look))
    mix = [n for n in names() if REGISTRY[n].needs_domain_tables and n not in look]
    notes.append(("run it by name (--predictor stmoe-mix) with tables of `stmoe profile "
                  "--by-domain`", mix))
    if not is_ranked(trace):  # each reason once, with the predictors it keeps out
        by_reason: dict[str, list[str]] = {}
        for n in rank_readers():
            by_reason.setdefault(REGISTRY[n].needs_rank_order, []).append(n)
        notes += [(f"they read the router's rank order inside a row ({why}) and this trace's "
                   "rows are sets (rank_order: false; docs/trace-format.md)", skipped)
                  for why, skipped in by_reason.items()]
    for why, skipped in notes:
        if skipped:
            err.print(f"note: skipping {', '.join(skipped)}: {why}", markup=False,
                      soft_wrap=True)
    return chosen


def eval_cmd(
    trace_path: Annotated[Path, path_argument(metavar="TRACE", help="The trace to replay.")],
    tables_path: Annotated[
        Path | None, path_option("--tables", help="Tables from `stmoe profile`.")
    ] = None,
    predictor: Annotated[
        list[str] | None,
        typer.Option(
            help=f"Predictor to run (repeat for several; default: all). One of: {_NAMES}."
        ),
    ] = None,
    capacity: Annotated[
        str | None,
        typer.Option(help="Also replay a cache of C experts per layer: a count (top-k to the "
                     "trace's N) or a share of N (\"50%\"), as generate and serve take it."),
    ] = None,
    policy: Annotated[
        str, typer.Option(help="Cache eviction: lru, lfu, belady (the bound: the most hits "
                          "any eviction could make) or score (the predictor's lowest-scored "
                          "expert; predictors that score no expert run lru) "
                          "(stmoe.cache_policy).")
    ] = "lru",
    set_size: Annotated[
        int,
        typer.Option(
            help="Experts per prediction: predictors that rank experts (stmoe-plus, "
            "hybrid, frequency, random, gate-lookahead) predict this many (the mean "
            "with --adaptive); ST-MoE and its ablations, whose "
            "rules size their sets, are capped at it. 0: K, and no cap. At most the "
            "trace's N.",
        ),
    ] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the random baseline (>= 0).")] = 0,
    horizon: Annotated[
        int,
        typer.Option(
            help="Predict layer l+H (1 to 3) from layers <= l (stmoe-plus and hybrid; 1 "
            "for the others, which are skipped when H > 1).",
        ),
    ] = 1,
    adaptive: Annotated[
        bool,
        typer.Option(
            help="stmoe-plus and hybrid: size each set by one probability threshold "
            "(the experts most likely anywhere first), --set-size then being the "
            "mean set size."
        ),
    ] = False,
    lookahead: Annotated[
        str,
        typer.Option(
            help="Gate lookahead of hybrid and gate-lookahead: the trace's late one "
            "(lookahead_late), early one (lookahead), or auto (late where recorded)."
        ),
    ] = "auto",
    split: SplitOpt = None,
    domain: DomainOpt = None,
    cross_domain: Annotated[
        bool, typer.Option(help="Add a profile-on-A, evaluate-on-B recall matrix over domains "
                           "(of the first --predictor, else stmoe).")
    ] = False,
    json_out: Annotated[
        Path | None, path_option("--json", help="Write all results as JSON here ('-': stdout).")
    ] = None,
) -> None:
    """Replay predictors over a trace and compare them side by side.

    First, every predictor's recall at one set size, ST-MoE's own mean (recall grows
    with the experts a prediction names, so only equal sizes compare; left out with
    --set-size, --adaptive or --horizon). Then each predictor at its own set size:
    recall (the paper's prediction accuracy), precision and mean prefetch set size
    over decode tokens at layers 1..L-1 (docs/method.md), and with --capacity a
    cache replay's hit rate, experts moved per token, wasted loads and read
    amplification. The JSON adds per layer, per domain, decode vs prefill and
    recall-versus-budget figures.
    """
    check_inputs("a trace file", trace_path)
    json_to_stdout(json_out)
    check_range("--seed", seed, 0)
    check_range("--horizon", horizon, 1, 3)
    check_range("--split", split, 0, 1, exclusive=True)
    if lookahead not in ("auto", "early", "late"):
        raise StmoeError(f"--lookahead {clean_label(lookahead)}: expected auto, early or late")
    tables = load_tables(tables_path) if tables_path is not None else None  # before the trace
    whole = import_files([trace_path])
    trace = _select(whole, domain, split, 1)
    n = trace.meta.num_experts
    why = f"the trace has {n} experts per layer"
    slots = None if capacity is None else capacity_per_layer(
        capacity, n, trace.meta.top_k, forms=("count", "share"), name="--capacity",
        error=StmoeError)
    policy_code(policy, REPLAY, StmoeError)  # checked even where no --capacity uses it
    if capacity is None and policy != "lru":  # (it was ignored without a word)
        raise StmoeError(f"--policy {clean_label(policy)} is the cache replay's: give "
                         "--capacity C too")
    check_range("--set-size", set_size, 0, n, why=why)
    if tables is not None:
        note_tables(trace, tables)
    chosen = predictor or _default_predictors(trace, tables)
    options: dict[str, Any] = {"seed": seed}
    if set_size:
        options["set_size"] = set_size
        options["max_set_size"] = set_size
    if lookahead != "auto":
        if not any(REGISTRY[n].uses_lookahead for n in chosen if n in REGISTRY):
            raise StmoeError(f"--lookahead {lookahead}: none of {', '.join(chosen)} takes a gate "
                             "lookahead; use hybrid or gate-lookahead")
        options["lookahead"] = lookahead
    if adaptive:
        if not any("adaptive" in accepted_options(n) for n in chosen):
            raise StmoeError(f"--adaptive: none of {', '.join(chosen)} sizes its sets "
                             "adaptively; use stmoe-plus or hybrid")
        options["adaptive"] = True
    if horizon > 1:
        far = [n for n in chosen if "horizon" in accepted_options(n)]
        if not far:
            raise StmoeError(f"--horizon {horizon}: none of {', '.join(chosen)} predicts more "
                             "than one layer ahead; use stmoe-plus or hybrid")
        if len(far) < len(chosen):
            err.print(f"note: --horizon {horizon}, so skipping "
                      f"{', '.join(n for n in chosen if n not in far)}")
        chosen, options["horizon"] = far, horizon
    result = replay(trace, chosen, tables, options=options, capacity=slots, policy=policy)
    lru_instead = [n for n, r in result.results.items()
                   if policy == "score" and r.cache and r.cache.policy == "lru"]
    if lru_instead:
        which = (f"{lru_instead[0]} scores no expert, so its cache" if len(lru_instead) == 1
                 else f"{', '.join(lru_instead)} score no expert, so their caches")
        err.print(f"note: --policy score: {which} ran lru")
    if cross_domain:  # the first predictor named (else stmoe), as its label says
        _note_cross_domain(whole, trace, horizon)
        shared = {k: v for k, v in options.items() if k != "horizon"}
        result = ReplayResult(result.trace, result.results, cross_domain_matrix(
            trace, predictor[0] if predictor else "stmoe", **shared))
    data = result.to_dict()
    data["horizon"] = horizon
    if not (set_size or adaptive or horizon > 1):  # else the user chose the sets' sizes
        data["equal_set_size"] = equal_set_size(trace, data["predictors"], tables, options)
    if json_to_stdout(json_out):
        print_json(data)
        return
    print_results(data, trace)
    write_json(data, json_out)


def _note_cross_domain(whole: RoutingTrace, replayed: RoutingTrace, horizon: int) -> None:
    """What the matrix covers, where it is less than the trace: the domains of the part
    replayed (after --split and --domain), one layer ahead."""
    left = [d for d in dict.fromkeys(whole.domains) if d not in set(replayed.domains)]
    if left:
        err.print(f"note: --cross-domain covers the domains of the part replayed; "
                  f"{', '.join(map(clean_label, left))} left out by --split or --domain")
    if horizon > 1:
        err.print("note: the cross-domain matrix predicts one layer ahead (--horizon is not "
                  "applied to it)")
