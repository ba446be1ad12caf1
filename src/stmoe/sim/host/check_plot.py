"""The simulator checked against the runtime: simulated against measured decode speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from stmoe.analysis.plots import save_figure


def sim_vs_measured(checks: dict[str, list[dict[str, Any]]], title: str, path: Path,
                    tolerance: float = 0.2) -> Path:
    """One point per system and check (label -> rows: a hardware preset's simulation):
    measured decode tokens/s (median, with its [min, max] range) against simulated; the
    diagonal and the +-``tolerance`` band."""
    fig, ax = plt.subplots(figsize=(5.6, 5.0))
    every = [r for rows in checks.values() for r in rows]
    top = 1.25 * max(max(r["measured"], r["simulated"], r["range"][1]) for r in every)
    line = np.linspace(0, top, 50)
    ax.fill_between(line, line * (1 - tolerance), line * (1 + tolerance), color="0.9",
                    label=f"within {tolerance:.0%}")
    ax.plot(line, line, color="0.5", lw=1)
    for (label, rows), marker in zip(checks.items(), "os^D", strict=False):
        ax.plot([], [], marker, color="0.3", label=label)  # the check's marker, in the legend
        for i, r in enumerate(rows):  # one colour per system, the same in every check
            low, high = r["range"]
            ax.errorbar(r["measured"], r["simulated"], xerr=[[r["measured"] - low],
                        [high - r["measured"]]], fmt=marker, capsize=3, color=f"C{i}")
            if marker == "o":
                ax.annotate(r["system"], (r["measured"], r["simulated"]),
                            textcoords="offset points", xytext=(6, -10), fontsize=8)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured decode tokens/s (runtime; median, range)")
    ax.set_ylabel("simulated decode tokens/s (stmoe simulate --pipeline runtime)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    return save_figure(fig, path)
