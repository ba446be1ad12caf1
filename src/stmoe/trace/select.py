"""Selecting, splitting and joining traces: every result is a new, valid trace."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.checks import model_layer_ids
from stmoe.trace.ranks import RANK_ORDER, all_ranked
from stmoe.trace.schema import RoutingTrace, validate
from stmoe.util.units import UnitError, parse_layer_range


def select_sequences(trace: RoutingTrace, indices: Sequence[int] | np.ndarray) -> RoutingTrace:
    """The sequences ``indices`` (in the order given) as a trace of their own."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(idx) == 0:
        raise TraceError("no sequence selected", expected="at least one sequence index")
    if idx.min() < 0 or idx.max() >= trace.num_sequences:
        raise TraceError(
            f"sequence index {int(idx.max() if idx.max() >= 0 else idx.min())} is out of range",
            expected=f"0..{trace.num_sequences - 1}",
        )
    starts, ends = np.asarray(trace.seq_starts), trace.seq_ends
    tokens = np.concatenate([np.arange(starts[i], ends[i]) for i in idx])
    lengths = ends[idx] - starts[idx]
    return _take_tokens(
        trace,
        tokens,
        np.concatenate([[0], np.cumsum(lengths)[:-1]]),
        tuple(trace.domains[i] for i in idx),
    )


def select_domain(trace: RoutingTrace, domain: str) -> RoutingTrace:
    """The sequences labelled ``domain``."""
    idx = [i for i, d in enumerate(trace.domains) if d == domain]
    if not idx:
        raise TraceError(
            f"no sequence has domain {domain!r}",
            expected=f"one of {sorted(set(trace.domains))}",
        )
    return select_sequences(trace, idx)


def decode_only(trace: RoutingTrace) -> RoutingTrace:
    """The decode tokens only; sequences without decode tokens are dropped.

    Each kept sequence stays one sequence, so its first decode token now starts it
    (the prompt that preceded it is gone from the trace's history).
    """
    keep = np.asarray(trace.is_decode, dtype=bool)
    if not keep.any():
        raise TraceError("the trace has no decode tokens", expected="tokens marked as decode")
    seq = trace.sequence_of_token()[keep]
    new_starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    domains = tuple(trace.domains[int(s)] for s in seq[new_starts])
    return _take_tokens(trace, np.flatnonzero(keep), new_starts, domains)


def split(
    trace: RoutingTrace,
    fraction: float = 0.5,
    *,
    by: Literal["sequence", "token"] = "sequence",
    seed: int | None = None,
) -> tuple[RoutingTrace, RoutingTrace]:
    """Split into (profiling, evaluation) parts; the first gets about ``fraction``.

    ``by="sequence"`` keeps sequences whole: the first ``ceil(fraction*S)`` sequences
    (shuffled first when ``seed`` is given) go to profiling. ``by="token"`` cuts the
    token stream at ``round(fraction*T)``, for traces of a single long sequence; the
    cut starts a new sequence in the evaluation part.
    """
    if not 0.0 < fraction < 1.0:
        raise TraceError(f"split fraction {fraction}", expected="a number strictly between 0 and 1")
    if by == "token":
        cut = round(fraction * trace.num_tokens)
        if not 0 < cut < trace.num_tokens:
            raise TraceError(f"a {trace.num_tokens}-token trace cannot be cut at {fraction}")
        return _token_range(trace, 0, cut), _token_range(trace, cut, trace.num_tokens)
    if by != "sequence":
        raise TraceError(f"unknown split mode {by!r}", expected="'sequence' or 'token'")
    s = trace.num_sequences
    if s < 2:
        raise TraceError(
            "a trace of 1 sequence cannot be split by sequence",
            expected="at least 2 sequences",
            hint="split by token instead",
        )
    order = np.arange(s) if seed is None else np.random.default_rng(seed).permutation(s)
    n_first = min(s - 1, max(1, int(np.ceil(fraction * s))))
    first, second = np.sort(order[:n_first]), np.sort(order[n_first:])
    return select_sequences(trace, first), select_sequences(trace, second)


