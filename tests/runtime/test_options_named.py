"""Every field of ``OffloadOptions`` is named where a user looks for the options:
``stmoe.offload``'s docstring and docs/runtime.md's list (both had fallen five fields
behind the dataclass)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

from stmoe.runtime.api import offload
from stmoe.runtime.options import OffloadOptions

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def _listed(text: str, start: str) -> set[str]:
    """The comma-separated names in the parentheses after ``start``."""
    flat = " ".join(text.split())
    m = re.search(re.escape(start) + r"[^(]*\(([^)]*)\)", flat)
    assert m, f"no list after {start!r}"
    return {name.strip() for name in m.group(1).split(",")}


def test_every_offload_option_is_named_in_the_docstring_and_the_docs():
    fields = {f.name for f in dataclasses.fields(OffloadOptions)}
    doc = " ".join((offload.__doc__ or "").split())
    named = {n.strip(" .") for n in doc.split("The fields:")[1].split("(")[0].split(",")}
    assert named == fields
    assert _listed(DOC.read_text(), "The options are the fields of") == fields
