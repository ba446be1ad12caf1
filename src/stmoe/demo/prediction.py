"""The demo report's section 2, prediction quality: the predictors at equal set size
first (recall grows with set size, so only equal sizes compare), then each at its own
set size with its cache replay, the budget curve and the cross-domain matrix."""

from __future__ import annotations

from typing import Any

import numpy as np

from stmoe.analysis.report import html_text as _e
from stmoe.demo.text import defs, table
from stmoe.evaluate.equal_size import recall_at_set_size


def prediction_section(summary: dict[str, Any], per_domain: dict[str, Any],
                       analysis: dict[str, Any]) -> str:
    from stmoe.predictors import REGISTRY

    k, domains = summary["top_k"], list(per_domain)
    names = list(per_domain[domains[0]]["predictors"])

    def mean(name: str, get: Any, spec: str) -> str:
        """The mean over the domains where the figure is defined ('-' where none is)."""
        values = [v for d in domains if (v := get(per_domain[d]["predictors"][name])) is not None]
        return format(float(np.mean(values)), spec) if values else "-"

    def recall(domain: str, name: str) -> str:
        value = per_domain[domain]["predictors"][name]["recall"]
        return "-" if value is None else f"{value:.3f}"

    def about(name: str) -> str:
        doc = (getattr(REGISTRY.get(name), "__doc__", None) or "").strip()
        return doc.splitlines()[0].replace("``", "") if doc else ""

    rows = [[n, about(n), *(recall(d, n) for d in domains),
             mean(n, lambda e: e["set_size"], ".2f"), mean(n, lambda e: e["precision"], ".3f"),
             mean(n, lambda e: e["cache"]["hit_rate"], ".3f")] for n in names]
    scope = per_domain[domains[0]].get("scope", "decode tokens")
    parts = [
        "<h2>2. Prediction quality (replay of the recorded routing)</h2>",
        f"<p>Routing recorded from the shipped model on {summary['tokens']} tokens "
        f"({summary['decode_tokens']} generated) of {len(domains)} domains. Each domain's tables "
        "are profiled on the first half of its prompts; every predictor is replayed on the "
        f"other half ({_e(scope)}).</p>",
        *_at_equal_size(summary, about),
        defs([
            ("K", f"experts the router picks per token and layer (top-K; here K = {k} of "
             f"{summary['num_experts']})."),
            ("recall", "share of the experts the router chose that the prediction named."),
            ("set size", "experts one prediction names per layer (mean); a larger set buys "
             "recall with link traffic, so recall alone flatters big sets."),
        ]),
        "<h3>Each predictor at its own set size</h3><p>Recall here is not comparable between "
        "predictors of different set sizes (the table above is); the cache replay shows what "
        "each one's sets cost.</p>",
        table(["predictor", "what it predicts", *(f"recall: {d}" for d in domains),
               "set size", "precision", "hit rate (2K cache)"], rows, left=(1,)),
        defs([
            ("precision", "share of the named experts the router chose (mean over domains)."),
            ("hit rate (2K cache)", f"share of the needed experts found in a per-layer LRU "
             f"cache of 2K = {2 * k} experts fed by the predictor's prefetches (mean over "
             "domains)."),
        ]),
    ]
    parts += _budget_curve(analysis, k)
    matrix = summary["cross_domain"]
    cross = [[a, *("-" if x is None else f"{x:.3f}" for x in row)]
             for a, row in zip(matrix["profiled_on"], matrix["recall"], strict=True)]
    parts += [
        "<h3>Cross-domain recall of ST-MoE</h3><p>Tables profiled on one domain (rows), "
        "replayed on another (columns).</p>",
        table(["profiled on / evaluated on", *matrix["evaluated_on"]], cross),
    ]
    return "".join(parts)


def equal_rows(summary: dict[str, Any]) -> tuple[list[str], list[tuple[str, list[str], str]]]:
    """The equal-set-size table's domains and rows: (predictor, its recall per domain at
    that domain's ST-MoE set size ('-': its sets never get that large), its mean gain on
    ST-MoE in points over the domains where it has a figure). The CLI prints the same."""
    equal = summary["equal_set_size"]
    domains = list(equal)
    names = list(next(iter(equal.values()))["recall"])
    rows = []
    for n in names:
        vals = [equal[d]["recall"].get(n) for d in domains]
        gains = [100 * (v - equal[d]["recall"][equal[d]["reference"]])
                 for d, v in zip(domains, vals, strict=True) if v is not None]
        gain = "" if n == "stmoe" or not gains else f"{np.mean(gains):+.1f}"
        rows.append((n, ["-" if v is None else f"{v:.3f}" for v in vals], gain))
    return domains, rows


def _at_equal_size(summary: dict[str, Any], about: Any) -> list[str]:
    domains, rows = equal_rows(summary)
    equal = summary["equal_set_size"]
    sizes = ", ".join(f"{d} {equal[d]['set_size']:.2f}" for d in domains)
    return [
        "<h3>At equal set size: compare predictors here</h3>",
        "<p>Recall grows with the experts a prediction names, so every predictor is read at "
        f"one set size per domain, ST-MoE's own mean ({_e(sizes)} experts): each prediction "
        "cut to its best experts, recall read off its recall-versus-budget curve ('-': its "
        "sets never get that large).</p>",
        table(["predictor", "what it predicts", *(f"recall: {d}" for d in domains),
               "vs ST-MoE (points, mean)"],
              [[n, about(n), *vals, gain] for n, vals, gain in rows], left=(1,)),
    ]


def _budget_curve(analysis: dict[str, Any], k: int) -> list[str]:
    p = analysis.get("predictability")
    if not p:
        return []
    own = p["set_size"].get("stmoe")
    sizes = [("K", float(k)), *([("ST-MoE's own", own)] if own else []), ("2K", 2.0 * k)]
    rows = []
    for n, curve in p["curves"].items():
        if max(curve["set_size"], default=0) <= 0:
            continue  # predicts nothing
        vals = [recall_at_set_size(curve, s) for _, s in sizes]
        rows.append([n, *("-" if v is None else f"{v:.3f}" for v in vals)])
    text = ""
    if own and "stmoe-plus" in p["curves"]:
        a = recall_at_set_size(p["curves"]["stmoe-plus"], own)
        b = recall_at_set_size(p["curves"]["stmoe"], own)
        if a is not None and b is not None:
            text = (
                f" At ST-MoE's own mean set size ({own:.2f} experts), stmoe-plus recalls "
                f"{a:.3f} against ST-MoE's {b:.3f}"
            )
            if a > b and p["set_size"].get("stmoe-plus", own) < own:
                text += (
                    f": at equal set size it predicts better; at its default set size "
                    f"({p['set_size']['stmoe-plus']:.2f}, fewer experts than ST-MoE's) "
                    "its recall can look lower"
                )
            text += "."
    return [
        "<h3>Recall at other set sizes: the budget curve</h3>",
        "<p>Every prediction cut to its B highest-scored experts, B = 1..4K; recall is read at "
        "the same mean set size for every predictor ('-': its sets never get that large). "
        f"Tables profiled on the first half of the whole trace, replayed on the second "
        f"({p['evaluated_tokens']} tokens), so the figures differ a little from the "
        f"per-domain tables.{_e(text)}</p>",
        table(["predictor", *(f"recall at set size {lab} ({s:.2f})" for lab, s in sizes)], rows),
        "<figure><img src='analysis/predictability.png' alt='Recall versus set size'>"
        "<figcaption>Recall against mean set size, one colour and marker per predictor."
        "</figcaption></figure>",
    ]