def split_auto(trace: RoutingTrace, fraction: float) -> tuple[RoutingTrace, RoutingTrace]:
    """``split`` by sequence when the trace has several, else by token."""
    return split(trace, fraction, by="sequence" if trace.num_sequences > 1 else "token")


def concat(traces: Sequence[RoutingTrace], *, drop_partial: bool = False) -> RoutingTrace:
    """One trace holding every sequence of ``traces``, in order.

    All parts must describe the same model shape (and name): joining routing of
    different models would make every later statistic meaningless. Gate weights
    and token ids survive only if every part has them; when some parts lack them
    that is an error unless ``drop_partial`` says to drop them from all.
    """
    if not traces:
        raise TraceError("nothing to concatenate", expected="at least one trace")
    first = traces[0]
    for i, t in enumerate(traces[1:], start=1):
        for what in ("model", "num_experts", "top_k", "num_layers"):
            a, b = getattr(first.meta, what), getattr(t.meta, what)
            if a != b:
                raise TraceError(
                    f"trace {i} has {what} {b!r} but trace 0 has {a!r}",
                    position=f"trace {i}",
                    expected="traces of the same model and shape",
                )
        a, b = model_layer_ids(first), model_layer_ids(t)
        if a != b:  # the same count of MoE layers, but other layers of the model
            raise TraceError(f"trace {i} has model_layer_ids {b} but trace 0 has {a}",
                             position=f"trace {i}",
                             expected="traces of the same model layers")
    complete = {}
    for field, label in (("weights", "gate weights"), ("token_ids", "token ids"),
                         ("lookahead", "gate lookahead"),
                         ("lookahead_late", "late gate lookahead")):
        have = [getattr(t, field) is not None for t in traces]
        complete[field] = all(have)
        if any(have) and not all(have) and not drop_partial:
            raise TraceError(
                f"trace {have.index(False)} has no {label} but trace {have.index(True)} has",
                expected=f"{label} in every input or in none",
                hint="pass --drop-partial to import without them",
            )
    if len(traces) == 1:
        return first
    offsets = np.cumsum([0] + [t.num_tokens for t in traces[:-1]])
    has_w, has_ids = complete["weights"], complete["token_ids"]
    sources = list(dict.fromkeys(t.meta.source for t in traces if t.meta.source))
    extra = dict(first.meta.extra)
    if not all_ranked(traces):  # one part of sets makes the whole a trace of sets
        extra[RANK_ORDER] = False
    meta = dataclasses.replace(
        first.meta,
        source="; ".join(sources),
        synthetic=any(t.meta.synthetic for t in traces),
        extra=extra,
    )
    return validate(
        RoutingTrace(
            experts=np.concatenate([np.asarray(t.experts) for t in traces]),
            seq_starts=np.concatenate(
                [
                    np.asarray(t.seq_starts, dtype=np.int64) + o
                    for t, o in zip(traces, offsets, strict=True)
                ]
            ),
            is_decode=np.concatenate([np.asarray(t.is_decode) for t in traces]),
            weights=np.concatenate([np.asarray(t.weights) for t in traces]) if has_w else None,
            token_ids=np.concatenate([np.asarray(t.token_ids) for t in traces])
            if has_ids
            else None,
            lookahead=np.concatenate([np.asarray(t.lookahead) for t in traces])
            if complete["lookahead"]
            else None,
            lookahead_late=np.concatenate([np.asarray(t.lookahead_late) for t in traces])
            if complete["lookahead_late"]
            else None,
            domains=tuple(d for t in traces for d in t.domains),
            meta=meta,
        )
    )


def _token_range(trace: RoutingTrace, a: int, b: int) -> RoutingTrace:
    starts = np.asarray(trace.seq_starts)
    inside = (starts > a) & (starts < b)
    first_seq = int(np.searchsorted(starts, a, side="right")) - 1
    seqs = [first_seq, *np.flatnonzero(inside).tolist()]
    new_starts = np.r_[0, starts[inside] - a]
    return _take_tokens(trace, np.arange(a, b), new_starts, tuple(trace.domains[s] for s in seqs))


