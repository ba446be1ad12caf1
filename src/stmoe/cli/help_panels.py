"""Options grouped under headings in `--help` (typer's ``rich_help_panel``), for commands
with many options (generate, serve).

The app prints plain help (``rich_markup_mode=None``: "[min, max]" stays as written),
where typer ignores panels; ``PanelCommand`` gives the plain help the same grouping:
one section per panel, in the order the panels first appear, options without one last.
"""

from __future__ import annotations

import click
from typer.core import TyperCommand

MODEL = "Model and input"
CACHE = "Cache and prefetching"
TIER = "Where experts are read from"
WEIGHTS = "Weights"
OUTPUT = "Output"
SERVER = "Server"


class PanelCommand(TyperCommand):
    """A command whose plain `--help` lists its options by panel."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        args: list[tuple[str, str]] = []
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append(record)
            else:
                panel = getattr(param, "rich_help_panel", None) or "Other options"
                panels.setdefault(panel, []).append(record)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        other = panels.pop("Other options", [])
        for name, records in [*panels.items(), *([("Other options", other)] if other else [])]:
            with formatter.section(name):
                formatter.write_dl(records)
