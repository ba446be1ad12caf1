"""Checkpoint folders of every layout stmoe reads from disk, for the store's tests.

``FOLDERS``: the shipped model; ``save_pretrained``'s checkpoints (per-expert tensors,
as the hub's) of four tiny families; ``stmoe make-model``'s (fused experts, several
shards) of four architectures, one in bfloat16. RANDOM weights throughout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_moe import tiny_model


def make_model_folder(arch: str, out: Path, dtype: str = "float32") -> Path:
    """``stmoe make-model``'s checkpoint (fused experts, several shards) of architecture
    ``arch`` at the stmoe-tiny preset's sizes (RANDOM weights)."""
    from transformers import AutoModelForCausalLM

    from stmoe.hf import checkpoints
    from stmoe.sim.specs import model_preset

    spec = model_preset("stmoe-tiny")
    config = checkpoints._config(arch, spec, 2, dtype)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    plan = checkpoints.CheckpointPlan(config, [(n, tuple(t.shape)) for n, t in
                                               meta.state_dict().items()], dtype, spec)
    return checkpoints.make_checkpoint(plan, out, shard_bytes=400_000)


def saved_folder(family: str, out: Path) -> Path:
    """``save_pretrained``'s checkpoint (per-expert tensors, as the hub's) of a tiny model."""
    tiny_model(family)[0].save_pretrained(out)
    return out


FOLDERS = {
    "shipped": lambda out: __import__("stmoe.models", fromlist=["x"]).SHIPPED_MODEL,
    **{f"saved-{f}": lambda out, f=f: saved_folder(f, out)
       for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")},
    **{f"made-{a}": lambda out, a=a: make_model_folder(a, out)
       for a in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")},
    "made-qwen3_moe-bf16": lambda out: make_model_folder("qwen3_moe", out, "bfloat16"),
}
