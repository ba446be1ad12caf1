"""The simulator's paper-style figures (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def _title(text: str, data: dict[str, Any]) -> str:
    synthetic = "  [SYNTHETIC TRACE]" if data["trace"]["synthetic"] else ""
    return f"{text}\n{data['model']} on {data['hardware']}, batch {data['batch']}{synthetic}"


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def normalized_time(data: dict[str, Any], path: Path) -> Path:
    """Stacked bars: compute and stall (exposed communication), GPU baseline = 1."""
    names = list(data["systems"])
    first = data["systems"][names[0]]
    base = first["time"] / first["normalized_time"]  # every system shares one baseline
    compute = np.array([data["systems"][n]["breakdown"]["compute"] / base for n in names])
    stall = np.array([data["systems"][n]["breakdown"]["stall"] / base for n in names])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) + 2), 4.5))
    ax.bar(names, compute, label="compute")
    ax.bar(names, stall, bottom=compute, label="stall (exposed data communication)")
    for i, n in enumerate(names):
        ax.text(i, compute[i] + stall[i], f"{data['systems'][n]['normalized_time']:.2f}",
                ha="center", va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylabel("execution time (GPU baseline = 1)")
    ax.set_xlabel("system")
    ax.set_title(_title("Normalized decode time", data))
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    return _save(fig, path)


def ablation(data: dict[str, Any], path: Path) -> Path:
    steps = data["ablation"]
    labels = list(steps)
    speedup = [steps[k]["speedup_vs_baseline"] for k in labels]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.bar(range(len(labels)), speedup, color="tab:green")
    for i, s in enumerate(speedup):
        ax.text(i, s, f"{s:.2f}x", ha="center", va="bottom")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("speedup over the static-dataflow baseline")
    ax.set_xlabel("ablation step")
    ax.set_title(_title("Ablation: dataflow, then the temporal and spatial tables", data))
    return _save(fig, path)


def sweep(result: dict[str, Any], data: dict[str, Any], path: Path, xlabel: str) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, ys in result["normalized_time"].items():
        ax.plot(result["values"], ys, "o-", label=name)
    if result["parameter"] == "link_bytes_per_s":
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("execution time (GPU baseline = 1)")
    ax.set_title(_title(f"Sweep of {xlabel}", data))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
