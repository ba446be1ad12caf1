"""make-model: a random checkpoint of a preset's exact shape that pack and generate run on."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from stmoe.errors import StmoeError  # noqa: E402
from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.sim.specs import model_preset  # noqa: E402


def _experts_shape(path, spec):
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if ".experts." in k}  # noqa: SIM118


@pytest.mark.parametrize("like", ["stmoe-tiny", "qwen3-30b-a3b"])
def test_the_checkpoint_has_the_presets_dimensions(like):
    spec = model_preset(like)
    plan = plan_checkpoint(like, layers=1)
    cfg = plan.config
    assert cfg.num_hidden_layers == 1
    assert cfg.hidden_size == spec.hidden
    assert cfg.num_experts_per_tok == spec.top_k
    assert cfg.num_attention_heads == spec.attention_heads
    assert cfg.num_key_value_heads == spec.kv_heads
    experts = {n: s for n, s in plan.tensors if ".experts." in n}
    total = sum(int(torch.tensor(s).prod()) for s in experts.values())
    # every routed expert's gate, up and down projections, nothing more
    assert total == spec.num_experts * 3 * spec.hidden * spec.expert_intermediate
    assert plan.nbytes > total * 2


def test_make_model_pack_and_generate_match_plain_transformers(tmp_path, cli):
    from transformers import AutoModelForCausalLM

    res = cli("make-model", "--like", "stmoe-tiny", "--layers", "3", "--dtype", "float32",
              "-o", tmp_path / "m")
    assert res.exit_code == 0, res.output
    assert "RANDOM weights" in res.output
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["moe_intermediate_size"] == 96
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = plain.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                              pad_token_id=0)[0, 4:].tolist()
    assert cli("pack", tmp_path / "m", "-o", tmp_path / "store").exit_code == 0
    with offload(tmp_path / "m", tmp_path / "store", capacity=8, predictor="random") as om:
        got = om.generate([5, 6, 7, 8], max_new_tokens=5)
    assert got.tokens == want


def test_shards_are_deterministic_and_indexed(tmp_path):
    plan = plan_checkpoint("stmoe-tiny", layers=2, dtype="float32")
    a = make_checkpoint(plan, tmp_path / "a", seed=3, shard_bytes=200_000)
    b = make_checkpoint(plan, tmp_path / "b", seed=3, shard_bytes=200_000)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert sorted(index["weight_map"]) == sorted(n for n, _ in plan.tensors)
    for s in shards:
        assert (a / s).read_bytes() == (b / s).read_bytes()
    c = make_checkpoint(plan, tmp_path / "c", seed=4, shard_bytes=200_000)
    assert (a / shards[-1]).read_bytes() != (c / shards[-1]).read_bytes()


def test_bad_requests_are_clear_errors(tmp_path):
    with pytest.raises(StmoeError, match="no transformers architecture"):
        plan_checkpoint("deepseek-v2-lite")
    with pytest.raises(StmoeError, match=r"expected 1\.\.8"):
        plan_checkpoint("stmoe-tiny", layers=0)
    with pytest.raises(StmoeError, match="--dtype"):
        plan_checkpoint("stmoe-tiny", dtype="int8")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(StmoeError, match="other files"):
        make_checkpoint(plan_checkpoint("stmoe-tiny", layers=1), busy)
