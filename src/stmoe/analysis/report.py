"""``stmoe analyze``: figures, a Markdown and an HTML report, and the JSON, in one folder.

The report is built once as a list of sections, then rendered twice, so the
Markdown and the HTML always say the same thing.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.analysis import plots
from stmoe.analysis.evidence import analyze
from stmoe.analysis.stats import ALPHA
from stmoe.evaluate.equal_size import recall_at_set_size
from stmoe.predictors.tables import cooccurrence
from stmoe.trace.schema import RoutingTrace
from stmoe.util.fileio import atomic_write_text


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (file name, caption)
    table: tuple[list[str], list[list[str]]] | None = None


def write_report(
    trace: RoutingTrace, out_dir: str | Path, *, with_json: bool = False
) -> dict[str, Any]:
    """Analyse ``trace`` and write report.md, report.html, figures (and analysis.json)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = analyze(trace)
    sections = _sections(data, trace, out)
    title = f"Routing analysis: {data['trace']['model']}" + (
        " [SYNTHETIC DATA]" if data["trace"]["synthetic"] else ""
    )
    atomic_write_text(out / "report.md", _markdown(title, sections))
    atomic_write_text(out / "report.html", _html(title, sections))
    if with_json:
        atomic_write_text(out / "analysis.json", json.dumps(data, indent=1) + "\n")
    return data


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x:.{digits}g}"


def _sections(data: dict[str, Any], trace: RoutingTrace, out: Path) -> list[Section]:
    t, s, tmp, ld = data["trace"], data["spatial"], data["temporal"], data["load"]
    co = cooccurrence(trace)
    lo, hi = tmp["overlap_ratio_ci"]
    summary = Section("Summary", [
        f"Trace: {t['tokens']} tokens ({t['decode_tokens']} decode) in {t['sequences']} "
        f"sequence(s); {t['layers']} MoE layers, top-{t['top_k']} of {t['num_experts']} experts."
        + (" **Synthetic data: not a real model's routing.**" if t["synthetic"] else ""),
        f"**Spatial**: {s['pairs_significant']} of {s['pairs_total']} adjacent layer pairs "
        f"reject independence at p < {s['alpha']} (about {s['expected_false_positives']:.2f} "
        "would by chance if layers were independent).",
        f"**Temporal**: consecutive tokens share {tmp['overlap']:.2f} experts per layer on "
        f"average, {tmp['overlap_ratio']:.2f}x the {tmp['expected_overlap']:.3g} of random "
        f"routing (95% CI {_fmt(lo)}-{_fmt(hi)}x)." if tmp["token_pairs"] else
        "**Temporal**: no evidence: no sequence holds two tokens, so there are no consecutive "
        "pairs to compare.",
        f"**Load**: the top 10% of experts carry {np.mean(ld['top10_share']):.0%} of the "
        f"routings on average; max/mean use {np.mean(ld['max_over_mean']):.2f}.",
    ])
    sections = [summary]
    if len(co):
        best = max(s["pairs"], key=lambda p: p["cramers_v"])
        plots.coactivation_grid(co, data, out / "spatial_grid.png")
        plots.coactivation_example(
            co, best["layer"], best["cramers_v"], data, out / "spatial_example.png"
        )
        plots.spatial_tests(data, out / "spatial_tests.png")
        sections.append(Section(
            "Spatial (cross-layer) correlation",
            ["Each token is one observation: the experts it chose at layer l and at l+1. "
             "The test statistic is T times the sum of squared canonical correlations between "
             "the two sets' category counts (Pearson's chi-square when K = 1), chi-square with "
             "the printed degrees of freedom under independence. Sparse counts: the rarest "
             "experts of each side are pooled into one 'other' category until every expected "
             "count of the co-activation table is at least 5; never-chosen experts are dropped "
             "(columns 'kept' and "
             "'pooled'). Tokens are treated as independent, so strong temporal correlation makes "
             "p-values optimistic."],
            [("spatial_grid.png", "Co-activation counts for a grid of layer pairs."),
             ("spatial_example.png", f"The pair with the largest effect, layers {best['layer']} "
                                     f"and {best['layer'] + 1}."),
             ("spatial_tests.png", "p-value and effect size per layer pair.")],
            (["pair", "chi-square", "dof", "p-value", "Cramér's V", "kept (l / l+1)",
              "pooled (l / l+1)"],
             [[f"{p['layer']}-{p['layer'] + 1}", _fmt(p["statistic"], 4), str(p["dof"]),
               _fmt(p["p_value"], 2), _fmt(p["cramers_v"], 2),
               f"{p['rows_kept']} / {p['cols_kept']}", f"{p['rows_pooled']} / {p['cols_pooled']}"]
              for p in s["pairs"]]),
        ))
    plots.temporal_overlap(data, out / "temporal_overlap.png")
    plots.reuse_distance(data, out / "reuse_distance.png")
    sections.append(Section(
        "Temporal (cross-token) correlation",
        [f"Random top-{t['top_k']} routing over {t['num_experts']} experts shares K^2/N = "
         f"{tmp['expected_overlap']:.3g} experts between two tokens. Confidence intervals use the "
         "method of batch means over the token sequence, which allows for autocorrelation. "
         "'vs load' divides by the overlap independent tokens would show given each layer's "
         "observed expert use, separating stickiness from skew."],
        [("temporal_overlap.png", "Overlap with the previous token, per layer."),
         ("reuse_distance.png", "Tokens until an expert returns at the same layer.")],
        (["layer", "overlap", "95% CI", "x random", "x load-matched"],
         [[str(p["layer"]), _fmt(p["overlap"]), f"{_fmt(p['ci'][0])}-{_fmt(p['ci'][1])}",
           _fmt(p["ratio"]), _fmt(p["ratio_vs_load"])] for p in tmp["per_layer"]]),
    ))
    plots.load(data, out / "load.png")
    sections.append(
        Section("Load and skew", [], [("load.png", "Expert use and skew per layer.")])
    )
    if data["domains"]:
        d = data["domains"]
        plots.domains(data, out / "domains.png")
        sections.append(Section(
            "Domains", ["Jensen-Shannon divergence (bits, 0 = same use, 1 = disjoint) between "
                           "each pair of domains' expert use, per layer."],
            [("domains.png", "Domain differences.")],
            (["domain", "tokens", f"pairs with p < {ALPHA}", "overlap ratio"],
             [[x, str(v["tokens"]), f"{v['pairs_significant']} / {v['pairs_total']}",
               _fmt(v["overlap_ratio"])] for x, v in d["per_domain"].items()]),
        ))
    if data["predictability"]:
        p, k = data["predictability"], t["top_k"]
        plots.predictability(data, out / "predictability.png")
        sections.append(Section(
            "Predictability",
            [f"Tables profiled on the first {p['profiled_tokens']} tokens, predictors replayed on "
             f"the other {p['evaluated_tokens']} ({p['scope']}). Recall: the share of the "
             "experts the router chose that the prediction named; set size: the experts one "
             "prediction names (per layer). A larger set buys recall with link traffic, so "
             "predictors are compared at equal mean set size: each curve cuts every prediction "
             "to its B highest-scored experts (B = 1..4K) and plots recall against the mean "
             "set size that gives; stmoe-plus, hybrid, gate-lookahead, frequency and random "
             "rank 4K experts for their curves. The table gives each predictor at its default "
             "set size, then at mean set sizes K and 2K ('-': its sets never get that large)."
             + (f" Not replayed: {', '.join(p['skipped_rank_order'])}, which read the router's "
                "rank order inside a row; this trace's rows are sets (its source did not keep "
                "that order)." if p.get("skipped_rank_order") else "")],
            [("predictability.png", "Recall versus mean set size.")],
            (["predictor", "recall", "mean set size", f"recall at set size K = {k}",
              f"at 2K = {2 * k}"],
             [[n, _fmt(p["recall"][n]), _fmt(p["set_size"][n]),
               _fmt(recall_at_set_size(p["curves"][n], k)),
               _fmt(recall_at_set_size(p["curves"][n], 2 * k))] for n in p["recall"]]),
        ))
    # numbered as shown: a trace without domains (or pairs) leaves no gap
    return [summary] + [dataclasses.replace(sec, title=f"{i}. {sec.title}")
                        for i, sec in enumerate(sections[1:], start=1)]


