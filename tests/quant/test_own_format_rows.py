"""The vLLM plugin's forward in stmoe's own formats (``vllm_plugin.own_format``) on its own,
as the engine's experts path calls it (``GatheredExperts`` bound to the weights): each
token's output does not depend on how its experts are numbered, on spare slots past the
ones used, nor on the call's other tokens, bit for bit. What lets the plugin compute on its
cache's slots in place (``runtime.hf_glue``'s ``_ROWS_FREE``) and serve a batch whose
tokens equal the ones it gives with every expert cached. Needs torch only, not vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stmoe.quant.experts import quantize_expert
from stmoe.quant.formats import WeightFormat
from stmoe.runtime.hf_glue import GatheredExperts, rows_independent
from stmoe.vllm_plugin.layers import MoeLayer
from stmoe.vllm_plugin.own_format import TENSORS, OwnExperts, own_forward

E, H, INTER, K = 12, 256, 128, 4


def _experts(fmt: WeightFormat, dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    """E experts' stacked tensors in ``fmt``, as stmoe's store blocks hold them."""
    def matrix(out: int, inner: int) -> torch.Tensor:
        return torch.randn(out, inner, generator=g).to(dtype) / 10

    rows = [quantize_expert([("down_proj", matrix(H, INTER)),
                             ("gate_up_proj", matrix(2 * INTER, H))], fmt, transposed=False)
            for _ in range(E)]
    assert tuple(n for n, _ in rows[0]) == TENSORS
    return {n: torch.stack([r[i][1] for r in rows]) for i, n in enumerate(TENSORS)}


def _call(adapter: OwnExperts, params: dict[str, torch.Tensor], x: torch.Tensor,
          ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    bound = GatheredExperts(adapter).bind(params, next(iter(params.values())).shape[0])
    return own_forward(bound, x, ids, weights, shared_experts=None, shared_experts_input=None)


@pytest.mark.parametrize("fmt", [WeightFormat("int4", 32), WeightFormat("int4", 128),
                                 WeightFormat("int8")], ids=lambda f: f.short)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_own_forward_bits_do_not_depend_on_numbering_spare_slots_or_the_batch(fmt, dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    whole = _experts(fmt, dtype, g)
    layer = MoeLayer("model.layers.0.mlp.experts", torch.nn.Module(), None, 0)
    adapter = OwnExperts(layer, fmt)
    assert rows_independent(adapter)  # the path's contract for this implementation
    x = torch.randn(tokens, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=g)
    weights /= weights.sum(1, keepdim=True)
    ref = _call(adapter, whole, x, ids, weights)
    assert ref.shape == (tokens, H) and ref.dtype == dtype and torch.isfinite(ref).all()
    needed = sorted(set(ids.flatten().tolist()))
    order = torch.randperm(len(needed), generator=g).tolist()
    slot = {e: order[i] for i, e in enumerate(needed)}
    renumbered = torch.tensor([[slot[int(e)] for e in r] for r in ids])
    for rows in (len(needed), E + 3):  # just the slots used, or spare slots past them
        slots = {n: torch.zeros(rows, *t.shape[1:], dtype=t.dtype) for n, t in whole.items()}
        for e, s in slot.items():
            for n in TENSORS:
                slots[n][s] = whole[n][e]
        assert torch.equal(_call(adapter, slots, x, renumbered, weights), ref), rows
    alone = torch.cat([_call(adapter, whole, x[i:i + 1], ids[i:i + 1], weights[i:i + 1])
                       for i in range(tokens)])
    assert torch.equal(alone, ref)


def test_own_forward_computes_silu_gated_experts_in_routing_order():
    """Against the arithmetic written out (dequantized weights, float64): the same function
    up to the kernels' rounding, so a swapped gate/up half or a lost router weight fails."""
    g = torch.Generator().manual_seed(0)
    fmt = WeightFormat("int8")
    whole = _experts(fmt, torch.float32, g)
    adapter = OwnExperts(MoeLayer("l", torch.nn.Module(), None, 0), fmt)
    x = torch.randn(3, H, generator=g)
    ids = torch.tensor([[0, 5, 7, 2], [5, 0, 1, 11], [3, 3 + 1, 9, 10]])
    weights = torch.rand(3, K, generator=g)
    got = _call(adapter, whole, x, ids, weights)
    up = whole["gate_up_proj_qweight"].double() * whole["gate_up_proj_qscale"].double()[..., None]
    down = whole["down_proj_qweight"].double() * whole["down_proj_qscale"].double()[..., None]
    want = torch.zeros(3, H, dtype=torch.float64)
    for t in range(3):
        for j in range(K):
            e = int(ids[t, j])
            h = up[e] @ x[t].double()
            act = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
            want[t] += weights[t, j].double() * (down[e] @ act)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_the_adapter_reads_the_layer_for_everything_else():
    module = SimpleNamespace(activation="silu", hidden_size=H)
    adapter = OwnExperts(MoeLayer("l", module, None, 0), WeightFormat("int8"))  # type: ignore[arg-type]
    assert adapter.hidden_size == H and adapter.has_gate and not adapter.has_bias
    assert adapter.config._experts_implementation == "vllm_stmoe_quantized"
