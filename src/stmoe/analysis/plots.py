"""The report's figures (matplotlib, headless). Every axis is labelled; heatmaps have
colour bars; synthetic data says so in the title."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm

DPI = 110


def _title(text: str, data: dict[str, Any]) -> str:
    return f"{text}  [SYNTHETIC]" if data["trace"]["synthetic"] else text


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _by_use(matrix: np.ndarray) -> np.ndarray:
    """Rows and columns ordered by how often the expert is used, so structure shows."""
    rows = np.argsort(-matrix.sum(axis=1), kind="stable")
    cols = np.argsort(-matrix.sum(axis=0), kind="stable")
    return matrix[rows][:, cols]


def coactivation_grid(co: np.ndarray, data: dict[str, Any], path: Path, most: int = 16) -> Path:
    """Small heatmaps of co[l] (expert at l vs expert at l+1) for up to ``most`` pairs."""
    pairs = np.unique(np.linspace(0, len(co) - 1, min(most, len(co))).round().astype(int))
    cols = int(np.ceil(np.sqrt(len(pairs))))
    rows = int(np.ceil(len(pairs) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols + 1.2, 2.3 * rows + 0.8),
                             squeeze=False, constrained_layout=True)  # fmt: skip
    vmax = max(int(co[pairs].max()), 1)
    image = None
    for ax, layer in zip(axes.flat, pairs, strict=False):
        image = ax.imshow(_by_use(co[layer]) + 0.5, norm=LogNorm(0.5, vmax + 0.5), cmap="viridis",
                          aspect="auto", interpolation="nearest")  # fmt: skip
        ax.set_title(f"layer {layer} -> {layer + 1}", fontsize=9)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(pairs) :]:
        ax.axis("off")
    fig.supxlabel("expert at layer l+1 (rank by use)")
    fig.supylabel("expert at layer l (rank by use)")
    fig.suptitle(_title("Cross-layer co-activation (tokens per expert pair, log scale)", data))
    fig.colorbar(image, ax=axes, shrink=0.8, label="co-activations (tokens) + 0.5")
    return _save(fig, path)


def coactivation_example(
    co: np.ndarray, layer: int, v: float, data: dict[str, Any], path: Path
) -> Path:
    """One pair large: rows sorted by use so structure stands out."""
    matrix = co[layer]
    fig, ax = plt.subplots(figsize=(7.5, 6.2))
    image = ax.imshow(_by_use(matrix) + 0.5, norm=LogNorm(0.5, matrix.max() + 0.5),
                      cmap="viridis", aspect="auto", interpolation="nearest")  # fmt: skip
    ax.set_xlabel(f"expert at layer {layer + 1} (rank by use)")
    ax.set_ylabel(f"expert at layer {layer} (rank by use)")
    ax.set_title(_title(f"Co-activation, layers {layer} -> {layer + 1} (Cramér's V {v:.2f})", data))
    fig.colorbar(image, ax=ax, label="co-activations (tokens) + 0.5")
    return _save(fig, path)


def spatial_tests(data: dict[str, Any], path: Path) -> Path:
    pairs = data["spatial"]["pairs"]
    x = [p["layer"] for p in pairs]
    logp = [-np.log10(max(p["p_value"], 1e-300)) for p in pairs]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ax1.bar(x, logp, color=["tab:blue" if p["significant"] else "tab:gray" for p in pairs])
    ax1.axhline(-np.log10(data["spatial"]["alpha"]), color="tab:red", ls="--", label="p = 0.01")
    ax1.set_ylabel("-log10 p-value")
    ax1.legend(loc="upper right")
    s = data["spatial"]
    ax1.set_title(_title(f"Independence of adjacent layers: {s['pairs_significant']} of "
                         f"{s['pairs_total']} pairs reject at p < 0.01", data))  # fmt: skip
    ax2.bar(x, [p["cramers_v"] for p in pairs], color="tab:purple")
    ax2.set_ylabel("Cramér's V (effect size)")
    ax2.set_xlabel("layer pair (l, l+1), by l")
    return _save(fig, path)


def temporal_overlap(data: dict[str, Any], path: Path) -> Path:
    t = data["temporal"]
    layers = [p["layer"] for p in t["per_layer"]]
    means = np.array([p["overlap"] for p in t["per_layer"]])
    ci = np.array([p["ci"] for p in t["per_layer"]])
    err = np.abs(np.vstack([means - ci[:, 0], ci[:, 1] - means]))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.errorbar(
        layers, means, yerr=np.nan_to_num(err), fmt="o-", capsize=3, label="observed (95% CI)"
    )
    ax.axhline(t["expected_overlap"], color="tab:red", ls="--", label="random routing, K^2/N")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("experts shared with the previous token")
    ax.set_title(_title(f"Consecutive-token overlap: {t['overlap_ratio']:.2f}x random", data))
    ax.legend()
    return _save(fig, path)


def reuse_distance(data: dict[str, Any], path: Path) -> Path:
    r = data["temporal"]["reuse_distance"]
    counts = np.asarray(r["count"], dtype=float)
    share = counts / max(counts.sum(), 1)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(r["distance"], share, label="observed")
    ax.plot(r["distance"], r["random_expectation_share"], "r--", label="random routing (geometric)")
    ax.set_yscale("log")
    last = r["last_bin_is_at_least"]
    ax.set_xlabel(f"tokens until the expert returns at the same layer (last bar: >= {last})")
    ax.set_ylabel("share of returns")
    ax.set_title(_title("Reuse distance", data))
    ax.legend()
    return _save(fig, path)


def load(data: dict[str, Any], path: Path) -> Path:
    counts = np.asarray(data["load"]["per_layer_counts"], dtype=float)
    ordered = -np.sort(-counts, axis=1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    image = ax1.imshow(ordered / np.maximum(ordered.sum(axis=1, keepdims=True), 1), aspect="auto",
                       cmap="magma", interpolation="nearest")  # fmt: skip
    ax1.set_xlabel("expert rank at that layer (most used first)")
    ax1.set_ylabel("MoE layer")
    ax1.set_title(_title("Expert use per layer", data))
    fig.colorbar(image, ax=ax1, label="share of the layer's routings")
    layers = np.arange(len(counts))
    ax2.plot(layers, data["load"]["max_over_mean"], "o-", label="max / mean use")
    ax2.set_xlabel("MoE layer")
    ax2.set_ylabel("max / mean use")
    twin = ax2.twinx()
    twin.plot(layers, data["load"]["top10_share"], "s-", color="tab:orange", label="top 10% share")
    twin.set_ylabel("traffic share of the top 10% of experts")
    ax2.set_title("Load skew")
    ax2.legend(loc="upper left")
    twin.legend(loc="upper right")
    return _save(fig, path)


def domains(data: dict[str, Any], path: Path) -> Path:
    d = data["domains"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, js in d["js_divergence_per_layer"].items():
        ax1.plot(range(len(js)), js, "o-", label=name)
    ax1.set_xlabel("MoE layer")
    ax1.set_ylabel("Jensen-Shannon divergence (bits)")
    ax1.set_title(_title("How differently domains use the experts", data))
    ax1.legend(fontsize=8)
    labels = d["labels"]
    ratios = [d["per_domain"][x]["overlap_ratio"] for x in labels]
    sig = [d["per_domain"][x]["pairs_significant"] / max(d["per_domain"][x]["pairs_total"], 1)
           for x in labels]  # fmt: skip
    pos = np.arange(len(labels))
    ax2.bar(pos - 0.2, ratios, 0.4, label="overlap ratio (x random)")
    twin = ax2.twinx()
    twin.bar(pos + 0.2, sig, 0.4, color="tab:green", label="share of pairs with p < 0.01")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("share of layer pairs rejecting independence")
    ax2.set_xticks(pos, labels)
    ax2.set_xlabel("domain")
    ax2.set_ylabel("consecutive-token overlap / (K^2/N)")
    ax2.set_title("Temporal and spatial evidence per domain")
    ax2.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    return _save(fig, path)


def predictability(data: dict[str, Any], path: Path) -> Path:
    p = data["predictability"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, curve in p["curves"].items():
        ax.plot(curve["budget"], curve["recall"], "o-", ms=3, label=name)
    ax.set_xlabel("prefetch budget B (experts per layer, highest scores first)")
    ax.set_ylabel("recall")
    ax.set_ylim(0, 1.02)
    ax.set_title(_title(f"Recall versus budget ({p['scope']}; profiled on "
                        f"{p['profiled_tokens']} tokens, replayed on {p['evaluated_tokens']})",
                        data))  # fmt: skip
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)
