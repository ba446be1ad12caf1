"""Checkpoints of real MoE shapes with random weights, for measuring offloading at scale.

No real model's weights can be downloaded here, and the shipped model's experts
(216 KiB) are too small for transfer time to matter. ``make_checkpoint`` writes
a transformers checkpoint with the exact dimensions of a simulator model preset
(``sim/data/models.toml``: hidden size, expert width, experts, top-k, attention
heads, dtype), optionally only its first MoE layers, so that ``stmoe pack`` and
``stmoe generate`` run on it unchanged. Its weights are RANDOM (normal, std 0.02;
norms 1): the text it generates is meaningless and its own router's choices
are not a real model's; replay a real trace's routing through it
(``stmoe generate --routing``) to measure time at real sizes on real routing.

The vocabulary is the shipped tokenizer's (4,096 tokens), not the preset
model's, so embeddings stay small; everything inside the layers is full size.
Tensors are generated and written one shard at a time (``shard_bytes``), so a
checkpoint larger than memory can be written; each tensor's values depend only
on the seed and its name.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stmoe.errors import StmoeError
from stmoe.sim.specs import ModelSpec, model_preset, preset_names
from stmoe.util.cache_dir import existing_above
from stmoe.util.cgroup import available_memory
from stmoe.util.fileio import atomic_folder, atomic_write_text
from stmoe.util.units import format_bytes

# transformers architecture that has each preset's layer structure (routed experts,
# plus one shared expert where the preset has one). Presets missing here (MLA
# attention, dense first layers) have no simple transformers counterpart.
ARCHITECTURES = {
    "qwen1.5-moe-a2.7b": "qwen2_moe",
    "qwen2-57b-a14b": "qwen2_moe",
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen3.6-35b-a3b": "qwen3_moe",
    "mixtral-8x7b": "mixtral",
    "olmoe-1b-7b": "olmoe",
    "stmoe-tiny": "qwen2_moe",
    "demo-real-experts": "qwen3_moe",
}
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
INIT_STD = 0.02  # transformers' default initializer_range
SHARD_BYTES = 2 * 2**30
# the largest shapes make-model builds: expert ids are int16 in traces (32767), and no MoE
# has come near the rest (they bound a meta model's build and its arithmetic)
MAX_SIZES = {"layers": 1024, "dense_layers": 1024, "num_experts": 32767, "hidden": 1 << 17,
             "expert_intermediate": 1 << 20, "shared_intermediate": 1 << 20,
             "attention_heads": 1 << 12, "kv_heads": 1 << 12}


@dataclass(frozen=True)
class CheckpointPlan:
    """What ``make_checkpoint`` will write: the config and the tensors' names and shapes."""

    config: Any  # a transformers PretrainedConfig
    tensors: list[tuple[str, tuple[int, ...]]]
    dtype: str
    spec: ModelSpec

    @property
    def nbytes(self) -> int:
        size = DTYPES[self.dtype]
        return sum(_numel(shape) * size for _, shape in self.tensors)


def architecture_of(like: str, spec: ModelSpec) -> str:
    """The transformers model_type for a preset name (or a spec file's shape)."""
    if like in ARCHITECTURES:
        return ARCHITECTURES[like]
    if like.endswith(".toml"):  # a user's own spec: the shared expert decides
        return "qwen2_moe" if spec.shared_intermediate > 0 else "qwen3_moe"
    known = ", ".join(sorted(ARCHITECTURES))
    other = sorted(set(preset_names("models")) - set(ARCHITECTURES))
    why = f" ({', '.join(other)}: MLA attention or dense layers, not built here)" if other else ""
    raise StmoeError(f"--like {like!r}: no transformers architecture for this preset; "
                     f"use one of {known}{why}")


