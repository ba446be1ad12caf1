"""Helpers the text importers share: field checks, layer numbering, router rank order."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.schema import meta_int
from stmoe.util.shown import short_repr


def layer_numbering(layer_ids: Iterable[int]) -> tuple[dict[int, int], dict[str, Any]]:
    """Map the layer ids a file uses onto MoE layers 0..L-1.

    Files written with model layer numbers (e.g. DeepSeek's MoE layers 1..26 after
    a dense layer 0) keep their order; the original ids go into the metadata so
    nothing is lost.
    """
    ids = sorted(set(layer_ids))
    mapping = {lid: i for i, lid in enumerate(ids)}
    extra = {} if ids == list(range(len(ids))) else {"model_layer_ids": ids}
    return mapping, extra


def check_declared(header: Mapping[str, Any], layer_ids: Iterable[int], top_k: int,
                   header_at: str, first_record: str) -> None:
    """The MoE layers and top-k a file's metadata declares, against what its records hold:
    records lacking a declared layer (or holding more layers) are refused, never read as
    a shallower trace. ``header_at``, ``first_record``: their positions (``line 1``)."""
    if "num_layers" in header:
        declared, ids = meta_int(header, "num_layers"), sorted(set(layer_ids))
        if len(ids) != declared:
            named = header.get("extra", {}).get("model_layer_ids") if isinstance(
                header.get("extra"), Mapping) else None
            if not (isinstance(named, list) and len(named) == declared):
                named = list(range(declared))
            missing = [x for x in named if x not in ids]
            what = (f"no record of any token for layer{'s' * (len(missing) > 1)} "
                    f"{', '.join(map(str, missing))}" if missing and len(ids) < declared
                    else f"records for {len(ids)} layers ({short_repr(ids)})")
            raise TraceError(f"the metadata on {header_at} declares {declared} MoE layers, "
                             f"but the file holds {what}", position=first_record,
                             expected=f"a record of each of the {declared} layers it declares, "
                             "for every token")
    if "top_k" in header and meta_int(header, "top_k") != top_k:
        raise TraceError(f"the metadata on {header_at} declares top_k "
                         f"{meta_int(header, 'top_k')}, but the records hold {top_k} experts",
                         position=first_record,
                         expected=f"{meta_int(header, 'top_k')} experts in every record")


def check_phase_order(is_decode: np.ndarray, seq_starts: np.ndarray,
                      where: Callable[[int], str]) -> None:
    """Each sequence is its prompt, then what was generated: prefill tokens, then decode
    ones. A prefill token after a decode one of its sequence is a damaged or reordered
    file; ``where(token)`` names that token's position in the file."""
    decode = np.asarray(is_decode, dtype=bool)
    back = np.flatnonzero(decode[:-1] & ~decode[1:]) + 1
    back = back[~np.isin(back, seq_starts)]
    if len(back):
        raise TraceError("a prefill token after a decode token of its sequence",
                         position=where(int(back[0])),
                         expected="prefill tokens, then decode tokens, in each sequence")


def check_counts(meta: Mapping[str, Any], counts: Sequence[tuple[str, int, str]]) -> None:
    """The token counts a file's metadata declares, against the data: ``counts`` holds
    (metadata key, what the file holds, what is counted); absent keys are not checked."""
    for key, have, what in counts:
        if key not in meta:
            continue
        declared = meta[key]
        if not isinstance(declared, int) or isinstance(declared, bool) or declared < 0:
            raise TraceError(f"metadata {key!r} is {short_repr(declared)}", position="meta",
                             expected="an integer >= 0")
        if declared != have:
            raise TraceError(f"the metadata says {key} {declared} but the file holds {have} "
                             f"{what}", position="meta", expected=f"{declared} {what}",
                             hint="the file looks truncated or edited")


def agreed_num_experts(option: int | None, declared: int | None) -> int | None:
    """N: the file's own where it says it, else ``--num-experts``; where both do they must
    agree (an option that overrode the file would check its ids against another model)."""
    if option is not None and declared is not None and option != declared:
        raise TraceError(f"--num-experts {option} contradicts the file's {declared}",
                         expected=f"--num-experts {declared} or none: the file says N")
    return declared if declared is not None else option


def order_by_weight(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Put each routing's slots in router rank order (highest gate weight first).

    docs/method.md defines a trace's slot order as router rank order; some tracers write
    ascending weights. The sort is stable, so equal weights keep their file order.
    Returns the reordered arrays and how many routings changed.
    """
    order = np.argsort(-weights, axis=-1, kind="stable")
    changed = int(np.count_nonzero(np.any(order != np.arange(weights.shape[-1]), axis=-1)))
    if not changed:
        return experts, weights, 0
    return (
        np.take_along_axis(experts, order, axis=-1),
        np.take_along_axis(weights, order, axis=-1),
        changed,
    )


_ID_MAX = int(np.iinfo(np.int16).max)  # ids are stored as int16
_WEIGHT_MAX = float(np.finfo(np.float32).max)  # weights are stored as float32


def expert_ids(value: Any, where: str) -> list[int]:
    """A record's expert ids: a non-empty list of integers in -1..32767."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise TraceError(f"'experts' is {short_repr(value)}", position=where,
                         expected="a non-empty list of integer expert ids")
    for slot, v in enumerate(value):
        if not -1 <= v <= _ID_MAX:
            raise TraceError(f"expert id {short_repr(v)} in slot {slot} is out of range",
                             position=where, expected=f"-1..{_ID_MAX}")
    return value


def gate_weights(value: Any, k: int, where: str) -> list[float]:
    """A record's gate weights: ``k`` finite numbers that fit float32."""
    if not isinstance(value, list) or len(value) != k:
        raise TraceError(f"'weights' is {short_repr(value)}", position=where,
                         expected=f"a list of {k} numbers, one per expert")
    out = []
    for slot, w in enumerate(value):
        try:
            ok = isinstance(w, int | float) and not isinstance(w, bool) and abs(w) <= _WEIGHT_MAX
        except OverflowError:
            ok = False
        if not ok or w != w:
            raise TraceError(f"gate weight {short_repr(w)} in slot {slot}", position=where,
                             expected="a finite number")
        out.append(float(w))
    return out


def check_keys(obj: dict[str, Any], known: Sequence[str], where: str) -> None:
    """Refuse a key that looks like a misspelt known one ('weight' for 'weights'),
    which would otherwise be ignored and its data silently lost."""
    for key in obj:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
            if close:
                known_list = ", ".join(known)
                raise TraceError(f"unknown field {key!r}", position=where,
                                 expected=f"{close[0]!r} (known fields: {known_list})")
