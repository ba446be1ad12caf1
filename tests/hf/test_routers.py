"""``Router``: the gate lookahead ranks a layer's experts as its family's router chooses them.

transformers' router modules pick their layer's own top-k; the lookahead asks them, so on
the router's very input its first K are the routed experts in every family, DeepSeek-V3's
score-correction bias with grouped top-k and GPT-OSS's router bias included, where ranking
by ``hidden @ weight.T`` alone picks others."""

from __future__ import annotations

import pytest
import torch

from stmoe.hf.layout import ModelLayout
from stmoe.hf.routers import ROUTER_NAMES, Router
from tiny_moe import FAMILIES, tiny_model


def _routed(model: torch.nn.Module, layout: ModelLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each MoE layer's (router input, the experts' top-k ids) in one forward."""
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = []

    def keep(layer: int, arg: int):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, args: tuple) -> None:
            seen.setdefault(layer, []).append(args[arg].detach())
        return hook

    for layer, (name, experts) in enumerate(layout.modules):
        block = model.get_submodule(name.rsplit(".", 1)[0])
        gate = next(getattr(block, n) for n in ROUTER_NAMES if hasattr(block, n))
        hooks.append(gate.register_forward_pre_hook(keep(layer, 0)))
        hooks.append(experts.register_forward_pre_hook(keep(layer, 1)))
    try:
        with torch.no_grad():
            model(torch.tensor([[5, 17, 33, 60, 7, 21, 44, 90, 3, 12]]))
    finally:
        for h in hooks:
            h.remove()
    return [(x.reshape(-1, x.shape[-1]), ids.reshape(x.numel() // x.shape[-1], -1))
            for x, ids in (seen[layer] for layer in sorted(seen))]


def _sets(ids: torch.Tensor) -> list[set[int]]:
    return [set(row.tolist()) for row in ids]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_lookaheads_first_k_are_the_routed_experts_in_every_family(family):
    model, _ = tiny_model(family)
    layout = ModelLayout.of(model)
    assert layout.routers is not None
    for (x, ids), router in zip(_routed(model, layout), layout.routers, strict=True):
        k = ids.shape[-1]
        ranked = router.ranked(x, min(2 * k, router.num_experts))
        assert _sets(ranked[:, :k]) == _sets(ids)
        assert all(len(set(row.tolist())) == ranked.shape[1] for row in ranked)  # no repeats


@pytest.mark.parametrize("family,changes,bias", [
    ("deepseek_v3", {"n_group": 4, "topk_group": 2}, "e_score_correction_bias"),
    ("gpt_oss", {}, "bias"),
])
def test_a_routers_bias_and_groups_are_what_the_logits_alone_miss(family, changes, bias):
    """A bias of a few units (DeepSeek-V3's are +2 or more, its scores in 0..1): the routed
    experts are the lookahead's first K, and not the logits' top K in some rows."""
    model, _ = tiny_model(family, **changes)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, b in model.named_parameters() if bias == "bias" else model.named_buffers():
            if name.endswith(f"{'router' if bias == 'bias' else 'gate'}.{bias}"):
                b.copy_(torch.randn(b.shape, generator=gen) * 3 + 5)
    layout = ModelLayout.of(model)
    assert layout.routers is not None and all(r.picks is not None for r in layout.routers)
    missed = 0
    for (x, ids), router in zip(_routed(model, layout), layout.routers, strict=True):
        k = ids.shape[-1]
        assert _sets(router.ranked(x, 2 * k)[:, :k]) == _sets(ids)
        alone = Router(router.weight).ranked(x, k)  # (what the lookahead ranked before)
        missed += sum(a != b for a, b in zip(_sets(alone), _sets(ids), strict=True))
    assert missed > 0


def test_a_plain_linear_gate_is_ranked_by_its_logits():
    """A gate that returns logits alone (not a top-k router) is not asked for a top-k."""
    from stmoe.hf.routers import picks_top_k

    gate = torch.nn.Linear(6, 5, bias=False)
    assert not picks_top_k(gate, gate.weight)
    x = torch.randn(3, 6)
    want = torch.topk(x @ gate.weight.T, 4, dim=-1).indices
    assert torch.equal(Router(gate.weight).ranked(x, 4), want)


def test_after_the_top_k_the_rest_rank_by_logit():
    class TopK(torch.nn.Module):
        """Picks experts 4 then 0 (weights 0.7, 0.9: ranked 0, 4) whatever the logits."""

        def forward(self, x):
            logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]]).expand(x.shape[0], -1)
            return logits, torch.tensor([[0.7, 0.9]]), torch.tensor([[4, 0]])

    router = Router(torch.zeros(5, 2), TopK().eval())
    assert router.ranked(torch.zeros(1, 2), 4).tolist() == [[0, 4, 1, 2]]
    assert router.ranked(torch.zeros(1, 2), 1).tolist() == [[0]]


def test_a_router_that_ranks_as_its_logits_is_not_asked():
    """A softmax router's top-k is its logits' (asking it would only cost time); one with
    the groups of DeepSeek-V3 and a bias is asked."""
    for family in ("mixtral", "qwen3_moe", "olmoe"):
        layout = ModelLayout.of(tiny_model(family)[0])
        assert layout.routers is not None and all(r.picks is None for r in layout.routers)


def test_a_router_in_training_mode_is_never_asked():
    """PhiMoE's router draws random numbers in training mode (and may add noise to its input
    in place): capture there leaves the model's outputs and the random state as they were
    (the helper's review found both changed)."""
    from stmoe.hf.capture import RoutingRecorder

    model, _ = tiny_model("phimoe", input_jitter_noise=0.1)
    model.train()
    ids = torch.tensor([[5, 17, 33, 60, 7, 21, 44, 90]])
    torch.manual_seed(123)
    plain = model(ids, output_router_logits=True)
    after = torch.rand(1)
    torch.manual_seed(123)
    with RoutingRecorder(model):
        recorded = model(ids, output_router_logits=True)
    assert torch.equal(plain.logits, recorded.logits)
    assert torch.equal(plain.aux_loss, recorded.aux_loss) and torch.equal(torch.rand(1), after)


def test_a_router_giving_ids_out_of_range_is_not_asked():
    """(vLLM's routers with fused shared experts number them from N on.)"""
    from stmoe.hf.routers import picks_top_k

    class Shared(torch.nn.Module):
        def forward(self, x):
            logits = x @ torch.ones(4, x.shape[1]).T
            return logits, torch.ones(x.shape[0], 2), torch.tensor([[0, 4]]).expand(x.shape[0], 2)

    assert not picks_top_k(Shared().eval(), torch.ones(4, 3))


# families whose router takes its block's bias as a second input: (config, overrides, bias)
TAKES_BIAS = [
    ("MiniMaxM2Config", {"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 8},
     "e_score_correction_bias"),
    ("HYV3Config", {"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 8,
                    "moe_intermediate_size": 16}, "e_score_correction_bias"),
    ("Lfm2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                       "use_expert_bias": True, "num_dense_layers": 1,
                       "layer_types": ["full_attention"] * 3}, "expert_bias"),
]


def _biased(config_name: str, overrides: dict, bias: str, scale: float) -> torch.nn.Module:
    """A tiny random model of the family, its routers spread out and every block's ``bias``
    drawn around 5 with spread ``scale`` (0: left at its zeros)."""
    import transformers

    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    from tiny_moe import COMMON

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**{**COMMON,
                                                                          **overrides}))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 1.0, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith(bias) and scale:
                b.copy_(torch.randn(b.shape, generator=gen) * scale + 5)
    return model.eval()


