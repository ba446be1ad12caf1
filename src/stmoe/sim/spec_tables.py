"""Where a simulator spec's values come from: a preset in ``sim/data/*.toml`` (each
number with its source), or a user's own TOML file with the same keys, named by its
path whatever it ends with (``specs`` checks the values)."""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from stmoe.errors import StmoeError


class SpecError(StmoeError, ValueError):
    """A model or hardware spec is unknown or malformed."""


def presets(kind: str) -> dict[str, Any]:
    """The shipped presets of ``kind`` ("models" or "hardware"), by name."""
    return tomllib.loads(resources.files("stmoe.sim").joinpath(f"data/{kind}.toml").read_text())


def preset_names(kind: str) -> list[str]:
    """The preset names of ``kind`` ("models" or "hardware")."""
    return list(presets(kind))


def spec_table(kind: str, name_or_path: str) -> tuple[str, dict[str, Any]]:
    """A preset's or a spec file's name and TOML table, unchecked; a clear SpecError if
    neither. A spec file: a .toml name, or (not a preset's name) a path or a file that is
    there, whatever it ends with; named by its stem."""
    shipped = presets(kind)
    if name_or_path.endswith(".toml") or (name_or_path not in shipped and (
            "/" in name_or_path or os.sep in name_or_path or Path(name_or_path).is_file())):
        path = Path(name_or_path)
        try:
            return path.stem, tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise SpecError(f"{path}: no such {kind} spec file") from None
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:  # or a folder
            raise SpecError(f"{path}: not valid TOML for a {kind} spec ({exc})") from None
    if name_or_path not in shipped:
        listed = ", ".join(shipped)
        raise SpecError(f"unknown {kind.rstrip('s')} {name_or_path!r}; presets: {listed} "
                        "(or give a .toml file)")
    return name_or_path, shipped[name_or_path]
