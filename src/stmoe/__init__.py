"""stmoe: spatio-temporal expert prefetching (ST-MoE) for Mixture-of-Experts inference.

``import stmoe`` is light: it needs numpy only, never torch or matplotlib.
"""

from stmoe import _moved
from stmoe.errors import StmoeError, TraceError
from stmoe.trace import (
    RoutingTrace,
    SynthSpec,
    TraceMeta,
    concat,
    decode_only,
    import_files,
    load_trace,
    save_trace,
    select_domain,
    select_sequences,
    split,
    synthesize,
    validate,
)

__version__ = "0.1.0"
_moved.install()  # old module paths stay importable for one release


def __getattr__(name: str) -> object:
    """``stmoe.offload`` loads torch only when asked for."""
    if name == "offload":
        from stmoe.runtime.api import offload

        return offload
    raise AttributeError(f"module 'stmoe' has no attribute {name!r}")


__all__ = [
    "RoutingTrace",
    "StmoeError",
    "SynthSpec",
    "TraceError",
    "TraceMeta",
    "__version__",
    "concat",
    "decode_only",
    "import_files",
    "load_trace",
    "offload",
    "save_trace",
    "select_domain",
    "select_sequences",
    "split",
    "synthesize",
    "validate",
]
