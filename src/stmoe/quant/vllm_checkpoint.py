"""A checkpoint's routed experts in int8, written in the compressed-tensors format vLLM loads.

Why: vLLM's CPU build computes int8 experts with its own kernel (``CPUExpertsInt8``: W8A8,
int8 weights with one scale per output row, each token's activations quantized to int8 as
it runs) when the checkpoint says so in compressed-tensors' terms. ``stmoe quantize``
writes such a checkpoint from a float one, each expert matrix quantized by stmoe's own
int8 (``quant.kernels.quantize_matrix``: symmetric, one scale per output row, the scale in
the model's dtype), so that the stmoe vLLM plugin can serve quantized experts (its store
then holds the int8 bytes: a quarter of float32's, half of bfloat16's). Lossy: the
user's choice, named in the config and in the plugin's log; its quality is measured
(docs/vllm.md).

Only the routed experts change: every other tensor is copied as it is, and the config
targets the experts alone (``re:`` patterns), so attention, the router, shared experts
and lm_head stay as they are (a float32 checkpoint's config says bfloat16: the kernel
takes 16-bit activations only, and vLLM casts the rest as it loads). Experts are written
one tensor per expert and matrix (``...experts.{e}.gate_proj.weight`` and its
``weight_scale``), the hub's layout vLLM's loaders know, whether the source stores them
so or fused (transformers 5's ``experts.gate_up_proj`` [N, 2I, H] and
``experts.down_proj`` [N, H, I]). One source shard is read and written at a time; the
folder is written beside the output and takes its place once whole.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from stmoe.errors import StmoeError
from stmoe.quant.formats import WeightFormat, parse_format
from stmoe.quant.kernels import dequantize, quantize_matrix

# a per-expert matrix (the hub's layout), and a fused one (transformers 5's)
PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<m>[a-z0-9_]+)\.weight$")
FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<m>gate_up_proj|down_proj)$")
# the per-expert matrices' names by architecture (gate, up, down), as vLLM loads them
NAMES = {"mixtral": ("w1", "w3", "w2")}
DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")
# what the config says: int8 weights, one scale per output row (channel), symmetric; the
# activations quantized per token as the kernel runs (dynamic) -- vLLM's CPU W8A8 kernel
INT8_SCHEME = {
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                          "strategy": "token", "dynamic": True},
}
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "stmoe-tables.npz")


@dataclass(frozen=True)
class QuantizeReport:
    """What ``quantize_checkpoint`` wrote: the expert matrices quantized and their error."""

    out: Path
    matrices: int
    experts_bytes_before: int
    experts_bytes_after: int
    mean_relative_error: float  # mean over matrices of ||W - dequant(Q)|| / ||W||


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path,
                        fmt_name: str = "int8") -> QuantizeReport:
    """``model_dir``'s checkpoint with its routed experts in ``fmt_name`` (int8), written
    to ``out_dir`` in the compressed-tensors format vLLM loads (see the module docstring)."""
    from safetensors import SafetensorError

    from stmoe.hf.loading import checkpoint_files
    from stmoe.util.fileio import atomic_folder

    fmt = parse_format(fmt_name)
    if fmt.name != "int8":
        raise StmoeError(f"--format {fmt.name}: vLLM's CPU kernel the plugin serves takes int8 "
                         "experts (compressed-tensors W8A8); only int8 is written")
    src, out = Path(model_dir), Path(out_dir)
    config = _read_config(src)
    if "quantization_config" in config:
        raise StmoeError(f"{src / 'config.json'}: already quantized "
                         f"({config['quantization_config'].get('quant_method', '?')}); give "
                         "a float checkpoint")
    files = [f for f in checkpoint_files(src) if f.suffix == ".safetensors"]
    if not files:
        raise StmoeError(f"{src}: no safetensors shards to quantize")
    if out.resolve() == src.resolve():
        raise StmoeError(f"{out}: the output must be another folder than the checkpoint")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StmoeError(f"{out}: exists and is not an empty folder; give a new one")
    names = NAMES.get(str(config.get("model_type")), DEFAULT_NAMES)
    stats = _Stats()
    try:
        with atomic_folder(out) as tmp:
            weight_map = _write_shards(files, tmp, fmt, names, stats)
            _write_meta(src, tmp, config, weight_map, len(files))
    except SafetensorError as exc:
        raise StmoeError(f"{out}: could not be written ({exc}); nothing was left there") from None
    except OSError as exc:
        raise StmoeError(f"{out}: could not be written ({exc.strerror or exc}); nothing was "
                         "left there") from None
    if not stats.matrices:
        shutil.rmtree(out, ignore_errors=True)
        raise StmoeError(f"{src}: no routed-expert matrices found (tensors named "
                         "...experts.E.NAME.weight or ...experts.gate_up_proj / down_proj)")
    return QuantizeReport(out, stats.matrices, stats.before, stats.after,
                          stats.error / stats.matrices)


class _Stats:
    def __init__(self) -> None:
        self.matrices, self.before, self.after, self.error = 0, 0, 0, 0.0

    def add(self, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
            fmt: WeightFormat) -> None:
        wf = w.float()
        err = torch.linalg.vector_norm(wf - dequantize(q, scale, fmt))
        self.error += float(err / torch.linalg.vector_norm(wf).clamp(min=1e-30))
        self.matrices += 1
        self.before += w.numel() * w.element_size()
        self.after += q.numel() + scale.numel() * scale.element_size()


def _read_config(src: Path) -> dict[str, object]:
    path = src / "config.json"
    if not path.is_file():
        raise StmoeError(f"{src}: no config.json; give a transformers checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StmoeError(f"{path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise StmoeError(f"{path}: expected a JSON object")
    return config


def _expert_matrices(name: str, t: torch.Tensor,
                     names: tuple[str, str, str]) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The per-expert matrices a source tensor holds, named as written (None: not experts)."""
    if m := PER_EXPERT.match(name):
        if t.dim() != 2:
            raise StmoeError(f"{name}: a {t.dim()}-d expert weight, expected a matrix")
        return iter([(name, t)])
    if m := FUSED.match(name):
        if t.dim() != 3:
            raise StmoeError(f"{name}: a {t.dim()}-d fused experts tensor, expected "
                             "[experts, out, in]")
        prefix = m["prefix"]
        if m["m"] == "down_proj":
            return ((f"{prefix}.{e}.{names[2]}.weight", t[e]) for e in range(t.shape[0]))
        if t.shape[1] % 2:
            raise StmoeError(f"{name}: gate_up_proj's rows ({t.shape[1]}) are not gate and up "
                             "halves")
        half = t.shape[1] // 2
        return (pair for e in range(t.shape[0]) for pair in (
            (f"{prefix}.{e}.{names[0]}.weight", t[e, :half]),
            (f"{prefix}.{e}.{names[1]}.weight", t[e, half:])))
    return None