def _markdown(title: str, sections: list[Section]) -> str:
    lines = [f"# {title}", ""]
    for sec in sections:
        lines += [f"## {sec.title}", ""]
        for para in sec.text:
            lines += [para, ""]
        for name, caption in sec.figures:
            lines += [f"![{caption}]({name})", "", f"*{caption}*", ""]
        if sec.table:
            head, rows = sec.table
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
    return "\n".join(lines)


# control characters (a label's terminal escapes) have no place in HTML: dropped
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def html_text(text: object) -> str:
    """``text`` for HTML: control characters dropped, markup escaped."""
    return html.escape(_CONTROL.sub("", str(text)))


_text = html_text


def _html(title: str, sections: list[Section]) -> str:
    def para(text: str) -> str:
        parts = _text(text).split("**")
        return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))

    body = [f"<h1>{_text(title)}</h1>"]
    for sec in sections:
        body.append(f"<h2>{_text(sec.title)}</h2>")
        body += [f"<p>{para(p)}</p>" for p in sec.text]
        for name, caption in sec.figures:
            body.append(f'<figure><img src="{name}" alt="{_text(caption)}">'
                        f"<figcaption>{_text(caption)}</figcaption></figure>")
        if sec.table:
            head, rows = sec.table
            body.append("<table><tr>" + "".join(f"<th>{_text(h)}</th>" for h in head) + "</tr>")
            body += ["<tr>" + "".join(f"<td>{_text(c)}</td>" for c in r) + "</tr>" for r in rows]
            body.append("</table>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.45}"
             "img{max-width:100%}table{border-collapse:collapse;font-size:0.9em}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
             "figcaption{font-style:italic;color:#555}")
    head = f"<meta charset='utf-8'><title>{_text(title)}</title><style>{style}</style>"
    return f"<!doctype html><html><head>{head}</head><body>{''.join(body)}</body></html>\n"