def plan_checkpoint(like: str, layers: int | None = None,
                    dtype: str = "bfloat16") -> CheckpointPlan:
    """The config and tensor list of a checkpoint shaped like preset (or spec file) ``like``."""
    spec = model_preset(like)
    if dtype not in DTYPES:
        raise StmoeError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    for key, most in MAX_SIZES.items():  # (a meta model of 10^8 layers took minutes, and GBs)
        if (value := layers or spec.layers if key == "layers" else getattr(spec, key)) > most:
            raise StmoeError(f"--like {like}: {key} is {value}, beyond any checkpoint stmoe "
                             f"makes (at most {most})")
    if layers is not None and not 1 <= layers <= spec.layers:
        raise StmoeError(f"--layers {layers}: {like} has {spec.layers} MoE layers; "
                         f"expected 1..{spec.layers}")
    config = _config(architecture_of(like, spec), spec, layers or spec.layers, dtype)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named as a hub checkpoint names it (llama.cpp's converter, among others, reads it)
    config.architectures = [type(model).__name__]
    tensors = [(name, tuple(t.shape)) for name, t in model.state_dict().items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")]
    return CheckpointPlan(config, tensors, dtype, spec)


def make_checkpoint(plan: CheckpointPlan, out_dir: str | Path, seed: int = 0,
                    shard_bytes: int = SHARD_BYTES) -> Path:
    """Write ``plan`` as a safetensors checkpoint folder (shards, index, config, tokenizer).

    The new checkpoint is written whole in a folder beside ``out_dir``, then switched
    into its place (``fileio.atomic_folder``): a killed or failed write (a full disk)
    leaves the old checkpoint as it was, never config.json without weights, and the
    next write removes the killed one's folder. Both fit on the disk for a moment."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise StmoeError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise StmoeError(f"{out}: a folder with other files in it; give a new or empty folder")
    _check_room(plan, out)
    from safetensors import SafetensorError

    try:
        with atomic_folder(out) as tmp:
            _write_checkpoint(plan, tmp, out.name, seed, shard_bytes)
    except SafetensorError as exc:  # safetensors' own error for a failed write (ENOSPC)
        raise StmoeError(f"{out}: the checkpoint could not be written ({exc}); the old "
                         "folder, if any, is unchanged") from None
    except OSError as exc:
        raise StmoeError(f"{out}: the checkpoint could not be written "
                         f"({exc.strerror or exc}); the old folder, if any, is "
                         "unchanged") from None
    return out


def _check_room(plan: CheckpointPlan, out: Path) -> None:
    """Refuse, before a byte is written, a checkpoint the disk cannot hold, or one whose
    largest tensor (made whole, then saved) the memory cannot."""
    where = existing_above(out.resolve())
    free, size = shutil.disk_usage(where).free, DTYPES[plan.dtype]
    largest = max((_numel(shape) * size for _, shape in plan.tensors), default=0)
    if plan.nbytes > free:
        raise StmoeError(f"{out}: the checkpoint takes {format_bytes(plan.nbytes)} and "
                         f"{where} has {format_bytes(free)} free; fewer --layers, or another "
                         "disk")
    if largest > (have := available_memory()):
        raise StmoeError(f"{out}: its largest tensor takes {format_bytes(largest)}, made whole "
                         f"in memory, and {format_bytes(have)} is available; a narrower spec")


def _write_checkpoint(plan: CheckpointPlan, out: Path, label: str, seed: int,
                      shard_bytes: int) -> None:
    """The checkpoint's files into the empty folder ``out`` (shards one at a time)."""
    import torch
    from safetensors.torch import save_file

    from stmoe.models import SHIPPED_MODEL
    from stmoe.util.progress import byte_progress

    shards = _shards(plan, shard_bytes)
    dtype = getattr(torch, plan.dtype)
    weight_map: dict[str, str] = {}
    with byte_progress(plan.nbytes, f"writing {label}") as advance:
        for i, names in enumerate(shards):
            fname = (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                     else "model.safetensors")
            tensors = {name: _random_tensor(name, shape, dtype, seed) for name, shape in names}
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, fname))
            advance(sum(t.numel() * t.element_size() for t in tensors.values()))
            del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": plan.nbytes}, "weight_map": weight_map}
        atomic_write_text(out / "model.safetensors.index.json", json.dumps(index, indent=1) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(SHIPPED_MODEL / name, out / name)
    plan.config.stmoe_random_weights = True  # (said by whatever runs it: `stmoe generate`)
    plan.config.save_pretrained(out)


def _config(model_type: str, spec: ModelSpec, layers: int, dtype: str) -> Any:
    from transformers import AutoConfig

    from stmoe.models import SHIPPED_MODEL

    shipped = json.loads((SHIPPED_MODEL / "config.json").read_text())
    common = dict(vocab_size=shipped["vocab_size"], hidden_size=spec.hidden,
                  num_hidden_layers=layers, num_attention_heads=spec.attention_heads,
                  num_key_value_heads=spec.kv_heads, num_experts_per_tok=spec.top_k,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  bos_token_id=shipped["bos_token_id"], eos_token_id=shipped["eos_token_id"],
                  pad_token_id=shipped["pad_token_id"], initializer_range=INIT_STD,
                  dtype=dtype)
    if model_type == "qwen2_moe":
        if spec.shared_intermediate <= 0:
            raise StmoeError(f"{spec.name}: qwen2_moe needs a shared expert (shared_intermediate)")
        extra = dict(moe_intermediate_size=spec.expert_intermediate, num_experts=spec.num_experts,
                     shared_expert_intermediate_size=spec.shared_intermediate,
                     intermediate_size=spec.shared_intermediate, decoder_sparse_step=1,
                     mlp_only_layers=[], qkv_bias=True)
    elif model_type == "qwen3_moe":
        extra = dict(moe_intermediate_size=spec.expert_intermediate, num_experts=spec.num_experts,
                     intermediate_size=spec.expert_intermediate * spec.top_k,
                     head_dim=spec.hidden // spec.attention_heads, decoder_sparse_step=1,
                     mlp_only_layers=[])
    elif model_type == "mixtral":
        extra = dict(intermediate_size=spec.expert_intermediate,
                     num_local_experts=spec.num_experts)
    elif model_type == "olmoe":
        extra = dict(intermediate_size=spec.expert_intermediate, num_experts=spec.num_experts)
    else:
        raise StmoeError(f"no config builder for architecture {model_type!r}")
    return AutoConfig.for_model(model_type, **common, **extra)


def _shards(plan: CheckpointPlan, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors grouped in order into shards of at most ``shard_bytes`` (one big tensor alone)."""
    size = DTYPES[plan.dtype]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in plan.tensors:
        nbytes = _numel(shape) * size
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    return shards


def _random_tensor(name: str, shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    """Norm weights 1, biases 0, everything else N(0, INIT_STD): depends on seed and name only."""
    import torch

    leaf = name.rsplit(".", 2)
    if name.endswith("norm.weight") or (len(leaf) > 1 and leaf[-2].endswith("norm")):
        return torch.ones(shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    out = torch.empty(shape, dtype=dtype)
    rows = out.view(shape[0], -1) if len(shape) > 1 else out.view(1, -1)
    for a in range(0, rows.shape[0], max(1, 2**26 // max(1, rows.shape[1]))):  # <= 256 MB f32
        b = min(rows.shape[0], a + max(1, 2**26 // max(1, rows.shape[1])))
        rows[a:b] = torch.randn(rows[a:b].shape, generator=gen) * INIT_STD
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
