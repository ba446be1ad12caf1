"""Cache policies: which resident expert to evict, the one vocabulary every cache uses.

Three caches hold a layer's experts: the cache replay (``stmoe eval --capacity``,
``stmoe.evaluate.cache_replay``), the simulator's pipeline (``stmoe simulate``) and the
runtime's slabs (``stmoe generate``, ``stmoe.runtime.cache``). Like a cachetools
cache, a policy here only chooses the victim (``choose_victim``, compiled, called
by all three); storage, accounting and *protection* (what may never be evicted:
the experts a demand or the compute thread is using, the prefetch set being
inserted, which is the set predicted for the coming layer) live in each cache.
One use stamp per layer step: every expert a step loads or uses shares it, and
ties go to the smaller expert id. The policies:

* ``lru``: the least recently used or loaded expert. Because every cache protects
  the prefetch set it is inserting, this is LRU that never evicts an expert
  predicted for the coming layer. Valid everywhere; the runtime's default.
* ``lfu``: the fewest uses (demands), then the least recent. Valid everywhere.
* ``belady``: the one needed farthest in the future at that layer (``next_use``: in the
  cache replay, an expert the plan brings back before its next counted demand is never
  needed); it also declines a load needed no sooner than its victim (``admits``): the
  bound on hits for the same prefetches (``evaluate.cache_replay``). It needs the future:
  cache replay only (the runtime cannot see it; the simulator does not model it).
* ``none``: no reuse; every expert is dropped once used (plain on-demand
  offloading, the baseline; victims, while a prefetch fills the cache, as LRU).
  Runtime and simulator only (the simulator: a cache of 0 experts).
* ``score``: the expert the predictor scores lowest in its latest prediction for
  that layer (the scores its prefetch set was ranked from), ties to the least
  recent: an online stand-in for ``belady``, which keeps what the predictor expects
  to be needed rather than what was needed last. It needs a predictor that scores
  every expert (``Predictor.scores_experts``: stmoe-plus, hybrid, stmoe-mix); with
  no scores (before the layer's first prediction, or while the runtime's admission
  has its prediction off) it is LRU. The cache replay, the runtime and the
  simulator's runtime pipeline (which takes the runtime's names); the paper's
  accelerator pipeline does not model it. (A model with no more MoE layers than the
  predictor's horizon, one layer say, is the exception to "the same scores in every
  cache": the runtime's CPU tiers and the simulator predict the next token's layer
  before this token's demand there, so its misses see the next prediction's scores.)

``predicted`` is the former name of the runtime's default and stays accepted
everywhere as ``lru`` (``ALIASES``).
"""

from __future__ import annotations

import numpy as np

from stmoe.errors import StmoeError
from stmoe.util.jit import njit

POLICIES = ("lru", "lfu", "belady", "none", "score")
ALIASES = {"predicted": "lru"}
LRU, LFU, BELADY, NONE, SCORE = range(5)  # the codes ``choose_victim`` takes: POLICIES' indices
REPLAY, SIMULATOR, RUNTIME = "the cache replay", "the simulator", "the runtime"
VALID_IN = {
    "lru": (REPLAY, SIMULATOR, RUNTIME),
    "lfu": (REPLAY, SIMULATOR, RUNTIME),
    "belady": (REPLAY,),  # needs the future
    "none": (SIMULATOR, RUNTIME),
    "score": (REPLAY, RUNTIME),  # needs the predictor's scores
}
NEVER = np.iinfo(np.int64).max  # next use of an expert no later step needs
# ``choose_victim``'s score where there is none (SCORE is then LRU)
NO_SCORES = np.zeros(0, dtype=np.float32)


class CachePolicyError(StmoeError, ValueError):
    """An unknown cache policy, or one that cannot apply where it was asked for."""


def names_for(where: str) -> tuple[str, ...]:
    """The policy names ``where`` accepts (aliases included)."""
    valid = tuple(p for p in POLICIES if where in VALID_IN[p])
    return valid + tuple(a for a, p in ALIASES.items() if p in valid)


def policy_code(name: str, where: str, error: type[Exception] = CachePolicyError) -> int:
    """The code of policy ``name`` for ``where`` (REPLAY, SIMULATOR or RUNTIME); else
    ``error`` naming the policy and where it is valid."""
    canonical = ALIASES.get(name, name)
    if canonical not in POLICIES:
        raise error(f"unknown cache policy {name!r}; choose from {', '.join(names_for(where))}")
    if where not in VALID_IN[canonical]:
        raise error(f"cache policy {name!r} applies in {' and '.join(VALID_IN[canonical])} only, "
                    f"not in {where}; choose from {', '.join(names_for(where))}")
    return POLICIES.index(canonical)


@njit(cache=True)
def choose_victim(resident, protected, last_use, uses, next_use, score,
                  policy):  # pragma: no cover
    """The expert to evict, or -1 when every resident one is protected.

    Per-expert arrays of one layer: ``resident`` (evictable when true), ``protected``
    (nonzero: may not be evicted), ``last_use`` (stamp of the last use or load),
    ``uses`` (LFU), ``next_use`` (BELADY; ``NEVER`` when not needed again), ``score``
    (SCORE: the latest prediction's scores; an empty array when there is none yet,
    and then SCORE is LRU). Ties go to the smaller expert id.
    """
    if policy == SCORE and score.shape[0] != resident.shape[0]:
        policy = LRU  # no prediction for this layer yet
    best = -1
    for e in range(resident.shape[0]):
        if not resident[e] or protected[e]:
            continue
        if best < 0:
            best = e
        elif policy == LFU:
            if uses[e] < uses[best] or (uses[e] == uses[best] and last_use[e] < last_use[best]):
                best = e
        elif policy == BELADY:
            if next_use[e] > next_use[best]:
                best = e
        elif policy == SCORE:
            if score[e] < score[best] or (score[e] == score[best]
                                          and last_use[e] < last_use[best]):
                best = e
        elif last_use[e] < last_use[best]:  # LRU (and NONE's rare victims)
            best = e
    return best


@njit(cache=True)
def admits(policy, next_new, next_victim):  # pragma: no cover - compiled
    """Whether a load should evict the victim: BELADY declines one needed no sooner."""
    return policy != BELADY or next_new < next_victim