@pytest.mark.parametrize("config_name,overrides,bias", TAKES_BIAS)
def test_a_router_given_its_blocks_bias_ranks_as_the_family_routes(config_name, overrides,
                                                                    bias):
    """MiniMax-M2, HY-V3 and LFM2 pass their block's bias to the router's forward: the
    lookahead reads it there, and its first K are the routed experts, where the logits alone
    miss some (they were ranked by logit alone before)."""
    model = _biased(config_name, overrides, bias, scale=3.0)
    layout = ModelLayout.of(model)
    assert layout.routers is not None and layout.routers
    assert all(r.picks is not None and r.inputs == (bias,) for r in layout.routers)
    missed = 0
    for (x, ids), router in zip(_routed(model, layout), layout.routers, strict=True):
        k = ids.shape[-1]
        assert _sets(router.ranked(x, 2 * k)[:, :k]) == _sets(ids)
        alone = Router(router.weight).ranked(x, k)
        missed += sum(a != b for a, b in zip(_sets(alone), _sets(ids), strict=True))
    assert missed > 0
    # the bias is read at each call, not kept from load: a new tensor in its place (as a
    # move to another device puts one) changes the ranking
    block, router = layout.routers[0].block, layout.routers[0]
    x = _routed(model, layout)[0][0]
    before = router.ranked(x, 2)
    setattr(block, bias, -getattr(block, bias).clone())
    assert not torch.equal(router.ranked(x, 2), before)


def test_a_zero_bias_ranks_as_the_logits_and_is_not_asked():
    """(A fresh MiniMax-M2's buffers: sigmoid keeps the logits' order.)"""
    model = _biased(*TAKES_BIAS[0], scale=0.0)
    layout = ModelLayout.of(model)
    assert layout.routers is not None and all(r.picks is None for r in layout.routers)


def test_a_router_input_found_nowhere_leaves_the_logits():
    """A forward wanting an input its block does not hold (DeepSeek-V4's token ids) is not
    asked; one the block lacks but the forward defaults is left to its default."""
    from stmoe.hf.routers import router_inputs

    class Ids(torch.nn.Module):
        def forward(self, hidden_states, input_ids):
            raise AssertionError("never called")

    class Optional(torch.nn.Module):
        def forward(self, hidden_states, expert_bias=None, **more):
            return hidden_states

    block = torch.nn.Module()
    assert router_inputs(Ids(), block) is None
    assert router_inputs(Optional(), block) == ()
    block.expert_bias = torch.zeros(3)
    assert router_inputs(Optional(), block) == ("expert_bias",)
