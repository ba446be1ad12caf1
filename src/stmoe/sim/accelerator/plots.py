"""The simulator's paper-style figures (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from stmoe.analysis.plots import save_figure as _save


def _title(text: str, data: dict[str, Any]) -> str:
    synthetic = "  [SYNTHETIC TRACE]" if data["trace"]["synthetic"] else ""
    return f"{text}\n{data['model']} on {data['hardware']}, batch {data['batch']}{synthetic}"


def lossy_note(result: dict[str, Any]) -> str | None:
    """Why a simulated system is lossy (it ran fewer experts than the router chose), or None."""
    q = result.get("quality") or {}
    if not q.get("dropped_gate_mass"):
        return None
    return (f"LOSSY: runs {q['experts_per_token_layer']:.2f} experts per token and layer, "
            f"dropping {q['dropped_gate_mass']:.1%} of the gate weight")


def normalized_time(data: dict[str, Any], path: Path) -> Path:
    """Stacked bars: compute and stall (exposed communication), GPU baseline = 1.

    A lossy system (Adaptive-Gating drops experts) is hatched and says so under its
    bar: its time is not comparable with the lossless systems' (it can beat the oracle)."""
    names = list(data["systems"])
    first = data["systems"][names[0]]
    base = first["time"] / first["normalized_time"]  # every system shares one baseline
    compute = np.array([data["systems"][n]["breakdown"]["compute"] / base for n in names])
    stall = np.array([data["systems"][n]["breakdown"]["stall"] / base for n in names])
    lossy = [lossy_note(data["systems"][n]) for n in names]
    hatch = ["//" if note else "" for note in lossy]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names) + 2), 4.8))
    ax.bar(names, compute, color="tab:blue", hatch=hatch, label="compute")
    ax.bar(names, stall, bottom=compute, color="tab:orange", hatch=hatch,
           label="stall (exposed data communication)")
    for i, n in enumerate(names):
        ax.text(i, compute[i] + stall[i], f"{data['systems'][n]['normalized_time']:.2f}",
                ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.15 * max(compute + stall))
    ax.set_xticks(range(len(names)), [f"{n}\n(LOSSY)" if note else n
                                      for n, note in zip(names, lossy, strict=True)])
    ax.set_ylabel("execution time (GPU baseline = 1)")
    ax.set_xlabel("system")
    ax.set_title(_title("Normalized decode time (lower is faster)", data))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=9)
    notes = [f"{n}: {note}; not comparable with the lossless systems"
             for n, note in zip(names, lossy, strict=True) if note]
    if notes:
        fig.text(0.01, -0.02, "\n".join(notes), ha="left", va="top", fontsize=9, color="darkred")
    return _save(fig, path)


def ablation(data: dict[str, Any], path: Path) -> Path:
    steps = data["ablation"]
    labels = list(steps)
    speedup = [steps[k]["speedup_vs_baseline"] for k in labels]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.bar(range(len(labels)), speedup, color="tab:green")
    ax.set_ylim(0, 1.15 * max(speedup))  # room for the labels above the bars
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
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, path)
