"""Whether a trace's rows hold the router's rank order, and the two ways a consumer copes.

``experts[t, l]`` is documented as the router's rank order (highest gate weight
first), but some sources only keep the SET: vLLM's CPU router takes
``topk(sorted=False)``, and a bare ``.npy`` does not say. Their importers record
``rank_order: false`` in ``meta.extra`` (``is_ranked`` reads it). A consumer whose
output depends on the order inside a row then either refuses such a trace in one
line (``require_ranked``: ST-MoE's online update, which keeps the top-ranked
experts first) or reads the rows as sets (``as_sets``: one canonical order,
ascending ids, so its output is a function of each row's set alone).
docs/trace-format.md lists which consumer does which.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.schema import RoutingTrace

RANK_ORDER = "rank_order"  # the meta.extra key; absent means rank order (the contract)
_LAST = np.iinfo(np.int16).max  # sorts after every id (ids are int16, N <= 32767)


def is_ranked(trace: RoutingTrace) -> bool:
    """False only where the trace's source said its rows are sets (``rank_order: false``)."""
    return trace.meta.extra.get(RANK_ORDER, True) is not False


def all_ranked(traces: Iterable[RoutingTrace]) -> bool:
    """Whether every part keeps rank order: a join of parts is ranked only then."""
    return all(is_ranked(t) for t in traces)


def unranked_error(consumer: str, why: str, where: str) -> TraceError:
    """The one refusal of a set-row trace by a consumer that reads rank (``why``)."""
    return TraceError(
        f"{consumer} reads the router's rank order inside each row ({why}), but the rows "
        f"of {where} are sets: its source did not keep that order (rank_order: false)",
        hint="give it routing in rank order (a file with gate weights, or `stmoe capture`), "
        "or a consumer that reads rows as sets (docs/trace-format.md, vLLM)")


def describe(trace: RoutingTrace) -> str:
    """How a refusal names a trace: where it came from, else its model."""
    source = trace.meta.source or f"model {trace.meta.model}"
    return f"the trace ({source})"


def require_ranked(trace: RoutingTrace, consumer: str, why: str) -> None:
    """Refuse ``trace`` for ``consumer`` when its rows are sets."""
    if not is_ranked(trace):
        raise unranked_error(consumer, why, describe(trace))


def set_order(experts: np.ndarray, weights: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray | None]:
    """Each row's ids ascending, empty slots (-1) last: the canonical order of a set
    row (it means nothing); ``weights``, when given, follow their ids."""
    ex = np.asarray(experts)
    key = np.where(ex < 0, _LAST, ex).astype(np.int16)
    if weights is None:
        key.sort(axis=-1)
        key[key == _LAST] = -1
        return key, None
    order = np.argsort(key, axis=-1, kind="stable")
    return (np.take_along_axis(ex, order, axis=-1).astype(np.int16),
            np.take_along_axis(np.asarray(weights), order, axis=-1))


def as_sets(trace: RoutingTrace) -> RoutingTrace:
    """``trace`` itself when ranked; else the same trace with every row in the canonical
    order, so a consumer reading rows as sets gives one answer per set, bit for bit."""
    if is_ranked(trace):
        return trace
    experts, weights = set_order(trace.experts, trace.weights)
    return dataclasses.replace(trace, experts=experts, weights=weights)


def sequence_digests(trace: RoutingTrace, rows: np.ndarray | None = None) -> list[str]:
    """A short digest of each sequence's routing as sets (rank ignored; ``rows``: the
    trace's rows in set order, where the caller has them): what tables keep of the
    sequences they were profiled on, so a replay of any of them is known as in-sample
    however long the trace (their token memory keeps only the last tokens)."""
    rows = set_order(trace.experts)[0] if rows is None else rows
    return [hashlib.blake2b(rows[a:a + n].tobytes(), digest_size=8).hexdigest()
            for a, n in zip(trace.seq_starts.tolist(), trace.seq_lengths.tolist(), strict=True)]


DIGEST_TOKENS = 4  # a token's digest covers it and the tokens before it, this many in all


def token_digests(trace: RoutingTrace, rows: np.ndarray | None = None) -> np.ndarray:
    """[T] uint64: a digest of each token's routing (its row at every layer, as sets) and of
    the three tokens before it in its sequence (fewer at its start, marked so): what tables
    keep of every token they were profiled on, so a replay of any part of it (a ``--split``
    of one long sequence included) is known as in-sample. Four tokens in a row are compared,
    not one or two: a short trace's rows repeat by chance (4 experts, top-2, 3 layers: 216
    rows, and two in a row matched a third of the held-out tokens in a review)."""
    rows = set_order(trace.experts)[0] if rows is None else rows
    width = rows[0].nbytes if len(rows) else 0
    data = np.ascontiguousarray(rows).tobytes()
    out = np.empty(trace.num_tokens, dtype=np.uint64)
    for a, n in zip(trace.seq_starts.tolist(), trace.seq_lengths.tolist(), strict=True):
        for t in range(a, a + n):
            first = t - DIGEST_TOKENS + 1
            mark = b"start" if first < a else b""  # (a window cut by the sequence's start)
            first = max(a, first)
            digest = hashlib.blake2b(mark + data[first * width:(t + 1) * width],
                                     digest_size=8).digest()
            out[t] = int.from_bytes(digest, "little")
    return out
