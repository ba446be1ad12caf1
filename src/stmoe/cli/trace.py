"""Trace commands: import, info, synth, export."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.table import Table

from stmoe.cli.common import (
    JSON_HELP,
    check_inputs,
    check_range,
    clean_label,
    json_to_stdout,
    key_value_table,
    npz_output,
    out,
    path_argument,
    path_option,
    write_json,
)
from stmoe.errors import StmoeNote
from stmoe.trace import (
    FORMATS,
    SynthSpec,
    import_files,
    load_trace,
    save_trace,
    summarize,
    synthesize,
)
from stmoe.trace.engines import EngineOptions
from stmoe.trace.export import EXPORT_FORMATS, export_losses, export_trace

_SPEC = SynthSpec()


def import_cmd(
    sources: Annotated[
        list[Path], path_argument(help="Trace files to import; several become one trace.")
    ],
    output: Annotated[Path, path_option("--output", "-o", help="Native .npz trace to write.")],
    format: Annotated[
        str,
        typer.Option(help=f"Input format, one of {', '.join(FORMATS)}; auto looks at the content."),
    ] = "auto",
    domain: Annotated[
        str | None,
        typer.Option(help="Domain/task label for sequences whose file carries none."),
    ] = None,
    num_experts: Annotated[
        int | None,
        typer.Option(
            help="Routed experts per layer (N); inferred as max id + 1 when a file lacks it."
        ),
    ] = None,
    seq_starts: Annotated[
        str | None,
        typer.Option(
            help="npy input: first token of each sequence, as '0,120,300' or a file "
            "(.npy or text). Default: a side file SRC.seq_starts.npy/.txt, else one sequence."
        ),
    ] = None,
    model: Annotated[str | None, typer.Option(help="Model name to record in the metadata.")] = None,
    prompt_lengths: Annotated[
        str | None,
        typer.Option(
            help="Prompt length of each sequence, in file order, as '512,300,77': tokens at "
            "positions >= P are decode. Default: the file's own (JSON responses), else none."
        ),
    ] = None,
    layers: Annotated[
        int | None,
        typer.Option(help="SGLang response: model layers per token (num_hidden_layers)."),
    ] = None,
    top_k: Annotated[
        int | None,
        typer.Option(
            help="SGLang response, transformers router logits: experts per token "
            "(num_experts_per_tok)."
        ),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(help="Bare array axis order: tlk ([T, L, K], default) or ltk."),
    ] = None,
    moe_layers: Annotated[
        str | None,
        typer.Option(
            help="Model layers that route, as '1-23' or '0,2,4-7'; the others are dropped. "
            "Default: drop layers that hold only the fill value (dense layers)."
        ),
    ] = None,
    drop_partial: Annotated[
        bool,
        typer.Option(
            help="When only some inputs carry gate weights or token ids, drop them "
            "from the result instead of failing."
        ),
    ] = False,
) -> None:
    """Convert routing traces into stmoe's native file.

    Reads npy, JSON Lines, routes JSON and npz, and what serving engines hand out:
    vLLM (routed_experts arrays and completions responses, routing profiles), SGLang
    (/generate responses, expert-distribution recorder dumps), transformers router
    logits (torch.save) and MoE-Infinity expert-drop traces; docs/trace-format.md
    says how to make each engine write them. Every file is validated: a malformed
    input stops the import with one error that names the file, the position and
    what was expected.
    """
    check_inputs("a trace file", sources)
    npz_output(output)
    for option, value in (("--num-experts", num_experts), ("--layers", layers), ("--top-k", top_k)):
        check_range(option, value, 1)
    engine = EngineOptions.parse(prompt_lengths, layers, top_k, layout, moe_layers)
    trace = import_files(
        sources,
        format=format,
        domain=domain,
        num_experts=num_experts,
        seq_starts=seq_starts,
        model=model,
        drop_partial=drop_partial,
        engine=engine,
    )
    save_trace(trace, output)  # the importer's notes print after this (cli.common.friendly)
    out.print(f"wrote {clean_label(output)}: {clean_label(repr(trace))}")


def info_cmd(
    trace_path: Annotated[Path, path_argument(metavar="TRACE", help="Any supported trace file.")],
    json_out: Annotated[Path | None, path_option("--json", help=JSON_HELP)] = None,
) -> None:
    """Describe a trace: model, shape, sequences, domains and expert load balance.

    Prints the model, the shape (T tokens, L MoE layers, top-K of N experts), the
    sequences, tokens per domain, prefill/decode counts and each layer's expert load
    balance (max/mean tokens per expert). --json keys are a stable contract.
    """
    check_inputs("a trace file", trace_path)
    json_to_stdout(json_out)
    summary = summarize(load_trace(trace_path, mmap=True))
    if write_json(summary, json_out):
        return
    balance = np.asarray(summary["load_balance_max_over_mean"])
    rows = [
        ("model", summary["model"] + ("  [SYNTHETIC]" if summary["synthetic"] else "")),
        ("source", summary["source"]),
        (
            "shape",
            f"T={summary['tokens']} tokens, L={summary['layers']} MoE layers, "
            f"K={summary['top_k']}, N={summary['num_experts']} experts",
        ),
        ("sequences", summary["sequences"]),
        ("prefill / decode", f"{summary['prefill_tokens']} / {summary['decode_tokens']}"),
        ("gate weights", "yes" if summary["has_weights"] else "no"),
        ("rank order", "the router's" if summary["rank_order"] else
         "not kept by the source: each row is a set"),
        ("empty slots", summary["empty_slots"]),
        (
            "load max/mean",
            f"min {balance.min():.2f}, median {np.median(balance):.2f}, "
            f"max {balance.max():.2f} (layer {int(balance.argmax())})",
        ),
    ]
    out.print(key_value_table(str(trace_path), rows))
    table = Table(
        "domain", "sequences", "tokens", "decode tokens", title="per domain", title_justify="left"
    )
    for name, d in summary["domains"].items():
        table.add_row(clean_label(name), str(d["sequences"]), str(d["tokens"]),
                      str(d["decode_tokens"]))
    out.print(table)


def synth_cmd(
    output: Annotated[Path, path_option("--output", "-o", help="Native .npz trace to write.")],
    tokens: Annotated[int | None, typer.Option(help=f"Tokens T. (default: {_SPEC.tokens})")] = None,
    layers: Annotated[
        int | None, typer.Option(help=f"MoE layers L. (default: {_SPEC.layers})")
    ] = None,
    experts: Annotated[
        int | None, typer.Option(help=f"Experts N. (default: {_SPEC.experts})")
    ] = None,
    top_k: Annotated[int | None, typer.Option(help=f"Top-K. (default: {_SPEC.top_k})")] = None,
    sequences: Annotated[
        int | None, typer.Option(help=f"Sequences S. (default: {_SPEC.sequences})")
    ] = None,
    spatial: Annotated[
        float | None,
        typer.Option(
            help="Cross-layer concentration 0..1 (0 = independent layers). "
            f"(default: {_SPEC.spatial})"
        ),
    ] = None,
    temporal: Annotated[
        float | None,
        typer.Option(
            help="Probability of reusing each previous-token expert, 0..1. "
            f"(default: {_SPEC.temporal})"
        ),
    ] = None,
    domains: Annotated[
        int | None,
        typer.Option(help=f"Domains, each with its own routing. (default: {_SPEC.domains})"),
    ] = None,
    skew: Annotated[
        float | None,
        typer.Option(help=f"Zipf exponent of expert load, 0 = uniform. (default: {_SPEC.skew})"),
    ] = None,
    seed: Annotated[int | None, typer.Option(help=f"Random seed. (default: {_SPEC.seed})")] = None,
) -> None:
    """Generate a SYNTHETIC routing trace with controllable spatial and temporal correlation.

    For tests and benchmarks; its metadata marks it synthetic.
    """
    given = {k: v for k, v in locals().items() if k != "output" and v is not None}
    npz_output(output)
    trace = synthesize(dataclasses.replace(_SPEC, **given))
    save_trace(trace, output)
    out.print(f"wrote {clean_label(output)}: SYNTHETIC {clean_label(repr(trace))}")


def export_cmd(
    trace_path: Annotated[Path, path_argument(metavar="TRACE", help="Any supported trace file.")],
    output: Annotated[Path, path_option("--output", "-o", help="File to write.")],
    format: Annotated[str, typer.Option(help=f"One of {', '.join(EXPORT_FORMATS)}.")] = "jsonl",
) -> None:
    """Write a trace in a foreign format for tools that don't read stmoe's file.

    jsonl: one record per (token, layer) with weights, phase and domain (lossless
    but for metadata). npy: the raw [T, L, K] expert ids plus a .seq_starts.npy
    side file and a .manifest.json binding the two. vllm: a vLLM completions response
    (choices[].routed_experts). sglang: an SGLang /generate response, or a batch's
    list (stmoe import reads it back as it is: its own stmoe_moe_layers give L).
    """
    check_inputs("a trace file", trace_path)
    trace = load_trace(trace_path)
    path = export_trace(trace, output, format)
    out.print(f"wrote {clean_label(path)}")
    lost = export_losses(trace, format)
    if lost:  # (a note, shown as every command's are)
        warnings.warn(f"the {format} file does not keep {'; '.join(lost)}", StmoeNote,
                      stacklevel=2)
