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

from stmoe.util.fileio import atomic_write

DPI = 110


def _title(text: str, data: dict[str, Any]) -> str:
    return f"{text}  [SYNTHETIC]" if data["trace"]["synthetic"] else text


def save_figure(fig: plt.Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` atomically (PNG unless the suffix says otherwise) and close it."""
    fmt = path.suffix.lstrip(".") or "png"
    try:
        atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=DPI, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return path


_save = save_figure

# one colour and marker per predictor: eleven curves share one chart, so the default
# ten-colour cycle would give two predictors the same colour
PREDICTOR_STYLES = {
    "stmoe": ("#1f77b4", "o"),
    "stmoe-plus": ("#d62728", "s"),
    "hybrid": ("#9467bd", "D"),
    "gate-lookahead": ("#ff7f0e", "^"),
    "cct-online": ("#17becf", "v"),
    "cct-static": ("#8c564b", "<"),
    "previous-token": ("#e377c2", ">"),
    "frequency": ("#bcbd22", "p"),
    "random": ("#7f7f7f", "x"),
    "oracle": ("#2ca02c", "*"),
    "ondemand": ("#000000", "."),
    "stmoe-mix": ("#393b79", "h"),
}
# the bound dashed; gate-lookahead and cct-online broken: hybrid and stmoe nearly cover them
_LINESTYLES = {"oracle": "--", "gate-lookahead": ":", "cct-online": "-."}
_SPARE = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2")


def predictor_style(name: str, index: int = 0) -> tuple[str, str]:
    """(colour, marker) of a predictor; unknown names get spare colours by ``index``."""
    return PREDICTOR_STYLES.get(name, (_SPARE[index % len(_SPARE)], "o"))


def _legend_outside(ax: plt.Axes, **kwargs: Any) -> None:
    """The legend right of the axes, never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kwargs)


def _legend_below(fig: plt.Figure, axes: list[plt.Axes], ncol: int = 2) -> None:
    """One legend for several axes (twin axes), under the figure, never over the data."""
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol,
               fontsize=9, frameon=False)


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
                             squeeze=False, constrained_layout=True)
    vmax = max(int(co[pairs].max()), 1)
    image = None
    for ax, layer in zip(axes.flat, pairs, strict=False):
        image = ax.imshow(_by_use(co[layer]) + 0.5, norm=LogNorm(0.5, vmax + 0.5), cmap="viridis",
                          aspect="auto", interpolation="nearest")
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
                      cmap="viridis", aspect="auto", interpolation="nearest")
    ax.set_xlabel(f"expert at layer {layer + 1} (rank by use)")
    ax.set_ylabel(f"expert at layer {layer} (rank by use)")
    ax.set_title(_title(f"Co-activation, layers {layer} -> {layer + 1} (Cramér's V {v:.2f})", data))
    fig.colorbar(image, ax=ax, label="co-activations (tokens) + 0.5")
    return _save(fig, path)


# -log10 p is shown up to this: p-values of strongly dependent pairs underflow to ~1e-300,
# and an axis to 300 would flatten the p = 0.01 line (at 2) onto the floor
LOGP_CAP = 20.0


def spatial_tests(data: dict[str, Any], path: Path) -> Path:
    """Per layer pair: -log10 p (axis capped at ``LOGP_CAP``, capped bars say so) and
    Cramér's V, the effect size, which a p-value alone hides."""
    pairs = data["spatial"]["pairs"]
    s = data["spatial"]
    x = [p["layer"] for p in pairs]
    logp = np.array([-np.log10(max(p["p_value"], 1e-300)) for p in pairs])
    shown = np.minimum(logp, LOGP_CAP)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.8), sharex=True)
    ax1.bar(x, shown, color=["tab:blue" if p["significant"] else "tab:gray" for p in pairs])
    line = -np.log10(s["alpha"])
    ax1.axhline(line, color="tab:red", ls="--")
    ax1.text(1.01, line, f"p = {s['alpha']:g}", color="tab:red", va="center",
             transform=ax1.get_yaxis_transform())
    for xi, full, bar in zip(x, logp, shown, strict=True):
        label = f">{LOGP_CAP:.0f}\n({full:.0f})" if full > LOGP_CAP else f"{full:.1f}"
        ax1.text(xi, bar, label, ha="center", va="bottom", fontsize=7)
    ax1.set_ylim(0, LOGP_CAP * 1.3)
    ax1.set_ylabel(f"-log10 p (capped at {LOGP_CAP:.0f})")
    ax1.set_title(_title(f"Independence of adjacent layers: {s['pairs_significant']} of "
                         f"{s['pairs_total']} pairs reject at p < {s['alpha']:g}\n"
                         f"(bars above p = 1e-{LOGP_CAP:.0f} are cut at the cap; their full "
                         "-log10 p in brackets)", data), fontsize=10)
    ax2.bar(x, [p["cramers_v"] for p in pairs], color="tab:purple")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("Cramér's V (effect size,\n0 = independent, 1 = determined)")
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
    _legend_outside(ax, fontsize=9)
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
    _legend_outside(ax, fontsize=9)
    return _save(fig, path)


def load(data: dict[str, Any], path: Path) -> Path:
    counts = np.asarray(data["load"]["per_layer_counts"], dtype=float)
    ordered = -np.sort(-counts, axis=1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    image = ax1.imshow(ordered / np.maximum(ordered.sum(axis=1, keepdims=True), 1), aspect="auto",
                       cmap="magma", interpolation="nearest")
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
    _legend_below(fig, [ax2, twin])
    return _save(fig, path)


def domains(data: dict[str, Any], path: Path) -> Path:
    d = data["domains"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ("#8c564b", "#e377c2", "#7f7f7f", *_SPARE)  # not the bars' blue and green
    for i, (name, js) in enumerate(d["js_divergence_per_layer"].items()):
        ax1.plot(range(len(js)), js, "o-", color=colors[i % len(colors)], label=f"JS {name}")
    ax1.set_xlabel("MoE layer")
    ax1.set_ylabel("Jensen-Shannon divergence (bits)")
    ax1.set_title(_title("How differently domains use the experts", data))
    labels = d["labels"]
    ratios = [d["per_domain"][x]["overlap_ratio"] for x in labels]
    sig = [d["per_domain"][x]["pairs_significant"] / max(d["per_domain"][x]["pairs_total"], 1)
           for x in labels]
    pos = np.arange(len(labels))
    ax2.bar(pos - 0.2, ratios, 0.4, color="tab:blue", label="overlap ratio (x random)")
    twin = ax2.twinx()
    twin.bar(pos + 0.2, sig, 0.4, color="tab:green", label="share of pairs with p < 0.01")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("share of layer pairs rejecting independence")
    ax2.set_xticks(pos, labels)
    ax2.set_xlabel("domain")
    ax2.set_ylabel("consecutive-token overlap / (K^2/N)")
    ax2.set_title("Temporal and spatial evidence per domain")
    _legend_below(fig, [ax1, ax2, twin], ncol=3)
    return _save(fig, path)


def predictability(data: dict[str, Any], path: Path) -> Path:
    """Recall against the mean set size each budget gives: predictors compared at equal
    cost (a predictor whose rule names fewer experts stops where its sets stop growing)."""
    p = data["predictability"]
    k = data["trace"]["top_k"]
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    left_out = []
    for i, (name, curve) in enumerate(p["curves"].items()):
        if max(curve["set_size"], default=0) <= 0:
            left_out.append(name)  # predicts nothing: no curve to draw
            continue
        color, marker = predictor_style(name, i)
        ax.plot(curve["set_size"], curve["recall"], marker=marker, ms=4, color=color,
                ls=_LINESTYLES.get(name, "-"), label=name)
    for mult in (1, 2):
        ax.axvline(mult * k, color="0.6", ls=":", lw=1)
        ax.text(mult * k, 0.02, f" {mult}K" if mult > 1 else " K", color="0.4", fontsize=8)
    ax.set_xlabel("mean set size (experts per prediction and layer; each set cut to its "
                  "B highest-scored)")
    ax.set_ylabel("recall")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    skipped = f"; not drawn (set size 0): {', '.join(left_out)}" if left_out else ""
    ax.set_title(_title(f"Recall versus set size ({p['scope']}; profiled on "
                        f"{p['profiled_tokens']} tokens, replayed on {p['evaluated_tokens']}"
                        f"{skipped})", data), fontsize=10)
    _legend_outside(ax, fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)
