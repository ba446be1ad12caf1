"""vLLM's CPU int8 MoE kernel (``CPUExpertsInt8``'s ``fused_experts_cpu``, W8A8) on its own:
each token's output does not depend on how its experts are numbered, on rows past the ones
used (the plugin's spare rows), nor on the call's other tokens, bit for bit. What the plugin
relies on to compute on its slots in place (docs/vllm.md, "Quantized experts"); checked
at a Qwen1.5-MoE-like width where vLLM's own bfloat16 AMX kernel is not (its float sums
depend on how a batch is split)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")
if not torch.cpu._is_amx_tile_supported():
    pytest.skip("vLLM's CPU int8 MoE kernel needs AMX, which this CPU lacks",
                allow_module_level=True)

from vllm._custom_ops import CPUQuantMethod, fused_experts_cpu

E, H, INTER, K = 12, 512, 256, 4


def _run(x, ids, weights, w13, w2, s13, s2):
    out = torch.empty_like(x)
    fused_experts_cpu(out, x, w13, w2, weights, ids, CPUQuantMethod.INT8_W8A8, s13, s2, None,
                      None, None, None, None, None, None, True)
    return out


@pytest.mark.parametrize("tokens", [1, 4, 8, 40])
def test_int8_kernel_bits_do_not_depend_on_numbering_spare_rows_or_the_batch(tokens):
    g = torch.Generator().manual_seed(tokens)
    w13 = torch.ops._C.convert_weight_packed(
        torch.randint(-127, 128, (E, 2 * INTER, H), dtype=torch.int8, generator=g))
    w2 = torch.ops._C.convert_weight_packed(
        torch.randint(-127, 128, (E, H, INTER), dtype=torch.int8, generator=g))
    s13, s2 = torch.rand(E, 2 * INTER, 1, generator=g) / 500, torch.rand(E, H, 1, generator=g) / 500
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, K, generator=g)
    weights /= weights.sum(1, keepdim=True)
    whole = _run(x, ids, weights, w13, w2, s13, s2)
    needed = sorted(set(ids.flatten().tolist()))
    order = torch.randperm(len(needed), generator=g).tolist()
    slot = {e: order[i] for i, e in enumerate(needed)}
    for rows in (len(needed), E + 3):  # just the slots used, or spare rows past them
        a13, a2 = torch.zeros(rows, *w13.shape[1:], dtype=w13.dtype), torch.zeros(
            rows, *w2.shape[1:], dtype=w2.dtype)
        b13, b2 = torch.ones(rows, 2 * INTER, 1), torch.ones(rows, H, 1)
        for e, s in slot.items():
            a13[s], a2[s], b13[s], b2[s] = w13[e], w2[e], s13[e], s2[e]
        renumbered = torch.tensor([[slot[int(e)] for e in r] for r in ids], dtype=torch.int32)
        assert torch.equal(_run(x, renumbered, weights, a13, a2, b13, b2), whole), rows
    alone = torch.cat([_run(x[i:i + 1], ids[i:i + 1], weights[i:i + 1], w13, w2, s13, s2)
                       for i in range(tokens)])
    assert torch.equal(alone, whole)
