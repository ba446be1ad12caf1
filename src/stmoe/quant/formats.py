"""The weight formats an expert store (and a model quantized in memory) may hold.

A format is the user's choice and is named in every output that ran with it: ``native``
keeps the checkpoint's own dtype (bf16 for real checkpoints; lossless), ``int8`` and
``int4`` are weight-only quantizations (lossy; their quality is measured by
``benchmarks/bench_quality.py`` and published in docs/benchmarks.md). Importable without
torch: the store's index reads and checks a format before any tensor exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stmoe.errors import OffloadError

NAMES = ("native", "int8", "int4")
ALIASES = {"bf16": "native", "bfloat16": "native"}  # the checkpoint's own dtype, by its usual name
GROUP_SIZES = (32, 64, 128, 256)  # the ones torch's int4 CPU kernel takes
# weights per int4 scale/zero pair when none is given: the first of these that divides every
# expert matrix's input width (128: torchao's default; 32: llama.cpp's Q4_0 block)
AUTO_GROUP_SIZES = (128, 64, 32)
# rows per packed block of each CPU layout of torch's int4 packing, named as torch names the
# CPU capability that writes it: an int4 store records which one packed it (int4_layout.py)
INT4_LAYOUTS = {"avx512": 64, "avx2": 32, "default": 32}
LAYOUT_KEY = "int4_layout"  # where a store's index records it (version 6, int4 only)


@dataclass(frozen=True)
class WeightFormat:
    """How each expert matrix is stored and computed.

    name: native (the checkpoint's dtype), int8 (symmetric, one scale per output row) or
        int4 (asymmetric, one scale and zero per ``group_size`` input weights of a row).
    group_size: int4 only (None otherwise; for int4, None until ``resolved`` against the
        model's matrices: the largest of 128, 64, 32 that divides them all).
    """

    name: str = "native"
    group_size: int | None = None

    @property
    def quantized(self) -> bool:
        return self.name != "native"

    @property
    def label(self) -> str:
        """How every report names it."""
        if self.name == "int4":
            groups = self.group_size or "a size chosen for the model"
            return f"int4 (groups of {groups}, lossy)"
        if self.name == "int8":
            return "int8 (per output channel, lossy)"
        return "native (the checkpoint's dtype, lossless)"

    @property
    def short(self) -> str:
        """A name for folders and table cells: native, int8, int4g128 (int4: size unchosen)."""
        return f"int4g{self.group_size}" if self.group_size else self.name

    @property
    def pack_options(self) -> str:
        """The ``stmoe pack`` options that write this format (hints in refusals)."""
        size = f" --group-size {self.group_size}" if self.group_size else ""
        return f"--format {self.name}{size}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "group_size": self.group_size}

    def accepts(self, held: WeightFormat) -> bool:
        """Whether a store (or model) holding ``held`` is what this request asks for (an
        int4 request without a group size takes any)."""
        if self.name == "int4" and self.group_size is None:
            return held.name == "int4"
        return held == self

    def resolved(self, widths: list[int]) -> WeightFormat:
        """This format with int4's group size chosen for matrices of input ``widths``."""
        if self.name != "int4" or self.group_size is not None:
            return self
        size = next((g for g in AUTO_GROUP_SIZES if all(w % g == 0 for w in widths)),
                    AUTO_GROUP_SIZES[0])  # none divides: the kernel's refusal names the matrix
        return WeightFormat("int4", size)


NATIVE = WeightFormat()


def parse_format(name: str | WeightFormat | None, group_size: int | None = None) -> WeightFormat:
    """A format from its name (native, bf16, int8, int4) and, for int4, its group size
    (None: chosen for the model, ``WeightFormat.resolved``); anything else is refused with
    the choices."""
    if isinstance(name, WeightFormat):
        return name
    key = ALIASES.get(str(name or "native").lower(), str(name or "native").lower())
    if key not in NAMES:
        raise OffloadError(f"weight format {name!r} is not one of {', '.join(NAMES)} "
                           "(bf16 = native)")
    if key != "int4":
        if group_size is not None:
            raise OffloadError(f"a group size is for int4 only, not {key}")
        return WeightFormat(key)
    if group_size is None:
        return WeightFormat("int4")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or \
            group_size not in GROUP_SIZES:
        raise OffloadError(f"int4 group size {group_size!r}: expected one of "
                           f"{', '.join(map(str, GROUP_SIZES))} (torch's int4 CPU kernel)")
    return WeightFormat("int4", group_size)


def format_from_json(value: Any, where: str) -> WeightFormat:
    """A format read from a file (a store's index), checked; ``where`` names the file."""
    if not isinstance(value, dict) or set(value) != {"name", "group_size"}:
        raise OffloadError(f"{where}: weights: expected {{\"name\", \"group_size\"}}")
    try:
        fmt = parse_format(value["name"] if isinstance(value["name"], str) else repr(value["name"]),
                           value["group_size"])
    except OffloadError as exc:
        raise OffloadError(f"{where}: weights: {exc}") from None
    if fmt.name != value["name"]:  # an alias is for people, a file names the format itself
        raise OffloadError(f"{where}: weights: name {value['name']!r}, expected one of "
                           f"{', '.join(NAMES)}")
    if fmt.name == "int4" and fmt.group_size is None:
        raise OffloadError(f"{where}: weights: int4 without its group size")
    return fmt


def stored_format(index: dict[str, Any]) -> tuple[WeightFormat, str | None]:
    """A store index's format (``weights``, native before version 4) and, int4 only, the
    CPU layout that packed it (``LAYOUT_KEY``, from version 6; None before: unrecorded).
    An OffloadError reads ``FIELD: PROBLEM``."""
    weights = NATIVE
    if "weights" in index:
        try:
            weights = format_from_json(index["weights"], "top level")
        except OffloadError as exc:
            raise OffloadError(str(exc).removeprefix("top level: ")) from None
    layout = index.get(LAYOUT_KEY)
    if (LAYOUT_KEY in index) != (index["version"] >= 6 and weights.name == "int4") or \
            (layout is not None and layout not in tuple(INT4_LAYOUTS)):
        raise OffloadError(f"{LAYOUT_KEY}: {str(layout)[:20]!r}, expected one of "
                           f"{', '.join(INT4_LAYOUTS)} in a version 6 int4 store, none in others")
    return weights, layout