def _take_tokens(
    trace: RoutingTrace, tokens: np.ndarray, new_starts: np.ndarray, domains: tuple[str, ...]
) -> RoutingTrace:
    def take(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.asarray(a)[tokens]

    return validate(
        RoutingTrace(
            experts=np.asarray(trace.experts)[tokens],
            seq_starts=np.asarray(new_starts, dtype=np.int64),
            is_decode=np.asarray(trace.is_decode)[tokens],
            weights=take(trace.weights),
            token_ids=take(trace.token_ids),
            lookahead=take(trace.lookahead),
            lookahead_late=take(trace.lookahead_late),
            domains=domains,
            meta=trace.meta,
        )
    )


def first_layers(trace: RoutingTrace, n: int) -> RoutingTrace:
    """The trace's first ``n`` MoE layers only: what a model with ``n`` of its layers (a
    ``stmoe make-model --layers n`` checkpoint) routes."""
    if not 1 <= n <= trace.num_layers:
        raise TraceError(f"--layers {n}: the trace has {trace.num_layers} MoE layers",
                         expected=f"1..{trace.num_layers}")
    return select_layers(trace, n)


def select_layers(trace: RoutingTrace, layers: int | str) -> RoutingTrace:
    """MoE layers ``layers`` of the trace: ``N`` the first N, ``"A:B"`` layers A..B-1 (a
    cut from the middle of the model, routed by a checkpoint of B-A layers); renumbered
    from 0 (``util.units.parse_layer_range``'s grammar)."""
    try:
        start, stop = parse_layer_range(layers, trace.num_layers)
    except UnitError as exc:
        raise TraceError(str(exc)) from None
    if (start, stop) == (0, trace.num_layers):
        return trace

    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(np.asarray(a)[:, start:stop])

    # the kept layers' own model numbers, so tables profiled on one cut are not taken for
    # another's (ProfiledTables.check_trace); a cut from layer 0 names none, as a whole trace
    extra = {k: v for k, v in trace.meta.extra.items() if k != "model_layer_ids"}
    kept = model_layer_ids(trace)[start:stop]
    if kept != list(range(stop - start)):
        extra["model_layer_ids"] = kept
    return validate(dataclasses.replace(
        trace, experts=cut(trace.experts), weights=cut(trace.weights),
        lookahead=cut(trace.lookahead), lookahead_late=cut(trace.lookahead_late),
        meta=dataclasses.replace(trace.meta, num_layers=stop - start, extra=extra)))


def held_out_tail(trace: RoutingTrace, at: int, prompt: int) -> tuple[RoutingTrace, RoutingTrace]:
    """A one-sequence trace split by tokens for a held-out replay: (tokens ``0..at-1``, to
    profile on; tokens ``at-prompt..`` as a new sequence, to replay). The replayed
    sequence's first ``prompt`` tokens (already profiled) become its prompt, so every
    decode token replayed is one the tables never saw, and the predictor's history at the
    first of them is the real one (the tokens just before, not the original prompt's)."""
    if trace.num_sequences != 1:
        raise TraceError(f"a held-out tail needs a trace of 1 sequence, not "
                         f"{trace.num_sequences}", hint="select one sequence first")
    if not 1 <= prompt < at < trace.num_tokens:
        raise TraceError(f"a held-out tail at token {at} with a {prompt}-token prompt of a "
                         f"{trace.num_tokens}-token trace",
                         expected=f"1 <= prompt < at < {trace.num_tokens}")
    if not np.asarray(trace.is_decode)[at:].all():
        raise TraceError(f"token {at} onwards is not all decode tokens",
                         expected="a cut inside the decode part")
    head = _token_range(trace, 0, at)
    tail = _take_tokens(trace, np.arange(at - prompt, trace.num_tokens),
                        np.zeros(1, dtype=np.int64), trace.domains[:1])
    decode = np.ones(tail.num_tokens, dtype=bool)
    decode[:prompt] = False
    return head, validate(dataclasses.replace(tail, is_decode=decode))
