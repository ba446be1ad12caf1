"""What int8 and int4 experts cost in quality, on stmoe's shipped model and text it never saw.

The quantized formats are lossy, so their quality is measured, against the same model with
its native (float32) experts; only the routed experts are quantized (every other weight
is the checkpoint's), exactly as ``stmoe pack --format`` stores them and
``quant.experts.quantize_model`` computes them (the offloaded model equals that bit for
bit: tests/runtime/test_quantized.py).

Held-out text (the model was trained on the top-level ``*.py`` files of Python's standard
library, its pydoc topics and the CHAMP problems, ``hf/train_tiny.py``):
  code   the standard library's ``json/``, ``http/`` and ``email/`` packages (never in the
         corpus: it globs the top level only)
  prose  the last 5% of the pydoc topics (the training run's validation split)

Per format: perplexity per domain (non-overlapping windows of 256 tokens, the training
length), top-1 agreement with the native model's next-token choice at every position of
those windows, and the greedy tokens of three prompts (how many of 64 match the native
model's before the first difference). Target (issue 28): int8 perplexity within 1% of
native's in every domain; int4's published.

    python benchmarks/bench_quality.py [--windows 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sysconfig
from pathlib import Path
from typing import Any

import torch

from stmoe.hf.loading import load_model
from stmoe.models import SHIPPED_MODEL
from stmoe.quant import parse_format
from stmoe.quant.experts import quantize_model

WINDOW = 256  # tokens: the shipped model's training length
INT8_TARGET = 0.01  # int8 perplexity at most 1% above native's
PROMPTS = ("import json\n\ndef load(path):\n", "The email package provides",
           "class Server:\n    def handle(self, request):\n")
GREEDY = 64


def held_out_text() -> dict[str, str]:
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for pkg in ("json", "http", "email") for p in sorted((stdlib / pkg).glob("*.py"))]
    code = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    prose = "\n\n".join(topics[k] for k in sorted(topics))
    return {"code": code, "prose": prose[int(len(prose) * 0.95):]}


def windows(tokenizer: Any, text: str, count: int) -> torch.Tensor:
    ids = torch.tensor(tokenizer(text)["input_ids"])
    n = min(count, len(ids) // WINDOW)
    return ids[: n * WINDOW].view(n, WINDOW)


@torch.no_grad()
def score(model: torch.nn.Module, batches: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per domain: mean next-token loss (nats), and each position's top-1 choice."""
    out = {}
    for domain, x in batches.items():
        losses, choices = [], []
        for row in x:
            logits = model(input_ids=row[None]).logits[0, :-1].float()
            losses.append(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum"))
            choices.append(logits.argmax(-1))
        tokens = x.shape[0] * (WINDOW - 1)
        out[domain] = {"loss": float(sum(losses)) / tokens, "top1": torch.stack(choices)}
    return out


@torch.no_grad()
def greedy(model: torch.nn.Module, tokenizer: Any) -> list[list[int]]:
    runs = []
    for p in PROMPTS:
        ids = tokenizer(p, return_tensors="pt")["input_ids"]
        seq = model.generate(ids, max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        runs.append(seq[0, ids.shape[1]:].tolist())
    return runs


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=24, help="windows of 256 tokens per domain")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    native, tokenizer = load_model(SHIPPED_MODEL)
    native.eval()
    batches = {d: windows(tokenizer, t, args.windows) for d, t in held_out_text().items()}
    print(f"stmoe's shipped model ({SHIPPED_MODEL.name}, trained weights), held-out text: "
          + ", ".join(f"{d} {x.numel()} tokens" for d, x in batches.items()))
    ref, ref_greedy = score(native, batches), greedy(native, tokenizer)
    rows = [("native", native, ref, ref_greedy)]
    for name in ("int8", "int4"):
        model = quantize_model(copy.deepcopy(native), parse_format(name))
        fmt = model.model.layers[0].mlp.experts._stmoe_format
        rows.append((fmt.label, model, score(model, batches), greedy(model, tokenizer)))
    print(f"\n{'format':<36} {'domain':<6} {'perplexity':>10} {'vs native':>9} {'top-1 agree':>11}")
    report: dict[str, Any] = {"windows": args.windows, "formats": {}}
    met = True
    for label, _, s, runs in rows:
        entry: dict[str, Any] = {}
        for domain in batches:
            ppl = math.exp(s[domain]["loss"])
            rel = ppl / math.exp(ref[domain]["loss"]) - 1
            agree = float((s[domain]["top1"] == ref[domain]["top1"]).float().mean())
            entry[domain] = {"perplexity": ppl, "vs_native": rel, "top1_agreement": agree}
            print(f"{label:<36} {domain:<6} {ppl:>10.3f} {rel:>+8.2%} {agree:>11.3f}")
            if label.startswith("int8") and rel > INT8_TARGET:
                met = False
        prefix = [matching_prefix(a, b) for a, b in zip(runs, ref_greedy, strict=True)]
        entry["greedy_matching_prefix"] = prefix
        print(f"{label:<36} greedy: {prefix} of {GREEDY} tokens match native's before the "
              "first difference (3 prompts)")
        report["formats"][label] = entry
    print(f"\nint8 perplexity within {INT8_TARGET:.0%} of native's in every domain: "
          f"{'MET' if met else 'NOT MET'}")
    report["int8_target_met"] = met
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
