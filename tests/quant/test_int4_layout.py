"""int4's packed layouts: the stored bytes back to the values they were packed from, in
every CPU layout torch packs (this build's, and the other builds' through
``ATEN_CPU_CAPABILITY`` in a child process), and the values as CUDA's converter takes them;
the dequantized fallback against the CPU kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.quant import parse_format  # noqa: E402
from stmoe.quant.cuda_kernels import (  # noqa: E402
    cuda_int4_shape,
    dequantized_linear,
    inner_k_tiles,
)
from stmoe.quant.int4_layout import (  # noqa: E402
    LAYOUTS,
    cpu_layout,
    cuda_nibbles,
    dequantize_int4,
    from_cuda_nibbles,
    pack_cpu_int4,
    unpack_cpu_int4,
)
from stmoe.quant.kernels import dequantize, qlinear, quantize_matrix  # noqa: E402

# rows: full blocks of 32 and 64, and partial last blocks of 16, 48 (the plain pairing)
SHAPES = [(16, 32), (48, 64), (64, 128), (80, 96), (96, 256), (112, 64), (176, 32)]


def _values(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_unpack_gives_back_the_values_torch_packed_on_this_cpu(shape):
    q = _values(*shape)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(unpack_cpu_int4(packed), q.to(torch.uint8))
    assert torch.equal(pack_cpu_int4(q), packed)


_CHILD = """
import json, sys, torch
out = {"capability": torch.backends.cpu.get_cpu_capability().lower(), "packed": []}
for n, k in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    out["packed"].append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).numpy()
                         .tobytes().hex())
print(json.dumps(out))
"""


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_the_other_cpu_builds_layouts_are_read_too(capability):
    """torch packs otherwise where it runs other CPU code: a store made there is another
    byte order. A child process forced to that capability packs; its bytes unpack to the
    same values with that layout (on a machine without it torch falls back to a lower one
    and reports it, which is then the layout checked)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(SHAPES)], env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    out = json.loads(run.stdout)
    layout = out["capability"] if out["capability"] in LAYOUTS else "default"
    for (n, k), hexed in zip(SHAPES, out["packed"], strict=True):
        packed = torch.frombuffer(bytearray.fromhex(hexed), dtype=torch.uint8).reshape(n, k // 2)
        q = _values(n, k)
        assert torch.equal(unpack_cpu_int4(packed, layout), q.to(torch.uint8)), (n, k)
        assert torch.equal(pack_cpu_int4(q, layout), packed), (n, k)


def test_the_layouts_differ_so_a_store_records_which():
    q = _values(128, 64)
    packs = {name: pack_cpu_int4(q, name) for name in LAYOUTS}
    assert not torch.equal(packs["avx512"], packs["avx2"])
    assert not torch.equal(packs["avx2"], packs["default"])
    assert cpu_layout() in LAYOUTS
    for name, packed in packs.items():  # repacking between layouts is exact
        other = "default" if name != "default" else "avx512"
        moved = pack_cpu_int4(unpack_cpu_int4(packed, name), other)
        assert torch.equal(moved, packs[other])


def test_cuda_nibbles_put_the_even_value_high():
    q = torch.tensor([[1, 2, 3, 4] * 8] * 16)
    nib = cuda_nibbles(q)
    assert nib.shape == (16, 16) and nib.dtype == torch.uint8
    assert nib[0, :2].tolist() == [0x12, 0x34]


@pytest.mark.parametrize("group", [32, 64])
def test_quantize_then_unpack_gives_what_the_cpu_kernel_computes(group):
    """quantize -> the CPU pack -> unpack: the values, dequantized, are the matrix the
    kernel computes with (the kernel's own dequantization: an identity input)."""
    fmt = parse_format("int4", group)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(80, 128, generator=gen).to(dtype)
        m = quantize_matrix(w, fmt)
        values = unpack_cpu_int4(m.qweight)
        assert int(values.max()) <= 15
        ours = dequantize_int4(values, m.qscale, group)
        assert torch.allclose(ours, dequantize(*m, fmt), rtol=0, atol=1e-6 * ours.abs().max())
        x = torch.randn(3, 128, generator=gen).to(dtype)
        got = dequantized_linear(x, m.qweight, m.qscale, fmt).float()
        want = qlinear(x, m.qweight, m.qscale, fmt).float()
        tol = 1e-4 if dtype == torch.float32 else 0.02 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol


def test_cuda_tiling_of_each_width():
    assert [inner_k_tiles(k) for k in (32, 64, 96, 128, 256, 2048, 48)] == [2, 4, 2, 8, 8, 8,
                                                                          None]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_stored_bytes_to_cudas_nibbles_and_back_are_exactly_the_stored_bytes(layout, shape):
    """The conversion a gpu cache makes at load (stored CPU layout -> values -> the nibble
    pairs CUDA's converter takes) loses nothing: undone, it gives back every stored byte."""
    stored = pack_cpu_int4(_values(*shape, seed=3), layout)
    nibbles = cuda_nibbles(unpack_cpu_int4(stored, layout))
    assert nibbles.shape == stored.shape and nibbles.dtype == torch.uint8
    assert torch.equal(pack_cpu_int4(from_cuda_nibbles(nibbles), layout), stored)


def test_cudas_int4_layout_holds_the_stored_bytes():
    for n, k in [(16, 32), (64, 128), (512, 2048), (2048, 512)]:
        shape = cuda_int4_shape(n, k)
        assert 4 * torch.Size(shape).numel() == n * k // 2  # int32, as many bytes
        assert shape[0] == n // 8 and shape[2] == 32
    with pytest.raises(OffloadError, match="multiple of 32"):
        cuda_int4_shape(16, 48)
