"""The one predictor interface, shared by offline replay and the runtime.

The protocol follows a token through the layers, for each sequence in flight
(a *slot*; slot 0 when there is one sequence):

    predictor.reset(slot)                  # a new sequence starts in this slot
    for each token:
        for layer in 0..L-1:
            prefetch = predictor.predict(layer, slot)   # ranked ids to load for `layer`
            ...router of `layer` answers with `chosen`...
            predictor.update(layer, chosen, slot)       # learn; history for later layers/tokens

``step(layer, chosen, slot)`` is ``update`` then ``predict(layer + 1)``: "given the
experts the router chose at layer l, the experts to prefetch for layer l+1".
Several slots share the predictor's learned tables but keep their own history;
``predict_batch`` returns the union over slots (what a batch must load).

``plan(trace)`` replays a whole trace in this order and returns every prefetch
set; subclasses may override it with a compiled path that gives identical sets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from stmoe.errors import StmoeError
from stmoe.predictors.union import union_of_scores, union_of_sets
from stmoe.trace.ranks import require_ranked
from stmoe.trace.schema import RoutingTrace


@dataclass(frozen=True)
class ModelShape:
    """The routing shape a predictor or its tables were built for."""

    num_layers: int  # L MoE layers
    num_experts: int  # N routed experts per layer
    top_k: int  # K experts the router picks per token and layer

    @classmethod
    def of(cls, trace: RoutingTrace) -> ModelShape:
        return cls(trace.num_layers, trace.num_experts, trace.top_k)

    def describe(self) -> str:
        return f"L={self.num_layers} layers, N={self.num_experts} experts, top-{self.top_k}"


class PredictorError(StmoeError, ValueError):
    """A predictor was asked for with bad settings or for the wrong model shape."""


P = TypeVar("P", bound="type[Predictor]")
SCORED_PLAN_BYTES = 4 * 2**30  # the most ``scored_plan`` keeps (every prediction's scores)
# name -> predictor class; a new predictor is one module and one @register line.
REGISTRY: dict[str, type[Predictor]] = {}


def register(cls: P) -> P:
    """Class decorator: make ``cls`` available to ``make(cls.name, ...)`` and the CLI."""
    if cls.name in REGISTRY:
        raise PredictorError(f"predictor name {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls
    return cls


@dataclass(frozen=True, eq=False)
class PrefetchPlan:
    """Every prefetch set of a replay, most confident first, as CSR arrays.

    The set of (token t, layer l) is ``ids[ptr[t*L + l] : ptr[t*L + l + 1]]``.
    """

    ptr: np.ndarray  # [T*L + 1] int64
    ids: np.ndarray  # [M] int16
    num_layers: int

    def at(self, token: int, layer: int) -> np.ndarray:
        i = token * self.num_layers + layer
        return self.ids[self.ptr[i] : self.ptr[i + 1]]

    def sizes(self) -> np.ndarray:
        """[T, L] int64, the size of every prefetch set."""
        return np.diff(self.ptr).reshape(-1, self.num_layers)

    def equals(self, other: PrefetchPlan) -> bool:
        return np.array_equal(self.ptr, other.ptr) and np.array_equal(self.ids, other.ids)


class Predictor:
    """Base of every predictor; subclasses override ``predict`` and, if they learn, ``update``."""

    name: ClassVar[str] = "predictor"
    needs_tables: ClassVar[bool] = False  # True: built from profiled tables
    sees_future: ClassVar[bool] = False  # True only for the oracle: replay reveals A first
    uses_lookahead: ClassVar[bool] = False  # True: takes the gate lookahead before predict
    needs_domain_tables: ClassVar[bool] = False  # True: tables profiled with by_domain
    prefetches: ClassVar[bool] = True  # False: predicts nothing, so nothing to learn or queue
    # True: scores(layer, slot) gives [N] scores over every expert (batches sum them),
    # and ``mean_set_size`` is the experts one prediction takes on average
    scores_experts: ClassVar[bool] = False
    # Why the order of ids inside a row (the router's rank) changes this predictor's
    # sets; "" where it reads every row as a set. Such a predictor refuses a trace whose
    # rows are sets (trace.ranks) in ``check_rows``: its ``plan`` must call it, as
    # ``Predictor.plan`` and ``STMoEPredictor.plan`` do (replay checks every predictor
    # first, the runtime before a forced routing).
    needs_rank_order: ClassVar[str] = ""
    mean_set_size: float

    def __init__(self, shape: ModelShape, tables: object = None) -> None:
        """Subclasses that learn from profiling take ``ProfiledTables`` as ``tables``."""
        self.shape = shape
        self._current: dict[int, np.ndarray] = {}  # slot -> [L, K] this token's experts so far
        # which gate lookahead to take: "early", "late", or "auto" (late where available)
        self.lookahead_pref = "auto"
        self.point = "early"  # the lookahead point in use (set by use_lookahead_point)

    config_class: ClassVar[Any] = None  # the dataclass of the knobs ``**knobs`` takes
    config: Any = None  # the knobs in use (a ``config_class``), set by predictors that take any

    @property
    def horizon(self) -> int:
        """How many layers ahead a prediction is made: ``predict(l + h)`` once the token's
        layers <= l are known (the ``horizon`` knob where there is one, else 1)."""
        return int(self.config.horizon) if "horizon" in self.knobs() else 1

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """Options taken through ``**knobs`` (the fields of ``config_class``)."""
        if cls.config_class is None:
            return ()
        return tuple(f.name for f in dataclasses.fields(cls.config_class))

    def configure(self, knobs: Mapping[str, Any], base: Any = None) -> Any:
        """``base`` (default: ``config_class()``) with ``knobs`` set; unknown ones are
        a clear error listing the valid ones."""
        try:
            return dataclasses.replace(base or self.config_class(), **knobs)
        except TypeError:
            raise PredictorError(f"unknown {self.name} option in {sorted(knobs)}; "
                                 f"valid: {', '.join(self.knobs())}") from None

    # ---- the protocol ------------------------------------------------------
    def reset(self, slot: int = 0) -> None:
        """A new sequence starts in ``slot``: forget its history (learned tables stay)."""
        self._current.pop(slot, None)

    def predict(self, layer: int, slot: int = 0) -> np.ndarray:
        """Ranked expert ids (int16, most confident first) to prefetch for ``layer``.

        Does not mutate. Uses what ``update`` has seen of this token's earlier
        layers and of earlier tokens in the slot.
        """
        raise NotImplementedError

    def update(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        """The router chose ``experts`` ([K] int, rank order) at ``layer`` for the slot's token."""
        self._check_layer(layer)
        cur = self._current.get(slot)
        if cur is None:
            cur = self._current[slot] = np.full(
                (self.shape.num_layers, self.shape.top_k), -1, dtype=np.int16
            )
        cur[layer] = experts

    def reveal(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        """Only for predictors that ``sees_future``: the true set before ``predict``."""

    def lookahead(self, layer: int, experts: np.ndarray, slot: int = 0) -> None:
        """Only for predictors that ``uses_lookahead``: layer ``layer``'s router applied
        to the previous layer's hidden state, its top ids ranked, before ``predict``."""

    def resolve_lookahead_point(self, late_available: bool) -> str:
        """The lookahead point this predictor takes, given whether the late one exists.

        early: layer l's router on layer l-1's MoE input, known when layer l-1 routes
        (the prefetch overlaps layer l-1's experts and layer l's attention). late:
        layer l's router on layer l's input through its pre-MoE norm, known when layer
        l-1 is done (the prefetch overlaps layer l's attention only), and closer to
        what the router will see."""
        pref = self.lookahead_pref
        if pref == "late" and not late_available:
            raise PredictorError(f"predictor {self.name!r} was asked for the late gate lookahead "
                                 "and there is none (record it with `stmoe capture`; the model "
                                 "needs a pre-MoE norm stmoe recognises)")
        return "late" if pref in ("auto", "late") and late_available else "early"

    def use_lookahead_point(self, point: str) -> None:
        """Take the ``point`` ("early" or "late") lookahead from now on."""
        self.point = point

    def lookahead_array(self, trace: RoutingTrace) -> np.ndarray:
        """The trace's gate lookahead this predictor takes (and switch to its point)."""
        if trace.lookahead is None and trace.lookahead_late is None:
            raise PredictorError(f"predictor {self.name!r} needs the trace's gate lookahead; "
                                 "capture it with `stmoe capture`, which records it")
        point = self.resolve_lookahead_point(trace.lookahead_late is not None)
        look = trace.lookahead_late if point == "late" else trace.lookahead
        if look is None:
            raise PredictorError(f"predictor {self.name!r} was asked for the early gate "
                                 "lookahead and the trace has only the late one")
        self.use_lookahead_point(point)
        return np.ascontiguousarray(look, dtype=np.int16)

    # ---- conveniences built on the protocol --------------------------------
    def step(self, layer: int, experts: np.ndarray, slot: int = 0) -> np.ndarray | None:
        """``update`` with the router's choice at ``layer``, then the prefetch for ``layer+1``
        (None after the last layer)."""
        self.update(layer, experts, slot)
        if layer + 1 >= self.shape.num_layers:
            return None
        return self.predict(layer + 1, slot)

    def predict_batch(self, layer: int, slots: Sequence[int], max_size: int = 0) -> np.ndarray:
        """The union of the slots' prefetch sets for ``layer`` by the one batch rule of
        ``stmoe.predictors.union``: experts by the expected number of slots needing
        them (normalised scores where the predictor ``scores_experts``, else one vote
        per predicted expert), then by their best rank, then by id; cut to ``max_size``
        experts when it is > 0 (one cap for the whole batch), else, for scoring
        predictors, to their mean set size times the slots."""
        slots = list(slots)
        if self.scores_experts and len(slots) > 1:
            size = self._union_size(len(slots), max_size)
            if size <= 0:
                return np.zeros(0, dtype=np.int16)
            return union_of_scores([self.scores(layer, slot) for slot in slots], size)
        return union_of_sets([self.predict(layer, slot) for slot in slots], max_size)

    def _union_size(self, slots: int, max_size: int) -> int:
        """A scoring predictor's batch set size: ``max_size``, else its mean set size times
        the slots."""
        return max_size if max_size > 0 else min(self.shape.num_experts,
                                                 round(self.mean_set_size * slots))

    def scores(self, layer: int, slot: int = 0) -> np.ndarray:
        """[N] scores of every expert for ``layer`` (predictors that ``scores_experts``)."""
        raise NotImplementedError(f"{self.name} does not score every expert")

    def predict_scored(self, layer: int, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``predict``'s set and the [N] scores it was ranked from, as float32 (so two
        scores apart only in float64 tie, and go to the least recent): what score eviction
        (``cache_policy``'s ``score``) keeps by. Predictors that ``scores_experts``."""
        raise PredictorError(f"predictor {self.name!r} does not score every expert, so "
                             "score eviction (cache policy 'score') cannot rank its cache; use "
                             "stmoe-plus, hybrid or stmoe-mix, or another policy (lru)")

    def predict_batch_scored(self, layer: int, slots: Sequence[int],
                             max_size: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``predict_batch``'s set and the scores score eviction keeps by: one slot's own
        (``predict_scored``), or a batch's summed normalised scores (the union's weights)."""
        slots = list(slots)
        if not self.scores_experts or len(slots) == 1:  # (the clear error where it does not)
            ids, scores = self.predict_scored(layer, slots[0] if slots else 0)
            return (ids[:max_size] if max_size > 0 else ids), scores
        weight = np.zeros(self.shape.num_experts, dtype=np.float32)
        size = self._union_size(len(slots), max_size)
        if size <= 0 or not slots:  # as predict_batch: nothing asked of the predictor
            return np.zeros(0, dtype=np.int16), weight
        per_slot = [self.scores(layer, slot) for slot in slots]
        for s in per_slot:
            weight += s / max(float(s.sum()), 1e-300)
        return union_of_scores(per_slot, size), weight

    def plan(self, trace: RoutingTrace) -> PrefetchPlan:
        """Replay ``trace`` step by step through the protocol; every prefetch set."""
        return self._sets(trace, lambda i: self.predict(i % trace.num_layers))

    def scored_plan(self, trace: RoutingTrace) -> tuple[PrefetchPlan, np.ndarray]:
        """``plan``'s sets (the same) and, per (token, layer), the scores each was ranked
        from: [T*L, N] float32, score eviction's input in the cache replay."""
        shape = ModelShape.of(trace)
        need = trace.num_tokens * shape.num_layers * shape.num_experts * 4
        if need > SCORED_PLAN_BYTES:
            raise PredictorError(
                f"score eviction's replay keeps every prediction's scores: {need / 2**30:.1f} "
                f"GiB for {trace.num_tokens} tokens x {shape.num_layers} layers x "
                f"{shape.num_experts} experts, over its {SCORED_PLAN_BYTES // 2**30} GiB; "
                "replay fewer tokens (`eval --split` or `--domain`; stmoe.select_sequences "
                "or stmoe.split in Python)")
        scores = np.zeros((trace.num_tokens * shape.num_layers, shape.num_experts),
                          dtype=np.float32)

        def scored(i: int) -> np.ndarray:
            ids, scores[i] = self.predict_scored(i % shape.num_layers)
            return ids

        return self._sets(trace, scored), scores

    def _sets(self, trace: RoutingTrace, predict: Callable[[int], np.ndarray]) -> PrefetchPlan:
        """Every (token, layer)'s set, ``predict(t * L + layer)``, through the protocol."""
        n_layers = trace.num_layers
        ptr = np.zeros(trace.num_tokens * n_layers + 1, dtype=np.int64)
        chunks: list[np.ndarray] = []
        for i in self._protocol(trace):
            chosen = predict(i)
            chunks.append(chosen)
            ptr[i + 1] = ptr[i] + len(chosen)
        ids = np.concatenate(chunks).astype(np.int16) if chunks else np.zeros(0, np.int16)
        return PrefetchPlan(ptr=ptr, ids=ids, num_layers=n_layers)

    def _protocol(self, trace: RoutingTrace) -> Iterator[int]:
        """The protocol over ``trace`` in slot 0: yields ``t * L + layer`` where the caller
        predicts ``layer`` for token ``t`` (revealed and looked ahead first), then updates."""
        self.check_shape(ModelShape.of(trace))
        self.check_rows(trace)
        n_layers = trace.num_layers
        new_seq = np.zeros(trace.num_tokens, dtype=bool)
        new_seq[trace.seq_starts] = True
        experts = np.asarray(trace.experts)
        look = self.lookahead_array(trace) if self.uses_lookahead else None
        for t in range(trace.num_tokens):
            if new_seq[t]:
                self.reset(0)
            for layer in range(n_layers):
                if self.sees_future:
                    self.reveal(layer, experts[t, layer])
                if look is not None:
                    self.lookahead(layer, look[t, layer])
                yield t * n_layers + layer
                self.update(layer, experts[t, layer])

    # ---- helpers -------------------------------------------------------------
    def rank_order_reason(self) -> str:
        """``needs_rank_order`` for this instance's settings ("" where rows are sets)."""
        return self.needs_rank_order

    def check_rows(self, trace: RoutingTrace) -> None:
        """Refuse, in one line, a trace of set rows when this predictor reads rank."""
        reason = self.rank_order_reason()
        if reason:
            require_ranked(trace, f"predictor {self.name!r}", reason)

    def check_shape(self, shape: ModelShape) -> None:
        if shape != self.shape:
            raise PredictorError(
                f"predictor {self.name!r} was built for {self.shape.describe()} "
                f"but the trace has {shape.describe()}",
            )

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.shape.num_layers:
            raise PredictorError(f"layer {layer} is out of range 0..{self.shape.num_layers - 1}")

    def token_so_far(self, slot: int) -> np.ndarray | None:
        """[L, K] experts ``update`` has recorded for the slot's current token, or None."""
        return self._current.get(slot)
