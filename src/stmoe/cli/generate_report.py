"""What `stmoe generate` prints and writes: the JSON of its runs (medians over them) and
the table of one offloaded generation's figures."""

from __future__ import annotations

import statistics
from typing import Any

# The measured figures of one run (GenerationResult's fields) that may differ between runs.
FIGURES = (
    "ttft_s", "decode_s", "decode_tokens_per_s", "hit_rate", "prefetch_recall",
    "prefetch_precision", "bytes_moved", "bytes_wasted", "stall_s", "stall_share",
)


def summary(runs: list[Any]) -> dict[str, Any]:
    """The JSON: run 1's result with each figure the median over the runs, every run's
    figures under ``repeat`` (``stats`` are run 1's)."""
    data = runs[0].to_dict()
    data.update({k: statistics.median(getattr(r, k) for r in runs) for k in FIGURES})
    data["repeat"] = {"runs": len(runs), "figures": "median over the runs",
                      "per_run": [{k: getattr(r, k) for k in FIGURES} for r in runs]}
    return data


def _spread(runs: list[Any], key: str, scale: float = 1.0, fmt: str = ".1f") -> str:
    """One figure: its median, with [min, max] when the runs differ."""
    values = [getattr(r, key) * scale for r in runs]
    med = f"{statistics.median(values):{fmt}}"
    lo, hi = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return med if lo == hi else f"{med} [{lo}, {hi}]"


def rows(runs: list[Any]) -> list[tuple[str, str]]:
    """The table's rows: the setup in words, then each figure (median [min, max])."""
    from stmoe.predictors import REGISTRY
    from stmoe.runtime.memory import MemoryPlan

    r, c, mib = runs[0], runs[0].config, 1 / 2**20
    if c["emulated"]:
        tier = (f"emulated link: {c['bandwidth'] / 1e6:g} MB/s, {c['latency'] * 1e6:g} us "
                "per transfer (EMULATED)")
    elif c["tier"] == "disk":
        tier = "disk, " + ("direct reads (page cache bypassed)" if c.get("direct_io")
                           else "buffered reads (direct I/O unavailable here)")
    else:
        tier = "gpu (pinned host memory to a CUDA cache)"
    if not getattr(REGISTRY.get(c["predictor"]), "prefetches", True):
        predictor = f"{c['predictor']}: no prefetch (each miss loads when the router asks)"
    else:
        look = f", {c['lookahead']} gate lookahead" if c["lookahead"] else ""
        predictor = f"{c['predictor']}, up to {c['max_loads']} loads per prediction{look}"
        adm = r.stats.get("admission")
        predictor += (", admission off (every predicted load)" if not adm else
                      f", admission: {adm['turned_off']} losing windows, {adm['probes']} "
                      f"probes, layers off at the end {adm['layers_off'] or 'none'}")
    return [
        ("experts' weights", c["weights_label"] + (", read in place from the checkpoint"
                                                   if c.get("in_place") else "")),
        ("resident linears", "native" if c["resident_weights"] == "native" else
         f"{c['resident_weights']} (lossy; native: {len(c['resident_kept'])} gates or "
         "matrices the kernel cannot take)"),
        ("tier", tier),
        ("cache", f"{c['capacity']} of {c['num_experts']} experts per layer "
                  f"({c['cache_bytes'] * mib:.1f} MiB), policy {c['policy']}"),
        *([("memory", MemoryPlan(**c["memory_plan"]).describe())] if c.get("memory_plan")
          else []),
        ("predictor", predictor),
        ("tokens", f"{r.prompt_tokens} prompt + {len(r.tokens)} generated"),
        ("time to first token", _spread(runs, "ttft_s", 1000) + " ms"),
        ("decode", _spread(runs, "decode_tokens_per_s") + " tokens/s"),
        ("hit rate (decode)", _spread(runs, "hit_rate", fmt=".3f")),
        ("prefetch recall / precision", _spread(runs, "prefetch_recall", fmt=".3f") + " / "
                                        + _spread(runs, "prefetch_precision", fmt=".3f")),
        ("bytes moved / wasted", _spread(runs, "bytes_moved", mib) + " / "
                                 + _spread(runs, "bytes_wasted", mib) + " MiB"),
        ("stall (decode)", _spread(runs, "stall_s", fmt=".3f") + " s, "
                           + _spread(runs, "stall_share", 100) + "% of decode time"),
        ("reads of the tier (decode)", _reads(runs, "demand") + " by the compute thread (its "
                                       "misses), " + _reads(runs, "prefetch") + " by the "
                                       "prefetch workers"),
    ]


def _reads(runs: list[Any], kind: str) -> str:
    """The decode's expert reads of ``kind`` ("demand", "prefetch"): how many and the mean
    time of one (median over the runs): the tier's speed as the run met it."""
    decode = [r.stats["phases"]["decode"] for r in runs]
    count = statistics.median(d[f"{kind}_reads"] for d in decode)
    times = [1000 * d[f"{kind}_read_s"] / d[f"{kind}_reads"] for d in decode if d[f"{kind}_reads"]]
    return f"{count:g}" + (f", {statistics.median(times):.2f} ms each" if times else "")