def _write_shards(files: list[Path], out: Path, fmt: WeightFormat,
                  names: tuple[str, str, str], stats: _Stats) -> dict[str, str]:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from stmoe.util.progress import progress

    weight_map: dict[str, str] = {}
    for i, f in enumerate(progress(files, len(files), "quantizing experts")):
        fname = (f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" if len(files) > 1
                 else "model.safetensors")
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(f, "pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = shard.get_tensor(name)
                matrices = _expert_matrices(name, t, names)
                if matrices is None:
                    tensors[name] = t
                    continue
                for key, w in matrices:
                    q = quantize_matrix(w, fmt, key)
                    stats.add(w, q.qweight, q.qscale, fmt)
                    tensors[key] = q.qweight
                    tensors[key.removesuffix("weight") + "weight_scale"] = \
                        q.qscale.reshape(-1, 1).contiguous()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    return weight_map


def _write_meta(src: Path, out: Path, config: dict[str, object], weight_map: dict[str, str],
                shards: int) -> None:
    from stmoe.util.fileio import atomic_write_text

    config = dict(config)
    for key in ("dtype", "torch_dtype"):  # the int8 kernel takes 16-bit activations only
        if config.get(key) == "float32":
            config[key] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": [r"re:.*\.experts\.\d+\.[a-z0-9_]+$"],
                                      **INT8_SCHEME}},
        "ignore": [],
    }
    config["stmoe_quantized"] = (f"routed experts in stmoe's int8 (one scale per output row) "
                                 f"by `stmoe quantize` from {src.name}; the rest as there")
    atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        atomic_write_text(out / "model.safetensors.index.json", json.dumps(index, indent=1) + "\n")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
