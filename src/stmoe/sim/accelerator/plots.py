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


def region(results: list[dict[str, Any]], path: Path, columns: int = 4) -> Path:
    """Heatmaps of how many of the paper's five claims hold (``region.sweep_region``'s
    rows): a row of panels per trace, one panel per buffer size (the smallest, 1, and
    the two largest), link bandwidth across, PE array up; hatched where no 40 nm-era
    chip could be (``region.Plausible``), a star where all five hold."""
    fig, axes = plt.subplots(len(results), columns, figsize=(3.1 * columns, 2.5 * len(results)),
                             squeeze=False, sharey=True)
    image = None
    for i_row, (row, result) in enumerate(zip(axes, results, strict=True)):
        rows = result["rows"]
        bws = sorted({r["link_bytes_per_s"] for r in rows})
        pes = sorted({r["pe_macs_per_cycle"] for r in rows})
        caps = sorted({r["cache_experts_per_layer"] for r in rows})
        shown = caps[:columns]
        for ax, cap in zip(row, shown, strict=False):
            met = np.zeros((len(pes), len(bws)))
            for r in rows:
                if r["cache_experts_per_layer"] != cap:
                    continue
                i, j = pes.index(r["pe_macs_per_cycle"]), bws.index(r["link_bytes_per_s"])
                met[i, j] = r["met"]
                if not r["plausible"]:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                                               hatch="///", linewidth=0, color="0.35"))
                if r["met"] == 5:
                    ax.plot(j, i, marker="*", color="black", markersize=9)
            image = ax.imshow(met, origin="lower", cmap="viridis", vmin=0, vmax=5, aspect="auto")
            bottom = i_row == len(results) - 1  # tick labels on the last row only: shared
            ax.set_xticks(range(len(bws)), [f"{b / 1e9:.0f}" for b in bws] if bottom else [],
                          rotation=60, fontsize=7)
            ax.set_yticks(range(len(pes)), [f"{p:.0f}" for p in pes], fontsize=7)
            mm2 = next(r["buffer_mm2"] for r in rows if r["cache_experts_per_layer"] == cap)
            ax.set_title(f"buffer {cap}/layer ({mm2:,.0f} mm2)", fontsize=8)
        row[0].set_ylabel(result["trace"], fontsize=8)
        for ax in row[len(shown):]:
            ax.axis("off")
    fig.supxlabel("link bandwidth (GB/s)")
    fig.supylabel("PE array (MACs per cycle), one row per trace")
    rule = results[0]["buffer_for"] if results else "?"
    fig.suptitle("how many of the paper's five claims hold (star: all five; hatched: beyond "
                 f"a 40 nm-era chip)\nstmoe-asic swept; buffer kept by: {rule}", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="claims met (of 5)")
    return _save(fig, path)


def buffer_curves(result: dict[str, Any], path: Path, pe: float, links: list[float]) -> Path:
    """The headline ratios and the ablation against the expert buffer's size, one panel
    per link bandwidth, at one PE array (``region.sweep_region``'s rows of one trace)."""
    rows = [r for r in result["rows"] if r["pe_macs_per_cycle"] == pe]
    fig, axes = plt.subplots(2, len(links), figsize=(3.6 * len(links), 6.0), squeeze=False,
                             sharey="row", layout="constrained")
    for col, link in enumerate(links):
        pts = sorted((r for r in rows if r["link_bytes_per_s"] == link),
                     key=lambda r: r["cache_experts_per_layer"])
        caps = [r["cache_experts_per_layer"] for r in pts]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(caps, [r["figures"]["stmoe_vs_gpu"] for r in pts], "o-", label="ST-MoE / GPU")
        top.plot(caps, [1 / r["figures"]["pregated_vs_stmoe"] for r in pts], "s-",
                 label="ST-MoE / Pre-gated")
        top.axhline(0.45, color="0.5", linestyle=":", label="claim: 0.45 / 0.77")
        top.axhline(1 / 1.3, color="0.5", linestyle=":")
        top.set_title(f"link {link / 1e9:.0f} GB/s, PE {pe:.0f} MACs", fontsize=9)
        steps = np.array([r["figures"]["ablation"] for r in pts])
        for i, label in enumerate(("static", "dynamic dataflow", "+ temporal (HT)",
                                   "+ spatial (CCT)")):
            bottom.plot(caps, steps[:, i], "o-", label=label)
        for ax in (top, bottom):
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xlim(left=-0.3)
            ax.set_xlabel("buffer (experts per layer)")
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("time ratio (lower: ST-MoE faster)")
    axes[1][0].set_ylabel("ablation: speed-up over the GPU baseline")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(f"{result['trace']}: the paper's ratios and ablation against the buffer "
                 f"(kept by: {result['buffer_for']})", fontsize=10)
    return _save(fig, path)
