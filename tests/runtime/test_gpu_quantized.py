"""int8 and int4 on the gpu tiers (issue 43, item 3): the quantized stores served to a device
cache, int4 held in the slots in CUDA's kernel layout (runtime.slot_layout), converted on the
copy's own stream after it lands. On the CPU: the stand-in device runs the whole path (its
kernels are the CPU's, so the reference is the resident model in the same format on the
CPU), the conversion is ordered after a late copy (a conversion run at launch would read the
slot's old bytes), and which parameters CUDA converts. On CUDA (the ``cuda`` marker; CI has
none): the offloaded int4/int8 model against the GPU-resident one, bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_quantized import FORMATS, _generate, quantizable  # noqa: E402

from staggered_requests import OnCuda  # noqa: E402
from stmoe.quant.cuda_kernels import cuda_int4_shape  # noqa: E402
from stmoe.quant.experts import quantize_model  # noqa: E402
from stmoe.runtime import slot_layout  # noqa: E402
from stmoe.runtime.accelerator import stand_in  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.cache import LayerCache, param_specs  # noqa: E402
from stmoe.runtime.slot_layout import SlotLayout, device_layouts  # noqa: E402
from stmoe.runtime.state import EngineState  # noqa: E402
from stmoe.runtime.store import ExpertStore, pack  # noqa: E402
from stmoe.runtime.store.loader import Loader  # noqa: E402
from stmoe.runtime.store.pinned import PinnedHostTier  # noqa: E402
from stmoe.runtime.store.stand_in import HostThreadOps, NoPinning  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CI has none")


@pytest.mark.parametrize("tier", ["gpu", "gpu-disk"])
@pytest.mark.parametrize("fmt", ["native", *FORMATS])
def test_a_quantized_store_on_a_gpu_tier_gives_the_resident_bits(tier, fmt, tmp_path):
    weights = FORMATS.get(fmt)  # (native: the logits too, a batch with left padding)
    ref = _generate(quantize_model(quantizable("qwen3_moe"), weights) if weights
                    else quantizable("qwen3_moe"))
    store = pack(quantizable("qwen3_moe"), tmp_path / "store", weights=weights)
    with stand_in(delay=0.001), offload(quantizable("qwen3_moe"), store, capacity=3,
                                        predictor="ondemand", tier=tier) as om:
        assert om.config["weights"] == (weights.short if weights else "native")
        assert om.engine.state.events is not None
        seq, logits = _generate(om.model)
    assert torch.equal(seq, ref[0])
    assert all(torch.equal(a, b) for a, b in zip(logits, ref[1], strict=True))


def test_quantized_resident_linears_on_a_gpu_tier(tmp_path):
    from stmoe.quant import parse_format
    from stmoe.quant.linears import quantize_linears

    ref_model = quantize_model(quantizable("olmoe"), FORMATS["int4"])
    quantize_linears(ref_model, parse_format("int8"))
    ref = _generate(ref_model)
    store = pack(quantizable("olmoe"), tmp_path / "store", weights=FORMATS["int4"])
    with stand_in(), offload(quantizable("olmoe"), store, capacity=3, predictor="ondemand",
                             tier="gpu", quantize_resident="int8") as om:
        seq, _ = _generate(om.model)
    assert torch.equal(seq, ref[0])


def _transposed(stored: torch.Tensor) -> torch.Tensor:
    return stored.t().contiguous()


def test_a_slots_layout_is_made_on_its_stream_after_the_late_copy(tmp_path):
    """A cache holding one parameter transposed (a stand-in for CUDA's int4 layout: the same
    bytes, arranged otherwise): after the ready event the slot holds exactly the stored
    tensor converted, though the copy landed late. Converting at launch, on the host, would
    convert the slot's old bytes and the copy would then overwrite them."""
    model, _ = tiny_model("mixtral")
    store = ExpertStore(pack(model, tmp_path / "store"))
    block = store.blocks[(0, 3)]
    specs = param_specs(block)
    down = next(p for p in specs if p.name == "down_proj")
    layouts = {"down_proj": SlotLayout(down.shape[::-1], down.dtype, _transposed)}
    cache = LayerCache(0, 2, specs, 8, "lru", torch.device("cpu"), layouts)
    assert cache.rows["down_proj"].shape[1:] == down.shape[::-1]
    ops = HostThreadOps(delay=0.05)
    tier = PinnedHostTier(store, NoPinning(), ops)
    try:
        state = EngineState([cache], store, Loader(tier, store), torch.device("cpu"))
        state.use_tier_events()
        ready = state.fill(cache, 1, block, None, ops.new_stream())
        assert ready is not None and not ready.query()  # queued, not landed
        ready.synchronize()
        want = model.model.layers[0].mlp.experts.down_proj.detach()[3]
        assert torch.equal(cache.rows["down_proj"][1], want.t())
        assert torch.equal(cache.rows["gate_up_proj"][1],
                           model.model.layers[0].mlp.experts.gate_up_proj.detach()[3])
    finally:
        tier.close()
        ops.close()


