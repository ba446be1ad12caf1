"""The weight-only kernels stmoe computes experts with, against torchao's (issue 28, item 1).

stmoe's int8 and int4 formats call torch's own CPU kernels directly
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``: ``stmoe.quant.kernels``).
torchao wraps quantized weights in tensor subclasses (``quantize_`` with
``Int8WeightOnlyConfig``, and for int4 on the CPU the prototype
``PrototypeInt4WeightOnlyConfig``, torchao 0.18) and dispatches ``linear`` on them. This
times both, and torch's bf16 ``linear``, on Qwen1.5-MoE's expert matrices (gate/up 2816 x
2048, down 2048 x 1408; RANDOM weights) for one decode token, 1 thread, ``--calls`` calls
per sample (the same matrix again: cache-resident, so a kernel's own speed, not memory's),
the kinds interleaved in rotated order for ``--rounds`` rounds. Target: for
each format, torch's kernel as stmoe calls it is at least 0.95x the speed of torchao's
(else stmoe should switch to torchao's).

    pip install torchao==0.18.0   # for this script only, then pip uninstall torchao:
    python benchmarks/bench_kernels.py [--rounds 5] [--calls 200]

(Not in an extra: once installed, transformers imports torchao in every process, with
warnings on stderr, so the other benchmarks would run with it loaded.)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch

from stmoe.evaluate.compare import rotated, spread, verdict
from stmoe.quant import parse_format
from stmoe.quant.kernels import qlinear, quantize_matrix

SHAPES = {"gate_up 2816x2048": (2816, 2048), "down 2048x1408": (2048, 1408)}
TARGET = 0.95


def stmoe_kind(w: torch.Tensor, fmt_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    fmt = parse_format(fmt_name, 128 if fmt_name == "int4" else None)
    q = quantize_matrix(w, fmt)
    return lambda x: qlinear(x, q.qweight, q.qscale, fmt)


def torchao_kind(w: torch.Tensor, fmt_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight.data.copy_(w)
    lin = copy.deepcopy(lin)
    if fmt_name == "int8":
        config = Int8WeightOnlyConfig()
    else:  # torchao's CPU int4 (its opaque layout; a prototype config in torchao 0.18)
        from torchao.prototype.quantization.int4.inference_workflow import (
            PrototypeInt4WeightOnlyConfig,
        )

        config = PrototypeInt4WeightOnlyConfig(group_size=128, set_inductor_config=False)
    quantize_(lin, config)
    return lin


def timed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    with torch.no_grad():
        fn(x)
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        import torchao
    except ImportError:
        raise SystemExit("error: torchao is not installed (pip install torchao==0.18.0; "
                         "uninstall it after: see this script's docstring)") from None
    load = [os.getloadavg()[0]]
    print(f"torch {torch.__version__}, torchao {torchao.__version__}, 1 thread, RANDOM "
          f"weights; load {load[0]:.2f}", flush=True)
    met = True
    for label, (out, inner) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(out, inner, generator=gen) * 0.02).to(torch.bfloat16)
        x = torch.randn(1, inner, generator=gen).to(torch.bfloat16)
        kinds: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "bf16 linear": lambda x, w=w: torch.nn.functional.linear(x, w)}
        for fmt in ("int8", "int4"):
            kinds[f"stmoe {fmt} (torch's kernel)"] = stmoe_kind(w, fmt)
            try:
                kinds[f"torchao {fmt}"] = torchao_kind(w, fmt)
            except Exception as exc:  # a config this torchao lacks: said, not hidden
                print(f"  torchao {fmt}: cannot be made here ({type(exc).__name__}: "
                      f"{str(exc)[:160]})")
        ms: dict[str, list[float]] = {k: [] for k in kinds}
        for rnd in range(args.rounds):
            for k in rotated(list(kinds), rnd):
                ms[k].append(timed(kinds[k], x, args.calls))
        print(f"\n{label}, one token (ms per call, median [min, max] of {args.rounds}):")
        for k, v in ms.items():
            gb = out * inner * 2 / (statistics.median(v) / 1e3) / 1e9
            print(f"  {k:28s} {spread(v, '.3f')}  ({gb:.1f} GB/s of bf16-equivalent weights, "
                  "cache-resident)")
        for fmt in ("int8", "int4"):
            mine, theirs = ms[f"stmoe {fmt} (torch's kernel)"], ms.get(f"torchao {fmt}")
            if theirs is None:
                continue
            per = [b / a for a, b in zip(mine, theirs, strict=True)]  # speed ratio
            ok = statistics.median(per) >= TARGET
            met &= ok
            print(f"  {fmt}: stmoe / torchao speed {spread(per)} per round, >= {TARGET}x: "
                  f"{verdict(ok)}")
    load.append(os.getloadavg()[0])
    print(f"\nload at start {load[0]:.2f}, at end {load[1]:.2f}"
          + ("  (ABOVE 3: redo)" if max(load) > 3 else ""))
    print(f"torch's kernels as stmoe calls them >= {TARGET}x torchao's: {verdict(met)}")


if __name__ == "__main__":
    main()
