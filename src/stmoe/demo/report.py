"""The demo's report page, ``DIR/index.html``: the headline first, every metric defined
where it first appears, and nothing fetched from outside the folder (it reads offline).

The figures behind the words are the demo's JSON files in the same folder; every
sentence that explains a result is built from those numbers, so it stays true when
they change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stmoe.analysis.report import html_text as _e
from stmoe.demo.prediction import prediction_section
from stmoe.demo.text import (
    MODEL_CARD_HTML,
    ablation_reasons,
    copy_model_card,
    defs,
    details,
    headline,
    shipped_line,
    table,
)
from stmoe.evaluate.systems import HEADLINE_SYSTEMS, SYSTEM_DESCRIPTIONS
from stmoe.util.fileio import atomic_write_text

# what each simulated system is (stmoe/sim/systems.py's docstring, one line each)
SIM_DESCRIPTIONS = {
    "gpu-baseline": "on-demand loading, one fixed dataflow (a GPU-style engine)",
    "adap-gating": "the baseline, but a token keeps only its top experts up to 80% of the "
    "gate weight",
    "pregated": "a trained pre-gate names layer l+1's experts at layer l (as Pre-gated MoE)",
    "stmoe": "the ST-MoE predictor on the EPU, reconfigurable dataflow",
    "oracle": "the true next set, no prediction latency: the bound",
}
_STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}"
    "img{max-width:100%}figure{margin:1em 0}figcaption{color:#555;font-style:italic}"
    "table{border-collapse:collapse;margin:.5em 0;font-size:.9em}"
    "td,th{border:1px solid #ccc;padding:2px 8px;vertical-align:top}td{text-align:right}"
    "td:first-child,th:first-child{text-align:left}td.l{text-align:left}"
    ".headline{font-size:1.2em;background:#eef5ff;border-left:4px solid #1f77b4;padding:.6em 1em}"
    "dl.defs{font-size:.9em;color:#333;margin:.3em 0 1em}dl.defs dt{font-weight:bold;"
    "float:left;clear:left;margin-right:.5em}dl.defs dd{margin:0 0 .15em 0}"
    "pre{font-family:monospace;background:#f6f8fa;border:1px solid #ddd;padding:.6em;"
    "white-space:pre-wrap;overflow-wrap:anywhere}pre .prompt{color:#777}"
    ".lossy{color:#a00;font-weight:bold}.note{color:#555;font-size:.9em}"
)


def write_index(out: Path, summary: dict[str, Any], per_domain: dict[str, Any],
                analysis: dict[str, Any], sim: dict[str, Any],
                samples: list[tuple[str, str, str]]) -> Path:
    """Draw the headline figure, copy the model card beside it and write ``out/index.html``."""
    from stmoe.demo.plots import decode_speed

    off = summary["offload"]
    decode_speed(off, [n for n in (*HEADLINE_SYSTEMS, "stmoe-plus-all") if n in off["systems"]],
                 out / "decode_speed.png")
    card = copy_model_card(out)
    parts = [
        "<h1>stmoe demo: ST-MoE expert prefetching on stmoe's own small MoE model</h1>",
        f"<p class='headline' id='headline'><b>Headline.</b> {_e(headline(off))}</p>",
        "<figure><img src='decode_speed.png' alt='Decode speed per system'><figcaption>Decode "
        "tokens/s of the offloaded model per system (bars: median; whiskers: slowest and "
        "fastest round; under each prefetching system, its verdict against the LRU cache "
        "alone: 'faster' or 'slower' only when the rounds' ranges are apart).</figcaption>"
        "</figure>",
        f"<p>{_e(details(off))}</p>",
        _links(card),
        _offload(summary),
        prediction_section(summary, per_domain, analysis),
        _correlation(analysis),
        _simulator(sim),
        _generated(summary, samples, card),
    ]
    head = f"<meta charset='utf-8'><title>stmoe demo</title><style>{_STYLE}</style>"
    body = "".join(parts)
    page = f"<!doctype html><html lang='en'><head>{head}</head><body>{body}</body></html>\n"
    return atomic_write_text(out / "index.html", page)


def _links(card: bool) -> str:
    model = (
        f"<a href='{MODEL_CARD_HTML}'>the model card</a>"
        if card
        else "the model card (docs/model-card.md in stmoe's source; not in this install)"
    )
    return (
        f"<p>More: {model} · <a href='analysis/report.html'>the full analysis report</a> · "
        "the numbers behind every table: <a href='offload.json'>offload.json</a> (the "
        "headline's), <a href='offload-shipped.json'>offload-shipped.json</a>, "
        "<a href='eval.json'>eval.json</a>, <a href='analysis/analysis.json'>analysis.json"
        "</a>, <a href='simulator/simulate.json'>simulate.json</a>.</p>"
    )


def _offload(summary: dict[str, Any]) -> str:
    off, shipped = summary["offload"], summary["offload_shipped"]
    k, n = summary["top_k"], summary["num_experts"]
    return "".join([
        "<h2>1. Offloaded generation: the headline's numbers</h2>",
        f"<p>The shipped model has {summary['num_layers']} MoE layers of N = {n} experts; the "
        f"router sends each token to K = {k} of them per layer. Its own experts are "
        f"{shipped['expert_mib'] * 1024:.0f} KiB: too small for their transfers to matter "
        "beside compute (its table comes second). The headline runs where prefetching is "
        f"meant to work: a model of the same routing shape with real-size experts "
        f"({off['expert_mib']:.1f} MiB each, Qwen3.6-35B-A3B's expert shape; {off['layers']} "
        "layers; RANDOM weights, made once and cached), through which "
        f"{_e(off['routing'])}; the predictors' tables were {_e(off['tables'])}. It runs "
        f"with {off['capacity']} of each layer's experts in a cache; the others come over an "
        f"EMULATED link of {off['link']}/s (host memory behind a timed copy, not a real "
        f"device). After one untimed warm-up run, each system generated {off['new_tokens']} "
        f"tokens, {off['rounds']} times, in interleaved rounds (every round runs every system "
        "once, in a rotated order, so a slow spell of this shared machine hits all of them "
        "alike); figures are medians over the rounds. Each run starts from an empty cache. "
        "stmoe-plus-all is stmoe-plus with the runtime's prefetch admission off (every "
        "predicted load made).</p>",
        _offload_table(off),
        "<h3>At the shipped model's own sizes</h3>",
        f"<p>The same systems on the shipped model itself over an EMULATED {shipped['link']}/s "
        f"link, {shipped['new_tokens']} tokens from the prompt of section 5: "
        f"{_e(shipped_line(shipped))}</p>",
        _offload_table(shipped),
        defs([
            ("decode tokens/s", "tokens generated after the first, divided by the time from "
             "the first to the last forward pass; range: slowest and fastest round."),
            ("hit rate", "share of the experts the router chose that were already in the cache "
             "(or on their way) when the layer asked for them."),
            ("stall share", "share of the decode time spent waiting for experts to arrive."),
            ("prefetch recall", "share of the experts the router chose that the predictor had "
             "named in advance (|P ∩ A| / |A|)."),
            ("prefetch precision", "share of the named experts that the router then chose "
             "(|P ∩ A| / |P|)."),
            ("MiB moved / wasted", "expert bytes copied over the link; wasted: prefetched, "
             "then evicted or never used."),
        ]),
    ])


def _offload_table(off: dict[str, Any]) -> str:
    """One section's systems, and whether every run gave its reference tokens."""
    rows = [[name, SYSTEM_DESCRIPTIONS.get(name, ""), f"{r['decode_tokens_per_s']:.1f}",
             "{:.1f}-{:.1f}".format(*r["decode_tokens_per_s_range"]), f"{r['hit_rate']:.3f}",
             f"{r['stall_share']:.1%}", f"{r['prefetch_recall']:.3f}",
             f"{r['prefetch_precision']:.3f}", f"{r['bytes_moved'] / 2**20:.1f}",
             f"{r['bytes_wasted'] / 2**20:.1f}", "yes" if r["identical_to_reference"] else "NO"]
            for name, r in off["systems"].items()]
    runs = len(off["systems"]) * off["rounds"]
    same = (f"All {runs} runs ({len(off['systems'])} systems x {off['rounds']} rounds) generated "
            f"exactly {_e(off['reference'])}, {off['new_tokens']} tokens: offloading changes "
            "the speed, never the output." if off["identical_tokens"] else
            "<span class='lossy'>MISMATCH: some runs did not generate "
            f"{_e(off['reference'])} (column 'same tokens'); offloading is meant to be "
            "lossless.</span>")
    return "".join([
        table(["system", "what it does", "decode tokens/s", "range", "hit rate", "stall share",
               "prefetch recall", "prefetch precision", "MiB moved", "MiB wasted",
               "same tokens"], rows, left=(1,)),
        f"<p>{same}</p>",
    ])


