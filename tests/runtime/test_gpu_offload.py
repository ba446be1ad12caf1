"""The gpu tiers by name through ``offload`` (issue 43): ``gpu`` and ``gpu-disk`` on the CPU's
stand-in for a GPU (runtime.accelerator.stand_in: every copy lands late on a thread of its
own stream), bit-identical to the resident model, the in-place store on ``gpu-disk``, and
``--memory``'s HBM plan from the device's free memory (the stand-in's, in place of
``torch.cuda.mem_get_info``), printed as the CPU plan is."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.runtime.accelerator import GPU_TIERS, stand_in  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.memory import DEVICE_RESERVE, MemoryPlan  # noqa: E402
from stmoe.runtime.options import TIERS, OffloadOptions  # noqa: E402
from stmoe.runtime.prompts import greedy_generate  # noqa: E402
from tiny_moe import packed_with_tables, tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10]
NEW = 5
GIB = 1 << 30


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model, store, tables = packed_with_tables("qwen2_moe", tmp_path_factory.mktemp("gpu"))
    return store, _greedy(model), tables


def _greedy(model) -> list[int]:
    """The resident model's greedy tokens after PROMPT (what every offloaded run must give)."""
    return greedy_generate(model, torch.tensor([PROMPT]), NEW, ignore_eos=True)[
        0, len(PROMPT):].tolist()


def test_the_gpu_tiers_are_names_offload_takes():
    assert set(GPU_TIERS) <= set(TIERS)
    assert OffloadOptions(tier="gpu-disk").worker_count() == 2  # a disk: reads in parallel
    assert OffloadOptions(tier="gpu").worker_count() == 1
    OffloadOptions(tier="gpu-disk", in_place=True).check()
    OffloadOptions(tier="gpu", format="int4").check()  # quantized stores on the GPU too
    with pytest.raises(OffloadError, match="tier disk or gpu-disk and format native only"):
        OffloadOptions(tier="gpu", in_place=True).check()


@pytest.mark.parametrize("tier", GPU_TIERS)
@pytest.mark.parametrize(("capacity", "predictor"), [(2, "ondemand"), (4, "stmoe-plus")])
def test_a_gpu_tier_on_the_stand_in_gives_the_resident_bits(qwen, tier, capacity, predictor):
    store, want, tables = qwen
    with stand_in(delay=0.002) as acc:
        fresh, _ = tiny_model("qwen2_moe")
        with offload(fresh, store, capacity=capacity, predictor=predictor, tier=tier,
                     workers=2, tables=None if predictor == "ondemand" else tables) as om:
            assert om.config["tier"] == tier and om.config["device"] == "cpu stand-in"
            assert om.engine.state.events is not None  # the slot protocol is in force
            assert om.engine.tier.ops is acc.ops
            r = om.generate(PROMPT, max_new_tokens=NEW)
            om.engine.check()
    assert r.tokens == want and r.bytes_moved > 0
    assert acc.ops.copies > 0  # every expert came through the stand-in's late copies


@pytest.mark.parametrize("tier", GPU_TIERS)
def test_score_eviction_on_the_stand_in_gives_the_resident_bits(qwen, tier):
    store, want, tables = qwen
    with stand_in(delay=0.002):
        fresh, _ = tiny_model("qwen2_moe")
        with offload(fresh, store, capacity=4, predictor="stmoe-plus", tables=tables,
                     tier=tier, workers=2, policy="score") as om:
            r = om.generate(PROMPT, max_new_tokens=NEW)
            om.engine.check()
            assert all(len(c.scores) > 0 for c in om.engine.caches)
    assert r.tokens == want and r.bytes_moved > 0


def test_gpu_disk_with_more_workers_than_the_default_bounce_buffers_does_not_hang(qwen):
    """A prefetch worker keeps its bounce buffer while it pauses for the compute thread's
    stall: with as many workers as buffers, the compute thread's demand read could wait for
    a buffer none of them gives back (found reading the code; at this model's sizes the
    old pool of 4 did not hang in 5 runs of 5 tokens). The pool has a buffer more than the
    workers, and 6 workers run to the resident model's tokens."""
    import threading

    from stmoe.runtime.store.bounce import DEFAULT_BUFFERS, bounce_buffers

    assert bounce_buffers(2) == DEFAULT_BUFFERS and bounce_buffers(6) == 7
    store, want, tables = qwen
    got: list[list[int]] = []

    def run() -> None:
        with stand_in(delay=0.003):
            fresh, _ = tiny_model("qwen2_moe")
            with offload(fresh, store, capacity=2, predictor="stmoe-plus", tier="gpu-disk",
                         workers=6, tables=tables) as om:
                assert om.engine.tier.pool.buffers.__len__() == 7
                got.append(om.generate(PROMPT, max_new_tokens=NEW).tokens)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "gpu-disk with 6 workers hung"
    assert got == [want]


