"""The ``stmoe`` command line: thin commands over the library (docs/architecture.md).

Each command parses its options, calls one library function, and prints or
saves. Bad input exits 1 with one line naming the file and position, and so does
an option's value outside its range (``error: --seed -1: expected an integer >= 0``;
NaN and infinity never pass); usage errors (an unknown option, a missing argument,
a value of the wrong type) exit 2. Whatever a file or the user named (models,
domains, paths) is printed as plain text: ``cli.common.clean_label``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from stmoe import __version__
from stmoe.cli import (
    analyze,
    calibrate,
    capture,
    demo,
    generate,
    make_model,
    pack,
    predict,
    quantize,
    serve,
    simulate,
    split_capacity,
    trace,
    train_tiny,
)
from stmoe.cli.common import friendly, out
from stmoe.cli.help_panels import PanelCommand

app = typer.Typer(
    help="ST-MoE expert prefetching for Mixture-of-Experts inference: routing traces, "
    "prediction, analysis, simulation and offloading. Run `stmoe COMMAND --help` for details.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    add_completion=False,
    # help texts are plain text: "[min, max]" and "[x>=1]" stay as written (rich markup
    # would take them for tags and drop them)
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        out.print(f"stmoe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """ST-MoE: predict which experts the next MoE layer needs and load them early."""


app.command("import")(friendly(trace.import_cmd))
app.command("info")(friendly(trace.info_cmd))
app.command("synth")(friendly(trace.synth_cmd))
app.command("export")(friendly(trace.export_cmd))
app.command("capture")(friendly(capture.capture_cmd))
app.command("profile")(friendly(predict.profile_cmd))
app.command("eval")(friendly(predict.eval_cmd))
app.command("split-capacity")(friendly(split_capacity.split_capacity_cmd))
app.command("simulate")(friendly(simulate.simulate_cmd))
app.command("analyze")(friendly(analyze.analyze_cmd))
app.command("demo")(friendly(demo.demo_cmd))
app.command("make-model")(friendly(make_model.make_model_cmd))
app.command("pack")(friendly(pack.pack_cmd))
app.command("quantize")(friendly(quantize.quantize_cmd))
app.command("generate", cls=PanelCommand)(friendly(generate.generate_cmd))
app.command("serve", cls=PanelCommand)(friendly(serve.serve_cmd))
app.command("calibrate")(friendly(calibrate.calibrate_cmd))
app.command("train-tiny")(friendly(train_tiny.train_tiny_cmd))


def main() -> None:
    app()