def _correlation(analysis: dict[str, Any]) -> str:
    s, t = analysis["spatial"], analysis["temporal"]
    return "".join([
        "<h2>3. Why prediction works: correlation in the routing</h2>",
        f"<p>{s['pairs_significant']} of {s['pairs_total']} adjacent layer pairs reject "
        f"independence (p &lt; {s['alpha']}): a token's experts at layer l tell which it will "
        f"use at l+1 (spatial). Consecutive tokens share {t['overlap_ratio']:.2f}x the experts "
        "random routing would (temporal). <a href='analysis/report.html'>The full analysis "
        "report</a> has the method and every table.</p>",
        defs([
            ("p-value", "chance of a dependence this strong if the two layers chose "
             "independently; the axis is capped (the strongest pairs underflow to ~1e-300)."),
            ("Cramér's V", "effect size of that dependence: 0 = independent, 1 = layer l's "
             "expert fixes layer l+1's."),
            ("overlap ratio", "experts two consecutive tokens share at a layer, divided by "
             "K²/N, what random routing would share."),
        ]),
        "<figure><img src='analysis/spatial_tests.png' alt='Spatial tests'></figure>",
        "<figure><img src='analysis/temporal_overlap.png' alt='Temporal overlap'></figure>",
    ])


def _simulator(sim: dict[str, Any]) -> str:
    from stmoe.sim.accelerator.plots import lossy_note

    rows = []
    for n, r in sim["systems"].items():
        note = lossy_note(r)
        time = f"{r['normalized_time']:.3f}"
        rows.append([n, SIM_DESCRIPTIONS.get(n, ""), note or "lossless", time,
                     f"{r['energy']:.4g}", f"{r['edp']:.4g}"])
    systems, warn = sim["systems"], ""
    for n in (n for n, r in systems.items() if lossy_note(r)):
        mine, oracle = systems[n]["normalized_time"], systems.get("oracle", {}).get(
            "normalized_time")
        beats = (f" Here it beats even the lossless oracle ({mine:.3f} against {oracle:.3f}) "
                 "by running fewer experts, not by predicting better."
                 if oracle is not None and mine < oracle else "")
        warn += (f"<p class='lossy'>{_e(n)} is lossy: it runs fewer experts than the router "
                 f"chose, so its time is not comparable with the others'.{beats}</p>")
    return "".join([
        f"<h2>4. Simulator ({_e(sim['hardware'])} preset; GPU baseline = 1)</h2>",
        "<p>The recorded routing replayed through the accelerator pipeline of docs/method.md "
        "(a model of the paper's hardware, not a measurement).</p>",
        table(["system", "what it is", "quality", "normalized time", "energy (J)", "EDP"],
              rows, left=(1, 2)),
        defs([
            ("normalized time", "simulated decode time over the GPU baseline's (below 1 is "
             "faster)."),
            ("EDP", "energy-delay product: energy (J) times time (s); lower is better."),
        ]),
        warn,
        "<figure><img src='simulator/normalized_time.png' alt='Normalized time'></figure>",
        "<h3>Ablation: dataflow, then the temporal and spatial tables</h3>",
        defs([
            ("HT", "history table: the experts the previous token used at each layer "
             "(temporal correlation); alone, it is the previous-token predictor."),
            ("CCT", "cross-layer co-occurrence table: for each expert of layer l, the experts "
             "of layer l+1 that most often follow it (spatial correlation)."),
        ]),
        "<ul>" + "".join(f"<li>{_e(x)}</li>" for x in ablation_reasons(sim)) + "</ul>",
        "<figure><img src='simulator/ablation.png' alt='Ablation'></figure>",
    ])


def _generated(summary: dict[str, Any], samples: list[tuple[str, str, str]], card: bool) -> str:
    off = summary["offload_shipped"]  # the real-size model's text is meaningless: not shown
    blocks = [f"<h4>{_e(d)}</h4><pre><span class='prompt'>{_e(p)}</span>{_e(g)}</pre>"
              for d, p, g in samples]
    see = f"<a href='{MODEL_CARD_HTML}'>model card</a>" if card else "model card"
    return "".join([
        "<h2>5. What the model generates</h2>",
        f"<p>The shipped model is tiny ({summary['parameters'] / 1e6:.1f} M parameters, trained "
        f"for minutes on a CPU; {see}): its text is expected to be poor. It looks like its "
        "domain but is rarely correct, and it repeats itself. It is here for its routing, not "
        "its text. Grey: the prompt; black: the greedy continuation.</p>",
        "<h3>The offloaded runs on the shipped model (every system, the same tokens)</h3>",
        f"<pre><span class='prompt'>{_e(off['prompt'])}</span>{_e(off['text'])}</pre>",
        "<h3>The recorded prompts</h3>", *blocks,
    ])
