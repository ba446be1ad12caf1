"""The demo report's headline figure (matplotlib, headless): decode speed per system."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from stmoe.analysis.plots import save_figure
from stmoe.demo.text import verdict

# one colour per compared system, so the figure needs no legend (its x labels name them)
SYSTEM_COLORS = {
    "on-demand": "#7f7f7f",
    "lru-only": "#bcbd22",
    "stmoe": "#1f77b4",
    "stmoe-plus": "#d62728",
    "hybrid": "#9467bd",
    "oracle": "#2ca02c",
}


def tick(offload: dict[str, Any], name: str) -> str:
    """A bar's label: the system, and under a prefetching one its verdict against the LRU
    cache alone in plain words (``demo.text.verdict``, without its reason)."""
    if name in ("on-demand", "lru-only", "oracle") or "lru-only" not in offload["systems"]:
        return name
    return f"{name}\n" + "\n".join(textwrap.wrap(verdict(offload, name).split(":")[0], 12))


def decode_speed(offload: dict[str, Any], systems: list[str], path: Path) -> Path:
    """Bars: median decode tokens/s of ``systems``; whiskers: the rounds' min and max."""
    rows = [offload["systems"][n] for n in systems]
    med = [r["decode_tokens_per_s"] for r in rows]
    lo = [m - r["decode_tokens_per_s_range"][0] for m, r in zip(med, rows, strict=True)]
    hi = [r["decode_tokens_per_s_range"][1] - m for m, r in zip(med, rows, strict=True)]
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    pos = range(len(systems))
    ax.bar(pos, med, color=[SYSTEM_COLORS.get(n, "#17becf") for n in systems],
           yerr=[lo, hi], capsize=6, ecolor="black")
    top = max(r["decode_tokens_per_s_range"][1] for r in rows)
    for i, (m, h) in enumerate(zip(med, hi, strict=True)):
        ax.text(i, m + h + 0.02 * top, f"{m:.1f}", ha="center", va="bottom", fontsize=10)
    ax.set_ylim(0, 1.15 * top)
    ax.set_xticks(list(pos), [tick(offload, n) for n in systems])
    ax.set_ylabel("decode tokens/s (higher is faster)")
    same = "yes" if offload["identical_tokens"] else "NO"
    ax.set_title(
        f"Decode speed, experts offloaded ({offload['expert_mib']:.1f} MiB experts): "
        f"{offload['capacity']} of each layer's cached, EMULATED {offload['link']}/s link\n"
        f"median of {offload['rounds']} interleaved rounds "
        f"(whiskers: slowest and fastest round); same tokens as the reference: {same}\n"
        "under each prefetching system: its verdict against lru-only (faster or slower only "
        "when the ranges are apart)",
        fontsize=9.5,
    )
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)
