"""Each layer's own cache size in the runtime (``capacity="2,8"`` or a list: a split sized
by ``stmoe.evaluate.layer_capacity``): the resident model's tokens, bit for bit, on every
tier and predictor tried; each cache holds its own count and never more; and the
forms the runtime cannot take are refused in one line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.runtime.accelerator import stand_in  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.prompts import greedy_generate  # noqa: E402
from tiny_moe import packed_with_tables, tiny_model  # noqa: E402

PROMPT = [20, 21, 22, 23, 24]
# 2 MoE layers of 8 experts, top-2, a dense layer between them (the split counts MoE layers)
SPLIT = (8, 3)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model, store, tables = packed_with_tables("qwen2_moe", tmp_path_factory.mktemp("split"))
    want = greedy_generate(model, torch.tensor([PROMPT]), 8, ignore_eos=True)
    return store, tables, want[0, len(PROMPT):].tolist()


def _run(om, tokens: int = 8) -> tuple[list[int], list[int]]:
    """The tokens, and the most experts each layer's cache held after any layer call."""
    peak = [0] * len(om.engine.caches)
    base = om.engine.experts_forward

    def watched(*args, **kwargs):
        out = base(*args, **kwargs)
        with om.engine.cv:
            for i, c in enumerate(om.engine.caches):
                peak[i] = max(peak[i], len(c.where))
        om.engine.check()
        return out

    om.engine.experts_forward = watched
    return om.generate(PROMPT, max_new_tokens=tokens).tokens, peak


@pytest.mark.parametrize("predictor,policy", [("ondemand", "lru"), ("stmoe", "lru"),
                                              ("stmoe-plus", "score"), ("oracle", "lru")])
@pytest.mark.parametrize("capacity", ["2,8", [3, 2]])
def test_each_layers_own_size_gives_the_resident_models_tokens(qwen, predictor, policy,
                                                              capacity):
    store, tables, want = qwen
    split = tuple(int(c) for c in (capacity.split(",") if isinstance(capacity, str)
                                   else capacity))
    with offload(tiny_model("qwen2_moe")[0], store, capacity=capacity, predictor=predictor,
                 policy=policy, tables=tables if predictor.startswith("stmoe") else None) as om:
        assert [c.capacity for c in om.engine.caches] == list(split)
        assert om.config["capacity"] == list(split)
        assert om.config["capacity_share"] == pytest.approx(sum(split) / 16)
        tokens, peak = _run(om)
    assert tokens == want
    assert all(p <= c for p, c in zip(peak, split, strict=True)), (peak, split)


@pytest.mark.parametrize("tier", ["gpu", "gpu-disk"])
def test_each_layers_own_size_on_the_gpu_tiers(qwen, tier):
    """The device caches and their slot events sized per layer (the CPU's stand-in, its
    copies landing late on another thread)."""
    store, tables, want = qwen
    with (stand_in(delay=0.001),
          offload(tiny_model("qwen2_moe")[0], store, capacity=list(SPLIT), predictor="stmoe",
                  tables=tables, tier=tier) as om):
        assert [len(e.ready) for e in om.engine.state.events] == list(SPLIT)
        tokens, peak = _run(om)
    assert tokens == want
    assert all(p <= c for p, c in zip(peak, SPLIT, strict=True))


def test_one_count_for_every_layer_is_still_one_number(qwen):
    store = qwen[0]
    with offload(tiny_model("qwen2_moe")[0], store, capacity="3,3", predictor="ondemand") as om:
        assert om.config["capacity"] == 3 and om.engine.capacities == (3, 3)


@pytest.mark.parametrize("capacity,message", [
    ("2,8,3", "3 counts for 2 MoE layers"),
    ("2,1", "capacity of layer 1 '1' gives 1 experts per layer, below the router's top-2"),
    ([2, 9], "capacity of layer 1 9: there are 8 experts per layer"),
    ("50%,3", "capacity of layer 0 '50%': not a count"),
])
def test_a_bad_split_is_refused_in_one_line(qwen, capacity, message):
    store, _, _ = qwen
    with pytest.raises(OffloadError, match=message):
        offload(tiny_model("qwen2_moe")[0], store, capacity=capacity, predictor="ondemand")


def test_a_split_beside_a_memory_budget_is_refused(qwen):
    store, _, _ = qwen
    with pytest.raises(OffloadError, match="give capacity or memory, not both"):
        offload(tiny_model("qwen2_moe")[0], store, capacity="2,8", predictor="ondemand",
                memory="4GB")
