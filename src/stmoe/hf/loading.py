"""A model from its local folder: whole (``load_model``, ``load_causal_lm``), or with
every weight except the routed experts' (``load_without_experts``); never from a hub.

Without its experts, the model is constructed with its parameters on the ``meta`` device (buffers,
such as rotary frequencies, are computed as usual), then the checkpoint's
non-expert tensors are loaded by name. The experts' tensors are never read, so
a model whose experts exceed memory still loads. A checkpoint whose names do not
match the model's (an older layout transformers converts on load) falls back
to a full load followed by releasing the experts; ``LoadedModel.full_load``
says which happened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stmoe.errors import StoreError
from stmoe.hf.capture import CaptureError
from stmoe.hf.layout import ModelLayout


def load_model(model_dir: str | Path) -> tuple[torch.nn.Module, Any]:
    """A causal LM and its tokenizer from a local folder; never contacts a hub."""
    from transformers import AutoTokenizer

    model = load_causal_lm(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CaptureError(f"{model_dir}: cannot load the tokenizer ({exc})") from None
    return model, tokenizer


def load_causal_lm(model_dir: str | Path) -> torch.nn.Module:
    """Only the model (in eval mode) from a local folder; never contacts a hub."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # one line of our own per failure, no library chatter
    hf_logging.disable_progress_bar()
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise CaptureError(f"{path}: no such folder; a local transformers checkpoint folder "
                           "is expected (stmoe never downloads)" if not path.exists() else
                           f"{path}: no config.json; a local transformers checkpoint folder "
                           "is expected (stmoe never downloads)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise CaptureError(f"{path}: no weights (*.safetensors or *.bin) next to config.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except _config_errors() as exc:
        raise CaptureError(f"{path}: cannot load the model ({_first_line(exc)})") from None
    except RuntimeError as exc:  # transformers 5: weights of other shapes than config.json's
        said = _first_line(exc)  # (its "look at the above report" points to a silenced log)
        if "mismatched_sizes" in said or "size mismatch" in said:
            raise CaptureError(f"{path}: cannot load the model: its weights do not match its "
                               "config.json (tensors of other shapes than it gives)") from None
        raise CaptureError(f"{path}: cannot load the model ({said})") from None  # (no memory)
    except ImportError as exc:  # a quantization config whose package is not installed
        raise CaptureError(f"{path}: transformers cannot load this checkpoint here "
                           f"({_first_line(exc)}); "
                           "a `stmoe quantize` folder is vLLM's: serve it there, or offload "
                           "the original model") from None
    return model.eval()


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a config.json it refuses: huggingface_hub's validation
    errors (which are not ValueErrors) where this release has them."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (OSError, ValueError)
    return (OSError, ValueError, StrictDataclassError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The files a model folder's weights load from: its safetensors shards (by their
    index, when there is one), else its ``*.safetensors``, else its ``*.bin``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
            names = sorted({str(s) for s in shards})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise StoreError(f"{index}: not a safetensors index (no weight_map)") from None
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))


@dataclass
class LoadedModel:
    model: torch.nn.Module
    full_load: bool  # True: the experts were materialised once (checkpoint names differ)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (no storage)."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def _weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (another format loads through transformers)."""
    return [f for f in checkpoint_files(model_dir) if f.suffix == ".safetensors"]


def conversions(model: torch.nn.Module) -> tuple[list[Any], list[Any]] | None:
    """transformers' own rules for reading ``model``'s checkpoint keys: (renamings, e.g.
    Mixtral's legacy ``block_sparse_moe`` -> ``mlp``; converters, e.g. per-expert tensors
    fused into one), or None with another transformers (keys taken as they are)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        transforms = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError, ValueError):  # another transformers
        return None
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    return renamings, [t for t in transforms if not isinstance(t, WeightRenaming)]


def _renamer(model: torch.nn.Module,
             prefixes: tuple[str, ...]) -> Callable[[str], tuple[str, bool]]:
    """Checkpoint key -> (the model's parameter name, by transformers' own renaming rules;
    whether a converter fusing several tensors makes it, unless it is an expert's)."""
    rules = conversions(model)
    if rules is None:
        return lambda key: (key, False)
    from transformers.core_model_loading import rename_source_key

    renamings, converters = rules

    def rename(key: str) -> tuple[str, bool]:
        name, converted = rename_source_key(key, renamings, converters)
        return name, converted is not None and not name.startswith(prefixes)

    return rename


def meta_model(model_dir: Path) -> torch.nn.Module:
    """The model of ``model_dir``'s config, every parameter on ``meta`` (shapes, no bytes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except _config_errors() as exc:
        raise CaptureError(f"{model_dir / 'config.json'}: transformers refuses it "
                           f"({_first_line(exc)})") from None
    dtype = getattr(config, "dtype", None) or torch.float32
    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_without_experts(model_dir: str | Path) -> LoadedModel:
    """The causal LM in ``model_dir`` (eval mode), its routed experts left on ``meta``."""
    from safetensors import safe_open
    from transformers import GenerationConfig

    path = Path(model_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    files = _weight_files(path) if (path / "config.json").is_file() else []
    if not files:
        return LoadedModel(load_causal_lm(path), full_load=True)  # its errors are clear
    model = meta_model(path)
    prefixes = ModelLayout.of(model).prefixes()
    rename = _renamer(model, prefixes)
    known = set(model.state_dict())
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                name, fused = rename(key)
                if name not in known:  # no place in the model (a multi-token-prediction
                    continue  # layer: DeepSeek-V3's, Qwen3.6's): transformers drops it too
                if fused:  # a converted (fused) weight: only transformers can load it
                    return LoadedModel(load_causal_lm(path), full_load=True)
                if not name.startswith(prefixes):
                    state[name] = handle.get_tensor(key)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta and not n.startswith(prefixes)]
    if missing:
        return LoadedModel(load_causal_lm(path), full_load=True)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return LoadedModel(model.eval(), full_load=False)