def test_caches_on_cuda_behind_a_host_tier_are_refused_before_anything_is_made(qwen):
    """A model already on the GPU offloaded with ``tier=disk`` would put its caches on the
    GPU, filled by blocking host copies with no event between a slot's queued readers and
    its next copy: refused in one line (no CUDA is touched: the check comes first)."""
    from stmoe.hf.layout import ModelLayout
    from stmoe.predictors.base import ModelShape
    from stmoe.runtime.engine import OffloadEngine
    from stmoe.runtime.options import resolve_predictor
    from stmoe.runtime.state import EngineSettings
    from stmoe.runtime.store import ExpertStore
    from stmoe.runtime.store.tiers import DiskTier

    store = ExpertStore(qwen[0])
    fresh, _ = tiny_model("qwen2_moe")
    layout = ModelLayout.of(fresh)
    shape = ModelShape(layout.num_layers, int(store.model["num_experts"]), 2)
    pred = resolve_predictor(OffloadOptions(predictor="ondemand"), shape, None)
    tier = DiskTier(store)
    settings = EngineSettings(2, "lru", 0, torch.device("cuda"), None, False)
    try:
        with pytest.raises(OffloadError, match=r"^the model is on cuda, and tier 'disk'") as e:
            OffloadEngine(fresh, store, tier, pred, settings, layout)
        assert "\n" not in str(e.value) and "--tier gpu or gpu-disk" in str(e.value)
    finally:
        tier.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_without_a_gpu_the_gpu_disk_tier_is_refused_in_one_line(qwen):
    store = qwen[0]
    fresh, _ = tiny_model("qwen2_moe")
    with pytest.raises(OffloadError, match=r"^--tier gpu-disk needs CUDA, and torch sees no GPU"):
        offload(fresh, store, tier="gpu-disk", predictor="ondemand")


def test_an_in_place_checkpoint_is_read_to_the_gpu_from_the_disk(tmp_path):
    from checkpoint_folders import saved_folder
    from stmoe.hf.loading import load_causal_lm

    folder = saved_folder("mixtral", tmp_path / "model")
    want = _greedy(load_causal_lm(folder))
    with stand_in(delay=0.001), offload(folder, in_place=True, tier="gpu-disk", capacity=2,
                                        predictor="ondemand") as om:
        assert om.config["in_place"] is True and om.config["tier"] == "gpu-disk"
        tokens = om.generate(PROMPT, max_new_tokens=NEW).tokens
    assert tokens == want
    with pytest.raises(OffloadError, match="tier disk or gpu-disk"):
        offload(folder, in_place=True, tier="gpu")


def _planned(store, tier: str, free: int, memory: str = "8GB") -> dict:
    with stand_in(free_bytes=free):
        fresh, _ = tiny_model("qwen2_moe")
        with offload(fresh, store, memory=memory, predictor="ondemand", tier=tier) as om:
            return om.config


def test_memory_on_a_gpu_tier_sizes_the_slots_from_the_devices_free_memory(qwen):
    store = qwen[0]
    expert = store_expert_bytes(store)
    layers, experts = 2, 8
    config = _planned(store, "gpu-disk", DEVICE_RESERVE + 64 << 20)
    plan = config["memory_plan"]
    dev = plan["device"]
    assert dev["free"] == DEVICE_RESERVE + 64 << 20  # the stand-in's free memory, as planned
    assert dev["resident"] > 0 and dev["kv"] > 0
    room = dev["free"] - dev["resident"] - dev["kv"] - DEVICE_RESERVE - experts * expert
    assert dev["per_layer"] == min(experts, room // (layers * expert)) == config["capacity"]
    # a GPU with room for exactly 3 experts a layer gets 3
    free = dev["resident"] + dev["kv"] + DEVICE_RESERVE + experts * expert + 3 * layers * expert
    assert _planned(store, "gpu-disk", free)["capacity"] == 3
    text = MemoryPlan(**plan).describe()
    assert "free on the GPU" in text and "pinned bounce buffers" in text
    assert f"{dev['per_layer']} experts per layer" in text


def test_too_little_gpu_or_host_memory_is_refused_naming_what_would_do(qwen):
    store = qwen[0]
    with pytest.raises(OffloadError, match=r"the GPU has 0\.50 GiB free, too little .* top-2"):
        _planned(store, "gpu-disk", GIB // 2)
    with pytest.raises(OffloadError, match=r"of the store pinned in host memory .*--tier "
                                           r"gpu-disk keeps only a few bounce buffers"):
        _planned(store, "gpu", 4 * GIB, memory="1MB")


def test_generate_prints_the_gpu_plan_as_the_cpu_one(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    with stand_in(free_bytes=2 * GIB):
        res = cli("generate", "--prompt", "def fib(n):", "--max-new-tokens", "2", "--tier",
                  "gpu-disk", "--memory", "8GB", "--predictor", "ondemand")
    assert res.exit_code == 0, res.output
    text = res.output  # (the table wraps its lines)
    assert "2.00 GiB free on" in text and "resident weights" in text and "slots" in text


def store_expert_bytes(store) -> int:
    from stmoe.runtime.store import ExpertStore

    return ExpertStore(store).blocks[(0, 0)].nbytes


def test_moving_the_resident_weights_leaves_the_experts_and_keeps_ties():
    """A model loaded whole and offloaded to a GPU: its experts are not copied to the
    device (they stay on the host until the engine releases them; a model bigger than the
    GPU would not fit otherwise), and a weight two modules share stays one tensor. Moved
    to ``meta`` here, which any device stands for: what moved is what is on meta."""
    from stmoe.hf.layout import experts_modules
    from stmoe.runtime.placement import move_resident

    model, _ = tiny_model("qwen2_moe")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many checkpoints are
    move_resident(model, torch.device("meta"))
    experts = [p for _, m in experts_modules(model) for p in m.parameters()]
    assert experts and not any(p.is_meta for p in experts)
    others = {id(p) for p in experts}
    assert all(p.is_meta for p in model.parameters() if id(p) not in others)
    assert model.lm_head.weight is model.model.embed_tokens.weight
