"""make-model: a random checkpoint of a preset's exact shape that pack and generate run on."""

from __future__ import annotations

import json
import re

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


def test_sizes_beyond_any_checkpoint_and_a_disk_or_memory_too_small_are_refused(tmp_path,
                                                                                 monkeypatch):
    """(A reliability review: a spec of 10^18 experts was a torch traceback, one of 10^8
    layers hung building its meta model, and one of 8 TiB tried to allocate 737 GB.)"""
    import shutil

    import stmoe.hf.checkpoints as ckpt

    tiny = (tmp_path / "tiny.toml")
    spec = model_preset("stmoe-tiny")
    lines = [f"{k} = {json.dumps(getattr(spec, k))}" for k in spec.__dataclass_fields__
             if k != "name"]
    for key, value, said in (("num_experts", 10**18, "num_experts is 1000000000000000000, "
                              "beyond any checkpoint stmoe makes (at most 32767)"),
                             ("layers", 10**8, "layers is 100000000, beyond")):
        tiny.write_text("\n".join(f"{key} = {value}" if line.startswith(f"{key} =") else line
                                  for line in lines) + "\n")
        with pytest.raises(StmoeError, match=re.escape(said)):
            plan_checkpoint(str(tiny))
    plan = plan_checkpoint("stmoe-tiny", layers=1)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(StmoeError, match=r"the checkpoint takes [\d.]+ [KM]iB and .* has 1000 "
                                         r"bytes free"):
        make_checkpoint(plan, tmp_path / "m")
    monkeypatch.undo()
    monkeypatch.setattr(ckpt, "available_memory", lambda: 1000)
    with pytest.raises(StmoeError, match=r"its largest tensor takes .* made whole in memory"):
        make_checkpoint(plan, tmp_path / "m")
    assert not (tmp_path / "m").exists()


# ---- issue 30, item 3: a new checkpoint is written beside the old one and switched ------


class Killed(BaseException):
    """A kill: nothing in stmoe catches it, so only what is on disk is left."""


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _steps(monkeypatch, plan, fail_at, exc):
    """Count every write step of make_checkpoint (each shard, the shard index, each
    tokenizer file, the config); raise ``exc`` at step ``fail_at`` after half a file."""
    import shutil

    import safetensors.torch

    import stmoe.hf.checkpoints as ckpt

    seen = []

    def step(name, real):
        def wrapped(*args, **kwargs):
            seen.append(name)
            if len(seen) - 1 == fail_at:
                target = str(args[1] if name == "copy" else args[0] if name == "index"
                             else args[1])
                if name != "config":
                    open(target, "wb").write(b"half")  # noqa: SIM115 - a cut write
                raise exc
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(safetensors.torch, "save_file",
                        step("shard", safetensors.torch.save_file))
    monkeypatch.setattr(ckpt, "atomic_write_text", step("index", ckpt.atomic_write_text))
    monkeypatch.setattr(shutil, "copyfile", step("copy", shutil.copyfile))
    cls = type(plan.config)
    monkeypatch.setattr(cls, "save_pretrained", step("config", cls.save_pretrained))
    return seen


def test_a_kill_at_each_write_step_keeps_the_old_checkpoint_and_no_temp(tmp_path, monkeypatch):
    plan = plan_checkpoint("stmoe-tiny", layers=2, dtype="float32")
    out = make_checkpoint(plan, tmp_path / "m", seed=1, shard_bytes=200_000)
    before = _files(out)
    counted = _steps(monkeypatch, plan, -1, Killed())
    make_checkpoint(plan, tmp_path / "count", seed=2, shard_bytes=200_000)
    steps = len(counted)
    assert steps >= 6 and counted.count("shard") > 1  # shards, index, tokenizer, config
    for fail_at in range(steps):
        monkeypatch.undo()
        _steps(monkeypatch, plan, fail_at, Killed())
        with pytest.raises(Killed):
            make_checkpoint(plan, out, seed=2, shard_bytes=200_000)
        assert _files(out) == before, fail_at  # the old weights and config, byte for byte
        assert sorted(p.name for p in tmp_path.iterdir()) == ["count", "m"], fail_at
    monkeypatch.undo()
    again = make_checkpoint(plan, out, seed=2, shard_bytes=200_000)
    assert _files(again) == _files(tmp_path / "count")  # the new one, whole


def test_a_killed_runs_folder_is_removed_by_the_next_run(tmp_path):
    import subprocess
    import sys

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)
    plan = plan_checkpoint("stmoe-tiny", layers=1, dtype="float32")
    stale = tmp_path / f".m.{dead}.abcd.tmp"
    stale.mkdir()
    (stale / "model-00001-of-00003.safetensors").write_bytes(b"\0" * 1000)
    make_checkpoint(plan, tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert not any(p.name.startswith(".") for p in (tmp_path / "m").iterdir())


def test_a_full_disk_is_one_line_and_the_old_checkpoint_stays(tmp_path, monkeypatch, cli):
    from safetensors import SafetensorError

    out = tmp_path / "m"
    assert cli("make-model", "--like", "stmoe-tiny", "--layers", "1", "-o", out).exit_code == 0
    before = _files(out)
    full = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                           'StorageFull, message: "No space left on device" })')
    import safetensors.torch

    def no_room(tensors, filename, metadata=None):
        open(filename, "wb").write(b"cut")  # noqa: SIM115 - the part that fitted
        raise full

    monkeypatch.setattr(safetensors.torch, "save_file", no_room)
    res = cli("make-model", "--like", "stmoe-tiny", "--layers", "1", "--seed", "5", "-o", out)
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    error = res.output.strip().splitlines()[-1]  # after the plan's one line
    assert error.startswith("error: ") and len(res.output.strip().splitlines()) == 2
    for fragment in (str(out), "No space left on device", "unchanged"):
        assert fragment in error, (fragment, error)
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
