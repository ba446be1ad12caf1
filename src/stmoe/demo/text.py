"""The demo report's words: the headline sentence, the ablation's reasons (both built
from the measured numbers), HTML tables and definition lists, and the model card
rendered beside the report so that its link works offline."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

from stmoe.analysis.report import html_text as _e
from stmoe.errors import StmoeError
from stmoe.evaluate.compare import against
from stmoe.util.fileio import atomic_write_text, check_input_file

MODEL_CARD_HTML = "model-card.html"


def headline(off: dict[str, Any]) -> str:
    """The report's one sentence: ST-MoE's and stmoe-plus's decode speed against an LRU
    cache alone at real expert sizes, each with its verdict in plain words (``verdict``)."""
    s = off["systems"]
    plus = (f" and stmoe-plus at {s['stmoe-plus']['decode_tokens_per_s']:.1f} "
            f"({verdict(off, 'stmoe-plus')})" if "stmoe-plus" in s else "")
    rounds = (f"medians of {off['rounds']} rounds" if off["rounds"] > 1 else
              "one run each: --rounds N gives medians and ranges")
    return (f"At {setting(off)}, ST-MoE prefetching decodes at "
            f"{s['stmoe']['decode_tokens_per_s']:.1f} tokens/s ({verdict(off, 'stmoe')})"
            f"{plus}, against {s['lru-only']['decode_tokens_per_s']:.1f} for an LRU cache "
            f"alone ({rounds}).")


def setting(off: dict[str, Any]) -> str:
    """Where a section ran, in a few words: its experts, cache and link."""
    what = (f"real expert sizes ({off['expert_mib']:.1f} MiB experts, RANDOM weights"
            if "routing" in off else
            f"the shipped model's own sizes ({off['expert_mib'] * 1024:.0f} KiB experts")
    return f"{what}, {off['capacity']} of each layer's cached, an EMULATED {off['link']}/s link)"


def details(off: dict[str, Any]) -> str:
    """What the headline leaves out, from the same runs: the other systems with their
    ranges, how much on-demand loading waits, the ratios and the tokens' check."""
    s = off["systems"]

    def speed(name: str) -> str:
        r = s[name]
        lo, hi = r["decode_tokens_per_s_range"]
        spread = f" (range {lo:.1f}-{hi:.1f})" if off["rounds"] > 1 else ""
        return f"{name} {r['decode_tokens_per_s']:.1f}{spread}"

    shown = [n for n in ("on-demand", "lru-only", "stmoe", "stmoe-plus", "stmoe-plus-all",
                         "oracle") if n in s]
    same = (f"every run's tokens identical to {off['reference']}" if off["identical_tokens"]
            else f"NOT every run's tokens matched {off['reference']}")
    prefetching = [n for n in shown if n not in ("on-demand", "lru-only", "oracle")]
    return (f"Decode tokens/s at {sizes(off)}: {'; '.join(speed(n) for n in shown)}. Against "
            f"the LRU cache alone: {'; '.join(versus(off, n) for n in prefetching)}; {same}.")


def sizes(off: dict[str, Any]) -> str:
    """Where a section ran: its expert size, its weights and routing, and how much of the
    on-demand decode waited for weights (what prefetching can win back), with its range."""
    od = off["systems"].get("on-demand", {})
    waited, spread = od.get("stall_share"), od.get("stall_share_range")
    wait = ""
    if waited:
        span = (f", {spread[0]:.0%}-{spread[1]:.0%} over the rounds"
                if spread and off["rounds"] > 1 else "")
        wait = f"; on-demand loading waits for weights {waited:.0%} of its decode{span}"
    if "routing" in off:
        return (f"real expert sizes ({off['expert_mib']:.1f} MiB experts, RANDOM weights "
                f"replaying the shipped model's routing{wait})")
    return f"the shipped model's own sizes ({off['expert_mib'] * 1024:.0f} KiB experts{wait})"


