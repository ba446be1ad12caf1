"""One matrix in int8 and int4: what is stored is what is computed, within the format's
rounding, deterministically; shapes the kernels cannot take are refused by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.quant import parse_format  # noqa: E402
from stmoe.quant.formats import format_from_json  # noqa: E402
from stmoe.quant.kernels import dequantize, qlinear, quantize_matrix  # noqa: E402

INT8, INT4 = parse_format("int8"), parse_format("int4", 32)


def test_int4_hand_worked_groups_are_exact():
    """A group holding -1 + 0.25 q for q = 0..15 (twice) has min -1, max 2.75: scale
    (2.75 + 1) / 15 = 0.25, zero = -1 + 8 x 0.25 = 1; every value is (q - 8) x 0.25 + 1
    exactly, so it comes back exactly. The second row is that row times 2 (scale 0.5)."""
    q = torch.arange(16, dtype=torch.float32).repeat(2)  # 32 = one group
    row = -1 + 0.25 * q
    w = torch.stack([row, 2 * row] * 8)  # 16 rows: the kernel needs a multiple of 16
    m = quantize_matrix(w, INT4)
    assert m.qscale.shape == (1, 16, 2)
    assert m.qscale[0, 0].tolist() == [0.25, 1.0] and m.qscale[0, 1].tolist() == [0.5, 2.0]
    assert torch.equal(dequantize(*m, INT4), w)


def test_int8_hand_worked_row_is_exact():
    """A row whose largest magnitude is 127 x 0.5 and every value a multiple of 0.5 has
    scale 0.5 and comes back exactly."""
    row = torch.tensor([63.5, -63.5, 0.5, -2.0] * 8)
    m = quantize_matrix(row.repeat(4, 1), INT8)
    assert m.qscale.tolist() == [0.5] * 4
    assert m.qweight[0, :4].tolist() == [127, -127, 1, -4]
    assert torch.equal(dequantize(*m, INT8), row.repeat(4, 1))


@pytest.mark.parametrize("fmt", [INT8, INT4, parse_format("int4", 64)], ids=lambda f: f.short)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_is_within_half_a_step_and_the_kernel_computes_the_stored_matrix(fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen).to(dtype)
    m = quantize_matrix(w, fmt)
    back = dequantize(*m, fmt)
    if fmt.name == "int8":  # one step per row
        step = m.qscale.float()[:, None]
    else:  # one step per group of the row
        step = m.qscale[..., 0].float().t().repeat_interleave(fmt.group_size, dim=1)
    # half a step, plus the zero's rounding to the model's dtype for int4
    slack = 0.5 * step + (0.01 * step if dtype == torch.bfloat16 else 1e-6)
    assert ((back - w.float()).abs() <= slack).all()
    x = torch.randn(3, 128, generator=gen).to(dtype)
    got = qlinear(x, m.qweight, m.qscale, fmt).float()
    want = x.float() @ back.t()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol
    again = quantize_matrix(w.clone(), fmt)  # deterministic: the same bytes
    assert torch.equal(again.qweight, m.qweight) and torch.equal(again.qscale, m.qscale)


def test_shapes_the_kernel_cannot_take_are_refused_by_name():
    with pytest.raises(OffloadError, match=r"down_proj: 32 x 16 .* groups of 32.*--group-size"):
        quantize_matrix(torch.zeros(32, 16), INT4, "down_proj")
    with pytest.raises(OffloadError, match="out a multiple of 16"):
        quantize_matrix(torch.zeros(24, 64), INT4)
    quantize_matrix(torch.zeros(24, 16), INT8)  # int8 takes any matrix


@pytest.mark.parametrize("name, group, message", [
    ("int3", None, "not one of native, int8, int4"),
    ("int4", 100, "expected one of 32, 64, 128, 256"),
    ("int8", 128, "group size is for int4 only"),
    ("int4", True, "expected one of 32"),
])
def test_bad_formats_are_refused(name, group, message):
    with pytest.raises(OffloadError, match=message):
        parse_format(name, group)


def test_names_and_the_file_form():
    assert parse_format("bf16").name == "native" and parse_format("INT4").group_size is None
    assert parse_format("int4", 64).label == "int4 (groups of 64, lossy)"
    assert format_from_json(INT4.to_json(), "f") == INT4
    with pytest.raises(OffloadError, match="f: weights: name 'bf16', expected one of"):
        format_from_json({"name": "bf16", "group_size": None}, "f")
    with pytest.raises(OffloadError, match="f: weights: expected"):
        format_from_json({"name": "int8"}, "f")
    with pytest.raises(OffloadError, match="f: weights: int4 without its group size"):
        format_from_json({"name": "int4", "group_size": None}, "f")
