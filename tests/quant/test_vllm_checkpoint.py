"""``stmoe quantize``: a checkpoint's routed experts in stmoe's int8, written in the
compressed-tensors W8A8 format vLLM loads (tests/vllm_plugin/test_int8_experts.py serves it in
vLLM). Each expert matrix's bytes are what ``quantize_matrix`` gives, every other tensor is
the source's bytes, fused experts are split per expert, and bad input is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stmoe.errors import StmoeError
from stmoe.models import SHIPPED_MODEL
from stmoe.quant import parse_format
from stmoe.quant.kernels import quantize_matrix
from stmoe.quant.vllm_checkpoint import quantize_checkpoint


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118
    return out


def test_the_shipped_models_experts_in_stmoes_int8_the_rest_unchanged(tmp_path):
    report = quantize_checkpoint(SHIPPED_MODEL, tmp_path / "q", "int8")
    src, got = _tensors(SHIPPED_MODEL), _tensors(tmp_path / "q")
    experts = [k for k in src if ".mlp.experts." in k]
    assert report.matrices == len(experts) == 8 * 16 * 3
    fmt = parse_format("int8")
    for k, t in src.items():
        if k in experts:
            want = quantize_matrix(t, fmt, k)
            assert got[k].dtype == torch.int8 and torch.equal(got[k], want.qweight), k
            scale = got[k.removesuffix("weight") + "weight_scale"]
            assert scale.shape == (t.shape[0], 1) and torch.equal(scale[:, 0], want.qscale)
        else:
            assert torch.equal(got[k], t), k
    assert len(got) == len(src) + len(experts)  # one scale per expert matrix
    assert 0 < report.mean_relative_error < 0.02
    assert report.experts_bytes_after < 0.3 * report.experts_bytes_before
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and config["dtype"] == "bfloat16"
    group = q["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True,
                                          "strategy": "token", "dynamic": True}
    assert (tmp_path / "q" / "stmoe-tables.npz").read_bytes() == \
        (SHIPPED_MODEL / "stmoe-tables.npz").read_bytes()
    assert (tmp_path / "q" / "tokenizer.json").is_file()


def _fused_checkpoint(folder: Path, model_type: str = "qwen3_moe") -> dict[str, torch.Tensor]:
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 2 * 32, 16, generator=g),
               "model.layers.0.mlp.experts.down_proj": torch.randn(3, 16, 32, generator=g),
               "model.layers.0.mlp.gate.weight": torch.randn(3, 16, generator=g)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type,
                                                    "dtype": "float32"}))
    return tensors


@pytest.mark.parametrize("model_type,names", [("qwen3_moe", ("gate_proj", "up_proj", "down_proj")),
                                              ("mixtral", ("w1", "w3", "w2"))])
def test_fused_experts_are_split_per_expert_in_the_architectures_names(tmp_path, model_type,
                                                                       names):
    src = _fused_checkpoint(tmp_path / "src", model_type)
    quantize_checkpoint(tmp_path / "src", tmp_path / "q")
    got = _tensors(tmp_path / "q")
    fmt = parse_format("int8")
    gate_up, down = src["model.layers.0.mlp.experts.gate_up_proj"], src[
        "model.layers.0.mlp.experts.down_proj"]
    for e in range(3):
        for name, w in zip(names, (gate_up[e, :32], gate_up[e, 32:], down[e]), strict=True):
            key = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            assert torch.equal(got[key], quantize_matrix(w, fmt).qweight), key
    assert "model.layers.0.mlp.experts.gate_up_proj" not in got
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], src["model.layers.0.mlp.gate.weight"])


def test_bad_input_is_refused_by_name(tmp_path):
    with pytest.raises(StmoeError, match=r"no config\.json"):
        quantize_checkpoint(tmp_path, tmp_path / "q")
    _fused_checkpoint(tmp_path / "src")
    with pytest.raises(StmoeError, match="only int8 is written"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "q", "int4")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(StmoeError, match="full: exists and is not an empty folder"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "full")
    with pytest.raises(StmoeError, match="another folder than the checkpoint"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "q")
    with pytest.raises(StmoeError, match="already quantized \\(compressed-tensors\\)"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "q2")
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(plain / "model.safetensors"))
    (plain / "config.json").write_text("{}")
    with pytest.raises(StmoeError, match="no routed-expert matrices found"):
        quantize_checkpoint(plain, tmp_path / "q3")
    assert not (tmp_path / "q3").exists()
    (plain / "config.json").write_text("[1")
    with pytest.raises(StmoeError, match=r"config\.json: not JSON"):
        quantize_checkpoint(plain, tmp_path / "q4")


def test_the_command_says_it_is_lossy(tmp_path):
    from typer.testing import CliRunner

    from stmoe.cli import app

    _fused_checkpoint(tmp_path / "src")
    r = CliRunner().invoke(app, ["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    assert "9 expert matrices in int8 W8A8 (LOSSY: mean relative weight error" in r.output
    r = CliRunner().invoke(app, ["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "q")])
    assert r.exit_code == 1 and "exists and is not an empty folder" in r.output


def test_offloading_a_quantized_folder_is_one_line(tmp_path):
    """`stmoe generate` and `stmoe pack` of a `stmoe quantize` folder said "unexpected
    input" (an ImportError, without compressed-tensors); any checkpoint quantized by another
    tool is now refused before loading, in one line that says what the folder is for."""
    from typer.testing import CliRunner

    from stmoe.cli import app

    quantize_checkpoint(SHIPPED_MODEL, tmp_path / "q", "int8")
    for args in (["generate", "--model", str(tmp_path / "q"), "--prompt", "hi"],
                 ["pack", str(tmp_path / "q"), "-o", str(tmp_path / "s")]):
        r = CliRunner().invoke(app, args)
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and "quantized by another tool (compressed-tensors)" in said, said
        assert "a `stmoe quantize` folder is vLLM's" in said and "Traceback" not in said
