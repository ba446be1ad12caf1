"""What a user would run instead of stmoe, at the same memory bound: for bench_offload_real.py.

* ``resident``: plain transformers, every weight read into RAM (no bound: the reference).
* ``mmap``: plain transformers as ``from_pretrained`` leaves it: the safetensors shards
  memory-mapped, so the kernel's page cache is the expert cache and page faults the loads.
* ``accelerate``: ``device_map="auto"`` with ``max_memory={"cpu": budget}`` and an offload
  folder (accelerate keeps the first layers in RAM and streams the rest from disk at every
  forward call).

The bound covers the whole process, page cache included: each bounded run gets its own
memory cgroup (``stmoe.util.cgroup``: v2 ``memory.max``, or v1 ``memory.limit_in_bytes`` where
only v1 is mounted and writable), entered by the child before it loads anything, and the
checkpoint's pages are dropped from the page cache first, so none is charged elsewhere. Where
no cgroup can be made, every forward call drops the checkpoint's pages first: the bound's worst
case (nothing kept between tokens), said as such in the output.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def load_baseline(kind: str, model_dir: Path, budget: int, offload_dir: Path) -> Any:
    """The model as ``kind`` loads it (see the module's docstring)."""
    from transformers import AutoModelForCausalLM

    if kind == "accelerate":
        return AutoModelForCausalLM.from_pretrained(
            model_dir, device_map="auto", max_memory={"cpu": budget}, offload_folder=offload_dir
        ).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if kind == "resident":
        for p in model.parameters():  # every weight read once: in RAM, not a lazy mapping
            p.data.sum()
    return model


def decode_speed(model: Any, plan: Any, steps: int, rounds: int,
                 before_forward: Any = None) -> list[float]:
    """Decode tokens/s of ``rounds`` generations of ``steps`` tokens with ``plan``'s routing
    forced on every MoE layer (the first round may warm up)."""
    import torch

    from stmoe.runtime.forced_routing import ForcedRouting

    forced, ends = ForcedRouting(model, plan), []
    if before_forward is not None:
        model.register_forward_pre_hook(lambda m, a: before_forward())
    model.register_forward_hook(lambda m, a, o: ends.append(time.perf_counter()))
    ids = torch.tensor([plan.token_ids])
    speeds = []
    for _ in range(rounds):
        forced.reset()
        ends[:] = []
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0)
        speeds.append((len(ends) - 1) / (ends[-1] - ends[0]))
    return speeds