def shipped_line(off: dict[str, Any]) -> str:
    """One line for the second table: the shipped model's own sizes."""
    s = off["systems"]
    return (f"At {sizes(off)}: ST-MoE {s['stmoe']['decode_tokens_per_s']:.1f} tokens/s, "
            f"LRU cache alone {s['lru-only']['decode_tokens_per_s']:.1f}, oracle "
            f"{s['oracle']['decode_tokens_per_s']:.1f}; {versus(off, 'stmoe')}; "
            f"{versus(off, 'stmoe-plus')}.")


VERDICT = {  # compare.against's verdicts, in plain words
    "faster": "faster: ranges apart",
    "as fast": "no clear difference: ranges overlap",
    "within noise": "no clear difference: ranges overlap",
    "slower": "slower: ranges apart",
    "single run": "one run: no verdict",
    "too few rounds": "too few rounds for a verdict",
}


def verdict(off: dict[str, Any], name: str) -> str:
    """``name`` against lru-only by the benchmarks' rule (``evaluate.compare.against``), in
    plain words: "faster" or "slower" only when the rounds' ranges are apart."""
    s = off["systems"]
    return VERDICT[against(s[name]["decode_tokens_per_s_runs"],
                           s["lru-only"]["decode_tokens_per_s_runs"])]


def versus(off: dict[str, Any], name: str) -> str:
    """``name`` against lru-only: its ratio of medians and the verdict (``verdict``)."""
    s = off["systems"]
    ratio = s[name]["decode_tokens_per_s"] / s["lru-only"]["decode_tokens_per_s"]
    return f"{name} {ratio:.2f}x ({verdict(off, name)})"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{0.0 if abs(ms) < 1e-6 else ms:+.3g} ms"  # a float sum's 1e-15 noise is no change


def ablation_reasons(sim: dict[str, Any]) -> list[str]:
    """One line per ablation step (what changed in compute, stall and traffic, from the
    simulator's numbers), then what bounds the steps on this model."""
    steps = list(sim.get("ablation", {}).items())
    if len(steps) < 2:
        return []
    lines = []
    for (prev_name, prev), (name, cur) in itertools.pairwise(steps):
        dt = cur["time"] - prev["time"]
        verb = "faster" if dt < 0 else "slower" if dt > 0 else "as fast"
        b, pb = cur["breakdown"], prev["breakdown"]
        speedup = cur["speedup_vs_baseline"]
        lines.append(
            f"{name}: {abs(dt) / prev['time']:.1%} {verb} than {prev_name} ({speedup:.2f}x "
            f"the static baseline). Compute {_ms(b['compute'] - pb['compute'])}, stall "
            f"{_ms(b['stall'] - pb['stall'])}, prediction "
            f"{_ms(b['prediction'] - pb['prediction'])}; "
            f"experts moved {prev['experts_loaded']:.0f} -> {cur['experts_loaded']:.0f} "
            f"({cur['experts_prefetched']:.0f} prefetched, {cur['experts_wasted']:.0f} of them "
            f"unused), hit rate {cur['hit_rate']:.2f}."
        )
    last = steps[-1][1]
    comm, compute = last["breakdown"]["communication"], last["breakdown"]["compute"]
    share, cshare = comm / last["time"], compute / last["time"]
    if share > 0.5:
        lines.append(
            f"Why: on this model the link is the bottleneck. It is busy for {share:.0%} of "
            f"{steps[-1][0]}'s time, compute for {cshare:.0%}, so a prefetch can hide at most "
            "the compute time behind it, while every unused prefetch adds link time: a step "
            "that moves more experts than it saves stalls longer. Prefetching pays where "
            "compute is long enough to hide the transfers (a larger model, a faster link)."
        )
    else:
        lines.append(
            f"Why: compute takes {cshare:.0%} of {steps[-1][0]}'s time and the link is busy "
            f"for {share:.0%}, so correct prefetches hide their transfers behind compute and each "
            "table that raises the hit rate shortens the stall."
        )
    kept = (sim.get("buffer") or {}).get("experts_per_layer", 0)
    lines.append(
        ("The on-chip buffer keeps no expert across tokens on this preset (capacity 0), so "
         "the HT's prediction (the previous token's experts) is a reload over the link, not "
         "a hit in place: the temporal step can only start those loads earlier."
         if not kept else
         f"The on-chip buffer keeps {kept} experts per layer across tokens, so the HT's "
         "experts are often still on chip and need no transfer.")
        + " docs/simulator.md ('Where the paper's figures hold') sweeps the buffer, the link "
        "and the PE array to show where the paper's ratios and ablation appear, and what "
        "chip that takes."
    )
    return lines


