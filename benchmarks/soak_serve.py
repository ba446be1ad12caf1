"""Issue 29's soak: 8 clients call a live `stmoe serve` in a loop for 5 minutes.

The server runs as its own process (`python -m stmoe serve`, the shipped model, 50%
cached, stmoe-plus, --max-batch 8). Each client loops over the prompts below with
varying `max_tokens` (streamed every third request), through the official `openai`
client, and compares every text with the same request run alone on the resident
model (computed first, here; with ``--format int8|int4`` the server's experts and resident
linears in that format, LOSSY, and the resident model quantized the same way: a decode
step is then one batched forward, runtime/batcher/step_forward.py). The server's resident
memory (VmRSS of its process) is sampled every 5 s. Targets (MET / NOT MET):

* no request lost: every request sent gets a complete response;
* every response equals its solo run;
* RSS flat after the warm-up (the first 20% of the run): max / min <= 1.05.

    python benchmarks/soak_serve.py [--seconds 300] [--clients 8] [--format int4]
                                    [--lengths 4,9,16,24] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPTS = ["def fib(n):", "The capital of France is", "import numpy as np\n", "Once upon a",
           "class Stack:\n    def push(self, x):", "To bake bread, first", "SELECT * FROM",
           "The derivative of x^2 is"]
LENGTHS = [4, 9, 16, 24]


def solo_texts(fmt: str = "native",
               lengths: list[int] = LENGTHS) -> dict[tuple[int, int], str]:
    """Every (prompt, length)'s greedy text on the resident model in ``fmt``, run alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stmoe.models import SHIPPED_MODEL
    from stmoe.quant import parse_format
    from stmoe.quant.experts import quantize_model
    from stmoe.quant.linears import quantize_linears

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL).eval()
    if fmt != "native":  # the experts and the resident linears, as the server has them
        model = quantize_model(model, parse_format(fmt))
        quantize_linears(model, parse_format(fmt))
    eos = model.generation_config.eos_token_id
    out = {}
    for i, p in enumerate(PROMPTS):
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max(lengths), do_sample=False, pad_token_id=eos)
        new = seq[0, ids.shape[1]:].tolist()
        for n in lengths:  # greedy: a shorter run is a prefix of the longer one
            part = new[:n]
            if eos in part:
                part = part[: part.index(eos) + 1]
            out[(i, n)] = tok.decode([t for t in part if t != eos], skip_special_tokens=True)
    return out


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    import openai

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--json", type=Path)
    p.add_argument("--format", default="native", choices=["native", "int8", "int4"],
                   help="the server's experts and resident linears (quantized: LOSSY)")
    p.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")],
                   default=LENGTHS, help="max_tokens the clients take turns with, comma-separated "
                   "(over 32: the server's text is read from a settled point, GrowingText)")
    a = p.parse_args()
    want = solo_texts(a.format, a.lengths)
    quantized = ["--format", a.format, "--quantize-resident", a.format] \
        if a.format != "native" else []
    load = [os.getloadavg()]
    server = subprocess.Popen([sys.executable, "-m", "stmoe", "serve", "--port", str(a.port),
                               "--max-batch", "8", "--max-queue", "64", "--capacity", "50%",
                               "--log-level", "warning", *quantized],
                              stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{a.port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        counts = {"sent": 0, "ok": 0, "mismatch": 0, "error": 0}
        errors: list[str] = []
        lock = threading.Lock()
        stop = time.monotonic() + a.seconds

        def client(c: int) -> None:
            api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=300)
            k = c
            while time.monotonic() < stop:
                i, n = k % len(PROMPTS), a.lengths[(k // len(PROMPTS)) % len(a.lengths)]
                k += a.clients
                with lock:
                    counts["sent"] += 1
                try:
                    if k % 3 == 0:
                        text = "".join(ch.choices[0].text for ch in api.completions.create(
                            model="tiny-moe", prompt=PROMPTS[i], max_tokens=n, stream=True,
                            temperature=0)
                            if ch.choices)
                    else:
                        text = api.completions.create(model="tiny-moe", prompt=PROMPTS[i],
                                                      max_tokens=n,
                                                      temperature=0).choices[0].text
                    key = "ok" if text == want[(i, n)] else "mismatch"
                except Exception as exc:
                    key = "error"
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                with lock:
                    counts[key] += 1

        threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
        start = time.monotonic()
        for t in threads:
            t.start()
        samples: list[tuple[float, int]] = []
        while any(t.is_alive() for t in threads):
            samples.append((time.monotonic() - start, rss(server.pid)))
            time.sleep(5)
        for t in threads:
            t.join()
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
    finally:
        server.terminate()
        server.wait(30)
    load.append(os.getloadavg())
    after = [r for t, r in samples if t >= 0.2 * a.seconds]
    growth = max(after) / min(after) if after else float("nan")
    lost = counts["sent"] - counts["ok"] - counts["mismatch"] - counts["error"]
    result: dict[str, Any] = {**counts, "lost": lost, "rss_growth": growth,
                              "rss_samples": samples, "load": load, "errors": errors[:10],
                              "seconds": a.seconds, "clients": a.clients, "format": a.format}
    print(f"load (1, 5, 15 min) at start {load[0]}, at end {load[1]}")
    print(f"{counts['sent']} requests in {a.seconds:.0f} s from {a.clients} clients: "
          f"{counts['ok']} equal to their solo run, {counts['mismatch']} different, "
          f"{counts['error']} errors, {lost} lost")
    print(f"server RSS after warm-up: {min(after) / 2**20:.0f}-{max(after) / 2**20:.0f} MiB "
          f"(x{growth:.3f})")
    for line in metrics.splitlines():
        if line.startswith(("stmoe_requests_total", "stmoe_batch_size_mean", "stmoe_hit_rate",
                            "stmoe_batched_forward_steps_total")):
            print("  " + line)
    ok = counts["error"] == 0 and lost == 0
    print(f"no request lost: {'MET' if ok else 'NOT MET'}")
    print(f"every response equals its solo run: "
          f"{'MET' if counts['mismatch'] == 0 and counts['ok'] > 0 else 'NOT MET'}")
    print(f"RSS flat within 5% after warm-up: {'MET' if growth <= 1.05 else 'NOT MET'}")
    for e in errors[:5]:
        print("  error:", e)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
