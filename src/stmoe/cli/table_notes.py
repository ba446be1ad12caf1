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

from stmoe.errors import StmoeNote
from stmoe.predictors.base import ModelShape
from stmoe.predictors.tables import ProfiledTables
from stmoe.trace import RoutingTrace
from stmoe.trace.ranks import sequence_digests, set_order


def note_tables(trace: RoutingTrace, tables: ProfiledTables) -> None:
    """Both notes, where they apply."""
    note_in_sample(trace, tables)
    note_other_model(trace, tables)


def in_sample_tokens(trace: RoutingTrace, tables: ProfiledTables) -> int:
    """How many of ``trace``'s tokens were profiled into ``tables``: those of a sequence
    the tables were profiled on (its digest, ``info["sequences"]``), and of the others
    those whose routing is in the tables' token memory (their last profiled tokens;
    compared as sets, each row in the canonical order)."""
    if tables.shape != ModelShape.of(trace):
        return 0
    profiled = set(tables.info.get("sequences", []))
    routing = set_order(trace.experts)[0]
    known, rest = 0, []
    for digest, a, n in zip(sequence_digests(trace, routing), trace.seq_starts.tolist(),
                            trace.seq_lengths.tolist(), strict=True):
        if digest in profiled:
            known += n
        else:
            rest.append((a, n))
    if tables.recent is not None and rest:
        seen = {row.tobytes() for row in set_order(tables.recent)[0]}
        known += sum(routing[t].tobytes() in seen for a, n in rest for t in range(a, a + n))
    return known


def note_in_sample(trace: RoutingTrace, tables: ProfiledTables) -> None:
    """A note when most replayed tokens were profiled into ``tables``: recall would be
    in-sample."""
    known = in_sample_tokens(trace, tables)
    if known > trace.num_tokens / 2:
        _note(f"{known} of the {trace.num_tokens} tokens replayed were profiled into "
              f"{tables.source or 'these tables'}, so every figure is in-sample; profile and "
              "replay different parts, e.g. the same --split for both")


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
