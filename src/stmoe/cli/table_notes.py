"""Notes on tables given to a command that replays a trace with them (``eval``,
``simulate``, ``generate --routing``): where the figures would not mean what they seem.

Why: tables profiled on the routing replayed make every predictor look better than it is
(stmoe-plus's token memory recalls nearly everything it has seen), and tables profiled on
SYNTHETIC routing or another model's say how that routing predicts this one. Neither is an
error (an in-sample replay is a fair upper bound, asked for knowingly), so each is a note
(shown once the command succeeded: a refusal stays one line).
"""

from __future__ import annotations

import warnings

import numpy as np

from stmoe.errors import StmoeNote
from stmoe.evaluate.metrics import scope_tokens
from stmoe.predictors.base import ModelShape
from stmoe.predictors.tables import ProfiledTables
from stmoe.trace import RoutingTrace
from stmoe.trace.ranks import sequence_digests, set_order, token_digests


def note_tables(trace: RoutingTrace, tables: ProfiledTables) -> None:
    """Both notes, where they apply."""
    note_in_sample(trace, tables)
    note_other_model(trace, tables)


def in_sample_tokens(trace: RoutingTrace, tables: ProfiledTables) -> int:
    """How many of ``trace``'s ``scope_tokens`` (the tokens its figures count: the decode
    tokens where it has any, so a chat template's prefix shared with the profiled prompts is
    not counted) were profiled into ``tables``: those whose
    digest (``token_digests``: the token's routing and the three before it) the tables
    keep, counted from their sample where they keep one (an estimate then); in older files,
    without the digests, the tokens of a sequence they were profiled on and, of the others,
    those in their token memory (their last profiled tokens). Rows are compared as sets."""
    scope = scope_tokens(trace)
    if tables.shape != ModelShape.of(trace) or not scope.any():
        return 0
    routing = set_order(trace.experts)[0]
    if tables.profiled_tokens is not None:
        digests = token_digests(trace, routing)[scope]
        mask = np.uint64((1 << int(tables.info.get("token_sample_bits", 0))) - 1)
        sample = digests[digests & mask == 0]
        if not len(sample):
            return 0
        found = int(np.isin(sample, tables.profiled_tokens).sum())
        return round(found * len(digests) / len(sample))
    known = np.zeros(trace.num_tokens, bool)
    profiled = set(tables.info.get("sequences", []))
    seen = (set() if tables.recent is None
            else {row.tobytes() for row in set_order(tables.recent)[0]})
    for digest, a, n in zip(sequence_digests(trace, routing), trace.seq_starts.tolist(),
                            trace.seq_lengths.tolist(), strict=True):
        for t in range(a, a + n):
            known[t] = digest in profiled or routing[t].tobytes() in seen
    return int((known & scope).sum())


IN_SAMPLE_SHARE = 0.01  # a note from this share of the replayed tokens profiled


def note_in_sample(trace: RoutingTrace, tables: ProfiledTables) -> None:
    """A note when some of the replayed tokens (1% or more of ``scope_tokens``) were
    profiled into ``tables``: their figures are in-sample (a third of the tokens in-sample
    moved stmoe-plus's lead over ST-MoE by 9 points in a review, 2026-12-07). Not where
    every expert routes at every layer: no token differs from another there."""
    if trace.top_k >= trace.num_experts:
        return
    known, total = in_sample_tokens(trace, tables), int(scope_tokens(trace).sum())
    if known and known >= IN_SAMPLE_SHARE * total:
        share = ("every one" if known >= total
                 else f"{min(known / total, 0.99):.0%}")  # (not 100% but one)
        which = "decode tokens" if trace.is_decode.any() else "tokens"
        _note(f"{known} of the {total} {which} replayed ({share}) were profiled into "
              f"{tables.source or 'these tables'}, so their figures are in-sample; profile "
              "and replay different parts, e.g. the same --split for both")


def note_other_model(trace: RoutingTrace, tables: ProfiledTables) -> None:
    """A note when ``tables`` were profiled on another model than ``trace``'s (the same
    shape, else they are refused) or on SYNTHETIC routing: the figures then say how that
    routing predicts this one, which is rarely what was meant."""
    profiled = str(tables.info.get("model", ""))
    if tables.info.get("synthetic") and not trace.meta.synthetic:
        _note(f"{tables.source or 'the tables'} were profiled on SYNTHETIC routing "
              f"({profiled or 'unnamed'}); the trace replayed is {trace.meta.model!r}'s")
    elif profiled and trace.meta.model and profiled != trace.meta.model:
        _note(f"{tables.source or 'the tables'} were profiled on {profiled!r}'s routing; the "
              f"trace replayed is {trace.meta.model!r}'s")


def _note(text: str) -> None:
    warnings.warn(text, StmoeNote, stacklevel=3)