def table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = ()) -> str:
    """An HTML table; ``left``: columns of words (left-aligned), numbers align right."""
    cells = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td class='l'>{_e(c)}</td>" if i in left else f"<td>{_e(c)}</td>"
                         for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{cells}</tr>{body}</table>"


def defs(items: list[tuple[str, str]]) -> str:
    """One line per metric: its name and what it means."""
    lines = "".join(f"<dt>{_e(t)}:</dt><dd>{_e(d)}</dd>" for t, d in items)
    return f"<dl class='defs'>{lines}</dl>"


def model_card_source() -> Path | None:
    """docs/model-card.md of the source tree stmoe runs from, or None (a wheel has no docs)."""
    import stmoe

    path = Path(stmoe.__file__).resolve().parents[2] / "docs" / "model-card.md"
    return path if path.is_file() else None


def copy_model_card(out: Path) -> bool:
    """``out/model-card.md`` and its HTML rendering; False when no model card is found."""
    src = model_card_source()
    if src is None:
        return False
    try:
        text = check_input_file(src, "the model card").read_text(encoding="utf-8")
    except (StmoeError, OSError, UnicodeDecodeError):
        return False  # the report still stands; its link says the card is missing
    atomic_write_text(out / "model-card.md", text)
    page = (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Model card"
            f"</title><style>{_CARD_STYLE}</style></head><body><p><a href='index.html'>back to "
            f"the demo report</a></p>{markdown_html(text)}</body></html>\n")
    atomic_write_text(out / MODEL_CARD_HTML, page)
    return True


_CARD_STYLE = ("body{font-family:sans-serif;max-width:900px;margin:2em auto;padding:0 1em;"
               "line-height:1.45}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
               "padding:2px 8px}pre,code{font-family:monospace;background:#f6f8fa}"
               "pre{padding:.6em;white-space:pre-wrap}")
_INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")


def _inline(text: str) -> str:
    """Code spans, bold and links of one Markdown line; everything else escaped."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(_e(text[pos : m.start()]))
        code, bold, label, url = m.groups()
        if code is not None:
            out.append(f"<code>{_e(code)}</code>")
        elif bold is not None:
            out.append(f"<b>{_e(bold)}</b>")
        else:
            out.append(f"<a href='{_e(url)}'>{_e(label)}</a>")
        pos = m.end()
    return "".join(out) + _e(text[pos:])


def markdown_html(text: str) -> str:
    """The small Markdown the docs use (headings, paragraphs, lists, tables, fenced code)
    as HTML: enough for the model card, with no dependency."""
    html, para, lines = [], [], text.splitlines()

    def flush() -> None:
        if para:
            html.append(f"<p>{_inline(' '.join(para))}</p>")
            para.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            flush()
            j = next((n for n in range(i + 1, len(lines)) if lines[n].startswith("```")),
                     len(lines))
            html.append(f"<pre><code>{_e(chr(10).join(lines[i + 1 : j]))}</code></pre>")
            i = j + 1
            continue
        if m := re.match(r"(#{1,6}) (.*)", line):
            flush()
            level = len(m.group(1))
            html.append(f"<h{level}>{_inline(m.group(2))}</h{level}>")
        elif line.startswith("|"):
            flush()
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                if not re.fullmatch(r"\|[\s:|-]*", lines[i]):  # not the |---| separator
                    rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            head, *body = rows
            html.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r)
                                  + "</tr>" for r in body) + "</table>")
            continue
        elif line.startswith("- "):
            flush()
            items = []
            while i < len(lines) and (lines[i].startswith("- ") or lines[i].startswith("  ")):
                if lines[i].startswith("- "):
                    items.append(lines[i][2:])
                else:
                    items[-1] += " " + lines[i].strip()
                i += 1
            html.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in items) + "</ul>")
            continue
        elif line.strip():
            para.append(line.strip())
        else:
            flush()
        i += 1
    flush()
    return "\n".join(html)