def test_a_row_moved_through_the_spare_buffer_keeps_its_slot_layout():
    """Putting a call's experts in id order may move a row through a one-row buffer (a
    cycle of moves): the buffer is a row as the slots hold it (CUDA's int4 layout: another
    shape and dtype than the store's), so the row comes back whole. A buffer in the
    store's shape failed on the copy (found reading the code; the stand-in has no layout)."""
    from stmoe.runtime.cache import TEMP, ParamSpec

    spec = ParamSpec("w_qweight", torch.uint8, (8, 16), 0, 128)
    layouts = {"w_qweight": SlotLayout((4, 2, 4), torch.int32, lambda t: t)}
    cache = LayerCache(0, 2, [spec], 8, "lru", torch.device("cpu"), layouts)
    rows = cache.rows["w_qweight"]
    assert rows.shape[1:] == (4, 2, 4) and rows.dtype == torch.int32
    rows[0] = torch.arange(32, dtype=torch.int32).view(4, 2, 4)
    rows[1] = -rows[0]
    temp = cache.row_buffer()
    want0, want1 = rows[0].clone(), rows[1].clone()
    for src, dst in ((0, TEMP), (1, 0), (TEMP, 1)):  # swap rows 0 and 1
        cache.copy_row(src, dst, temp)
    assert torch.equal(rows[0], want1) and torch.equal(rows[1], want0)


def test_cuda_holds_int4_matrices_in_its_kernels_layout(tmp_path, monkeypatch):
    store = ExpertStore(pack(quantizable("olmoe"), tmp_path / "s4", weights=FORMATS["int4"]))
    specs = param_specs(store.blocks[(0, 0)])
    assert device_layouts(specs, torch.device("cpu")) == {}  # the CPU computes the stored
    monkeypatch.setattr(slot_layout, "int4_kernel_takes", lambda k, dtype: True)
    lays = device_layouts(specs, torch.device("cuda"))
    assert sorted(lays) == sorted(p.name for p in specs if p.name.endswith("_qweight"))
    for p in specs:
        if p.name in lays:
            n, k = p.shape[0], 2 * p.shape[1]
            assert lays[p.name].shape == cuda_int4_shape(n, k)
            assert lays[p.name].dtype == torch.int32
            assert 4 * torch.Size(lays[p.name].shape).numel() == p.nbytes  # the same bytes
    monkeypatch.setattr(slot_layout, "int4_kernel_takes", lambda k, dtype: False)
    assert device_layouts(specs, torch.device("cuda")) == {}  # float32 scales: dequantized
    store8 = ExpertStore(pack(quantizable("olmoe"), tmp_path / "s8", weights=FORMATS["int8"]))
    monkeypatch.setattr(slot_layout, "int4_kernel_takes", lambda k, dtype: True)
    assert device_layouts(param_specs(store8.blocks[(0, 0)]), torch.device("cuda")) == {}


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("tier", ["gpu", "gpu-disk"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_on_cuda_the_offloaded_model_is_the_gpu_resident_one_bit_for_bit(tier, fmt, tmp_path):
    weights = FORMATS[fmt]

    def bf16() -> torch.nn.Module:
        return quantizable("olmoe").to(torch.bfloat16)

    resident = quantize_model(bf16(), weights).cuda()
    ref = _generate_on(resident)
    store = pack(bf16(), tmp_path / "store", weights=weights)
    for capacity in (2, 5):
        with offload(bf16(), store, capacity=capacity, predictor="ondemand", tier=tier) as om:
            caches = om.engine.caches
            if fmt == "int4":  # the slots in CUDA's layout, converted once at load
                assert caches[0].layouts and all(
                    caches[0].rows[n].dim() == 5 for n in caches[0].layouts)
            seq, logits = _generate_on(om.model)
        assert torch.equal(seq, ref[0]), (tier, fmt, capacity)
        assert all(torch.equal(a, b) for a, b in zip(logits, ref[1], strict=True))


@pytest.mark.cuda
@cuda
def test_on_cuda_quantized_resident_linears_are_the_gpu_resident_models(tmp_path):
    """``--quantize-resident`` on the GPU: int4 experts offloaded and int8 resident linears
    (attention, lm_head) computed with CUDA's kernels, against the same model resident on
    the GPU in the same formats, bf16."""
    from stmoe.quant import parse_format
    from stmoe.quant.linears import quantize_linears

    def bf16() -> torch.nn.Module:
        return quantizable("olmoe").to(torch.bfloat16)

    resident = quantize_model(bf16(), FORMATS["int4"])
    quantize_linears(resident, parse_format("int8"))
    ref = _generate_on(resident.cuda())
    store = pack(bf16(), tmp_path / "store", weights=FORMATS["int4"])
    with offload(bf16(), store, capacity=3, predictor="ondemand", tier="gpu",
                 quantize_resident="int8") as om:
        seq, logits = _generate_on(om.model)
    assert torch.equal(seq, ref[0])
    assert all(torch.equal(a, b) for a, b in zip(logits, ref[1], strict=True))


def _generate_on(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    seq, logits = _generate(OnCuda(model))
    return seq.cpu(), [x.cpu() for x in logits]

