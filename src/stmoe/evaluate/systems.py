"""The offloading systems the demo, the benchmarks and the simulator's runtime pipeline
compare (torch-free: ``sim.host.systems`` times the same ones). Not the paper's
baselines: those are the accelerator simulator's (``sim.accelerator.systems``).

Each system is a predictor and a cache policy, run at one cache size; the two
no-prefetch baselines differ only in whether the cache reuses experts. Kept in
one place so the demo's report and the benchmark's table compare the same set.
"""

from __future__ import annotations

from typing import Any

from stmoe.predictors import make
from stmoe.predictors.base import Predictor

OFFLOAD_SYSTEMS = {  # name: (predictor, cache policy)
    "on-demand": ("ondemand", "none"),  # no prefetch, no reuse: the usual baseline
    "lru-only": ("ondemand", "lru"),  # no prefetch, LRU cache
    "stmoe": ("stmoe", "lru"),
    "stmoe-plus": ("stmoe-plus", "lru"),
    "hybrid": ("hybrid", "lru"),
    "oracle": ("oracle", "lru"),
    # stmoe-plus's prefetches; its cache evicts the expert it scores lowest (cache_policy)
    "stmoe-plus-score": ("stmoe-plus", "score"),
}
COMPARED_SYSTEMS = OFFLOAD_SYSTEMS  # the former name, for one release
# what each compared system does, in one line (the demo's report and table)
SYSTEM_DESCRIPTIONS = {
    "on-demand": "no prefetch, no reuse: every routed expert is loaded when the router asks",
    "lru-only": "no prefetch; an LRU cache keeps recently used experts",
    "stmoe": "ST-MoE prefetch (HT + CCT tables) into the LRU cache",
    "stmoe-plus": "stmoe-plus prefetch (1.5K experts per layer) into the LRU cache",
    "hybrid": "stmoe-plus fused with gate lookahead (1.5K experts) into the LRU cache",
    "oracle": "prefetches exactly the experts the router will choose (known from a first pass)",
    "stmoe-plus-all": "stmoe-plus with the runtime's prefetch admission off: every predicted "
    "load made",
    "stmoe-plus-score": "stmoe-plus prefetch (1.5K experts per layer); the cache evicts the "
    "expert stmoe-plus scores lowest",
}
# the systems of the demo's headline figure: the baselines, ST-MoE, stmoe-plus and the bound
HEADLINE_SYSTEMS = ("on-demand", "lru-only", "stmoe", "stmoe-plus", "oracle")
# the demo's runs (every system but score eviction, which benchmarks and the GPU check time)
DEMO_SYSTEMS = ("on-demand", "lru-only", "stmoe", "stmoe-plus", "hybrid", "oracle")
PLUS_SET_SIZE_IN_K = 1.5  # stmoe-plus and hybrid predict 1.5K experts per layer there
_SIZED_AT_PLUS_SET_SIZE = ("stmoe-plus", "hybrid")


def compared_predictor(predictor: str, tables: Any) -> str | Predictor:
    """The predictor of a compared system: stmoe-plus and hybrid at 1.5K experts."""
    if predictor in _SIZED_AT_PLUS_SET_SIZE:
        size = PLUS_SET_SIZE_IN_K * tables.shape.top_k
        return make(predictor, tables.shape, tables, set_size=size)
    return predictor
