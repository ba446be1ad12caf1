"""Routing as serving engines hand it out: vLLM, SGLang, transformers, MoE-Infinity.

One module per engine family reads that engine's own layout (exactly as its
writer lays it out) into per-request arrays; ``common.assemble`` turns those into
one validated ``RoutingTrace`` the same way for all of them (dense layers dropped,
prefill and decode marked, ids range-checked), so every engine obeys one set of
rules. ``writers`` writes the vLLM and SGLang layouts back. torch is imported only
inside ``torchfile`` when a ``torch.save`` file is actually read.
"""

from stmoe.trace.engines.common import ImportNote
from stmoe.trace.engines.options import EngineOptions

__all__ = ["EngineOptions", "ImportNote"]
