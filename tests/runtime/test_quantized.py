"""Offloading in a quantized format: the lossless contract moves with the format.

The reference is the resident model quantized in memory (``quantize_model``); the
offloaded model, its experts read from a store packed in that format, must give the same
bits in every family, at every capacity, before and after its slots are shuffled. The
store is the same bytes whoever packs it (a folder expert by expert, a native model in
memory, the quantized model), records its format, and refuses to serve another one.
"""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.hf.capture_generate import capture_generation  # noqa: E402
from stmoe.hf.layout import experts_modules  # noqa: E402
from stmoe.predictors import profile, save_tables  # noqa: E402
from stmoe.quant import parse_format  # noqa: E402
from stmoe.quant.experts import quantize_expert, quantize_model  # noqa: E402
from stmoe.quant.linears import QuantizedLinear, quantize_linears  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.options import OffloadOptions  # noqa: E402
from stmoe.runtime.store import ExpertStore, StoreError, pack, pack_folder  # noqa: E402
from stmoe.runtime.store.index import checksum  # noqa: E402
from tiny_moe import FAMILIES, tiny_model  # noqa: E402

FORMATS = {"int8": parse_format("int8"), "int4": parse_format("int4", 32)}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # a batch of two, the second left-padded


def quantizable(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model whose expert matrices int4 in groups of 32 takes (in a multiple of 32)."""
    changes = {"moe_intermediate_size": 32} if "moe_intermediate_size" in FAMILIES[name][1] else {}
    return tiny_model(name, seed, **changes)[0]


def _generate(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, list(out.logits)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_offloaded_equals_the_resident_model_in_the_same_format(name, fmt, tmp_path):
    weights = FORMATS[fmt]
    resident = quantize_model(quantizable(name), weights)
    ref_seq, ref_logits = _generate(resident)
    store = pack(quantizable(name), tmp_path / "store", weights=weights)  # from native
    routing = capture_generation(quantizable(name), [[20, 21, 22, 23], [30, 31]],
                                 max_new_tokens=8)  # any routing of the shape serves
    tables = save_tables(profile(routing), tmp_path / "tables.npz")
    assert ExpertStore(store).weights == weights
    gen = torch.Generator().manual_seed(1)
    n = int(experts_modules(resident)[0][1].num_experts)
    for capacity in (2, 5, n):
        with offload(quantizable(name), store, capacity=capacity, tables=tables,
                     predictor="stmoe-plus" if capacity == 5 else "stmoe") as om:
            (seq, logits), stats = om.measure(lambda om=om: _generate(om.model))
            where = f"{name}, {fmt}, capacity {capacity}"
            assert om.config["weights"] == weights.short, where
            assert torch.equal(seq, ref_seq), where
            assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True)), where
            assert stats.bytes_moved > 0, where
            for trial in range(3):  # calls of several tokens on shuffled slots
                x = torch.randint(3, resident.config.vocab_size, (2, 5), generator=gen)
                with torch.no_grad():
                    got, want = om.model(input_ids=x).logits, resident(input_ids=x).logits
                assert torch.equal(got, want), (where, trial)
            om.engine.check()


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_every_packer_writes_the_same_bytes(name, tmp_path):
    """A folder packed expert by expert, the loaded native model and the model quantized in
    memory give one data file; each block is ``quantize_expert`` of the native expert."""
    weights = FORMATS["int4"]
    model = quantizable(name)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    a = pack_folder(folder, tmp_path / "a", weights=weights)
    b = pack(model, tmp_path / "b", weights=weights)
    native = copy.deepcopy(model)
    c = pack(quantize_model(model, weights), tmp_path / "c")
    data = [ExpertStore(s).data_path.read_bytes() for s in (a, b, c)]
    assert data[0] == data[1] == data[2]
    store = ExpertStore(a)
    module = experts_modules(native)[1][1]
    params = sorted((n, p) for n, p in module.named_parameters(recurse=False)
                    if p.shape[0] == module.num_experts)
    want = quantize_expert([(n, p.detach()[3]) for n, p in params], weights,
                           bool(module.is_transposed))
    got = store.read(1, 3)
    assert [n for n, _ in want] == sorted(got)
    for n, t in want:
        assert got[n].tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes(), n


def test_a_folder_offloaded_in_a_format_packs_its_own_store_once(tmp_path, monkeypatch):
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    model = quantizable("qwen3_moe")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    ref = _generate(quantize_model(copy.deepcopy(model), FORMATS["int8"]))
    with offload(folder, capacity=3, format="int8", predictor="ondemand") as om:
        assert om.config["weights_label"] == "int8 (per output channel, lossy)"
        seq, logits = _generate(om.model)
        first = om.config["store"]
    assert first.endswith("-int8") and torch.equal(seq, ref[0])
    assert all(torch.equal(a, b) for a, b in zip(logits, ref[1], strict=True))
    with offload(folder, capacity=3, format="int8", predictor="ondemand") as om:  # reused
        assert om.config["store"] == first
    with offload(folder, capacity=3, predictor="ondemand") as om:  # native: its own store
        assert om.config["store"] != first and om.config["weights"] == "native"
    with pytest.raises(StoreError, match=r"holds int8 \(per output channel, lossy\) experts, "
                                         r"not int4 \(groups of a size chosen"):
        offload(folder, store=first, format="int4", predictor="ondemand")


def test_a_version_3_store_still_loads(tmp_path):
    """Version 3 had no ``weights``: its experts are native and it serves as before."""
    model = quantizable("mixtral")
    ref = _generate(model)
    store = pack(model, tmp_path / "store")
    index = json.loads((store / "index.json").read_text())
    del index["weights"]
    index["version"] = 3
    index["checksum"] = checksum(index)
    (store / "index.json").write_text(json.dumps(index))
    assert ExpertStore(store).weights.name == "native"
    with offload(quantizable("mixtral"), store, capacity=3, predictor="ondemand") as om:
        seq, logits = _generate(om.model)
    assert torch.equal(seq, ref[0])
    assert all(torch.equal(a, b) for a, b in zip(logits, ref[1], strict=True))


def test_mismatched_formats_are_refused_before_the_model_changes(tmp_path):
    int8, int4 = FORMATS["int8"], FORMATS["int4"]
    store8 = pack(quantizable("olmoe"), tmp_path / "s8", weights=int8)
    model = quantizable("olmoe")
    with pytest.raises(OffloadError, match=r"s8: holds int8 .* not int4"):
        offload(model, store8, format="int4", group_size=32, predictor="ondemand")
    quantized = quantize_model(quantizable("olmoe"), int4)
    with pytest.raises(OffloadError, match=r"s8: holds int8 .* the model int4"):
        offload(quantized, store8, predictor="ondemand")
    with pytest.raises(StoreError, match=r"holds int4 .* cannot be packed as int8"):
        pack(quantized, tmp_path / "x", weights=int8)
    # a store of another model's weights: refused by its checksums, the model untouched
    other = pack(quantizable("olmoe", seed=1), tmp_path / "other", weights=int8)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(StoreError, match="holds other weights than the model's"):
        offload(model, other, predictor="ondemand")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # a matrix int4 cannot take (the tiny family's 16-wide experts): refused, naming it
    with pytest.raises(OffloadError, match=r"MoE layer 0: down_proj: .* groups of 32"):
        pack(tiny_model("qwen3_moe")[0], tmp_path / "y", weights=int4)


def test_int4_without_a_group_size_takes_one_that_divides_the_experts(tmp_path):
    """qwen3_moe's tiny experts are 32 and 32 wide (inputs): 128 and 64 do not divide 32,
    so groups of 32; a store packed so serves a request for int4 without a size, and a
    request for another size is refused."""
    store = pack(quantizable("qwen3_moe"), tmp_path / "s", weights=parse_format("int4"))
    assert ExpertStore(store).weights == FORMATS["int4"]
    with offload(quantizable("qwen3_moe"), store, format="int4", predictor="ondemand") as om:
        assert om.config["weights"] == "int4g32"
    with pytest.raises(OffloadError, match=r"not int4 \(groups of 64"):
        offload(quantizable("qwen3_moe"), store, format="int4", group_size=64,
                predictor="ondemand")
    assert parse_format("int4").resolved([2048, 1408]).group_size == 128  # Qwen1.5-MoE's
    assert parse_format("int4").resolved([192, 96]).group_size == 32  # the shipped model's
    assert parse_format("int4").resolved([192]).group_size == 64


@pytest.mark.parametrize("name, experts, resident", [("qwen2_moe", "int4", "int8"),
                                                     ("deepseek_v3", "int8", "int4")])
def test_quantized_resident_linears_are_bit_identical_offloaded(name, experts, resident, tmp_path):
    """--quantize-resident: the offloaded model with its attention, shared experts and
    lm_head quantized equals the resident model quantized the same way; gates stay native."""
    ref_model = quantize_model(quantizable(name), FORMATS[experts])
    kept = quantize_linears(ref_model, parse_format(resident))
    assert kept and all("(a gate)" in k or f"not {resident})" in k for k in kept), kept
    assert isinstance(ref_model.lm_head, QuantizedLinear)
    ref = _generate(ref_model)
    store = pack(quantizable(name), tmp_path / "store", weights=FORMATS[experts])
    with offload(quantizable(name), store, capacity=3, quantize_resident=resident,
                 predictor="ondemand") as om:
        seq, logits = _generate(om.model)
        assert om.config["resident_weights"] == resident and om.config["resident_kept"] == kept
    assert torch.equal(seq, ref[0])
    assert all(torch.equal(a, b) for a, b in zip(logits, ref[1], strict=True))
    with pytest.raises(OffloadError, match="quantize_resident 'native': expected int8 or int4"):
        OffloadOptions(quantize_resident="native").check()


def test_a_group_size_alone_asks_for_int4_in_those_groups():
    """Only int4 has a group size, so one given without a format asks for int4 of that
    size (an int4 store packed so is taken); with another format it is refused."""
    from stmoe.quant.formats import WeightFormat

    assert OffloadOptions(group_size=64).weight_format() == WeightFormat("int4", 64)
    assert OffloadOptions().weight_format() is None
    with pytest.raises(OffloadError, match="a group size is for int4 only, not int8"):
        OffloadOptions(format="int8", group_size=64).check()


def test_the_cli_packs_and_generates_in_a_format_and_says_so(cli, tmp_path):
    from conftest import one_line_error
    from stmoe.models import SHIPPED_MODEL

    res = cli("pack", SHIPPED_MODEL, "-o", tmp_path / "s4", "--format", "int4")
    assert res.exit_code == 0, res.output
    assert "int4 (groups of 32, lossy)" in res.output  # 192- and 96-wide inputs: 32
    args = ("generate", "--prompt", "def f(", "--max-new-tokens", "3", "--capacity", "50%")
    res = cli(*args, "--store", tmp_path / "s4")
    assert res.exit_code == 0, res.output
    assert "experts' weights" in res.output and "int4 (groups of 32, lossy)" in res.output
    one_line_error(cli(*args, "--store", tmp_path / "s4", "--format", "int8"),
                   "holds int4 (groups of 32, lossy) experts, not int8")
    res = cli(*args, "--store", tmp_path / "s4", "--group-size", "32")  # the store's groups
    assert res.exit_code == 0 and "int4 (groups of 32, lossy)" in res.output, res.output
    one_line_error(cli(*args, "--store", tmp_path / "s4", "--group-size", "64"),
                   "holds int4 (groups of 32, lossy) experts, not int4 (groups of 64",
                   "--format int4 --group-size 64")
    one_line_error(cli("pack", SHIPPED_MODEL, "-o", tmp_path / "x", "--format", "int4",
                       "--group-size", "64"), "down_proj", "groups of 64", "--group-size 32")
    one_line_error(cli("pack", SHIPPED_MODEL, "-o", tmp_path / "x", "--format", "int2"),
                   "weight format 'int2' is not one of native, int8, int4")
    res = cli(*args, "--format", "int8", "--json", "-")  # packed on first use, in int8
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config"]["weights"] == "int8"
