"""Capture from tiny random transformers MoE models of every supported family."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.hf.capture import RoutingRecorder  # noqa: E402
from stmoe.hf.capture_generate import capture_generation  # noqa: E402
from stmoe.hf.layout import experts_modules  # noqa: E402
from tiny_moe import FAMILIES, tiny_model  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    model, moe_layers = tiny_model(request.param)
    return request.param, model, moe_layers


def test_prefill_equals_the_top_k_of_the_router_logits_transformers_returns(family):
    name, model, moe_layers = family
    ids = torch.tensor([PROMPTS[2], PROMPTS[2][::-1]])
    with torch.no_grad(), RoutingRecorder(model) as rec:
        out = model(input_ids=ids, output_router_logits=True)
    if getattr(out, "router_logits", None) is None:  # 5.17's DeepSeek and GraniteMoe: none
        pytest.skip(f"this transformers' {name} returns no router_logits to compare with")
    trace = rec.trace()
    assert trace.experts.shape == (14, moe_layers, 2)
    assert len(out.router_logits) == moe_layers  # dense layers (DeepSeek, mlp_only) not counted
    for layer, logits in enumerate(out.router_logits):
        want = torch.topk(logits.reshape(14, -1).float(), 2, dim=-1).indices.numpy()
        got = trace.experts[:, layer]
        assert np.array_equal(np.sort(got, axis=1), np.sort(want, axis=1)), (name, layer)
    assert np.all(np.diff(trace.weights, axis=-1) <= 0)  # router rank order: weight first


def test_capture_changes_no_output(family):
    name, model, _ = family
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with RoutingRecorder(model):
            recorded = model(input_ids=ids).logits
    assert torch.equal(plain, recorded), name


def test_batch_of_three_padded_prompts_equals_each_alone(family):
    name, model, moe_layers = family
    batched = capture_generation(model, PROMPTS, max_new_tokens=5, batch_size=3, eos_token_ids=[1])
    assert batched.num_sequences == 3 and batched.num_layers == moe_layers
    for i, prompt in enumerate(PROMPTS):
        alone = capture_generation(model, [prompt], max_new_tokens=5, eos_token_ids=[1])
        part = slice(int(batched.seq_starts[i]), int(batched.seq_ends[i]))
        assert np.array_equal(batched.experts[part], alone.experts), (name, i)
        assert np.array_equal(batched.token_ids[part], alone.token_ids)
        # Prefill = the prompt, decode = every generated token (5, or up to EOS).
        n_decode = int(alone.is_decode.sum())
        assert int((~alone.is_decode).sum()) == len(prompt)
        generated = alone.token_ids[len(prompt) :]
        assert n_decode == len(generated) and (n_decode == 5 or generated[-1] == 1)


def test_a_sequence_that_emits_eos_stops_its_trace():
    model, _ = tiny_model("mixtral")
    free = capture_generation(model, PROMPTS, max_new_tokens=6, batch_size=3)
    row0 = free.token_ids[len(PROMPTS[0]) : free.seq_ends[0]]
    stop = int(row0[2])  # make the third generated token of row 0 an EOS
    stopped = capture_generation(model, PROMPTS, max_new_tokens=6, batch_size=3,
                                 eos_token_ids=[stop])
    first = stopped.token_ids[: stopped.seq_ends[0]]
    assert int(stopped.is_decode[: stopped.seq_ends[0]].sum()) == 3 and first[-1] == stop
    n0 = int(stopped.seq_ends[0])
    assert np.array_equal(stopped.experts[:n0], free.experts[:n0])


def test_recorder_inside_a_users_own_generation_loop():
    model, moe_layers = tiny_model("qwen3_moe")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad(), RoutingRecorder(model) as rec:
        out = model(input_ids=ids, use_cache=True)
        for _ in range(3):
            nxt = out.logits[:, -1:].argmax(-1)
            key = "cache" if hasattr(out, "cache") else "past_key_values"  # 5.17: the latter
            out = model(input_ids=nxt, use_cache=True, **{key: getattr(out, key)})
    trace = rec.trace()
    assert trace.num_tokens == 5 + 3 and int(trace.is_decode.sum()) == 3
    assert trace.num_sequences == 1 and trace.num_layers == moe_layers


def test_experts_modules_skip_dense_layers_and_shared_experts():
    model, _ = tiny_model("deepseek_v3")  # layer 0 dense, shared experts in each MoE layer
    names = [n for n, _ in experts_modules(model)]
    assert names == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    model, _ = tiny_model("qwen2_moe")  # mlp_only_layers=[1]
    assert [n for n, _ in experts_modules(model)] == ["model.layers.0.mlp.experts",
                                                      "model.layers.2.mlp.experts"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint with a byte-level BPE tokenizer, saved locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("ckpt")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()[:90]
    tok.train_from_iterator(
        ["def fib(n): return n", "the old keeper"],
        trainers.BpeTrainer(
            vocab_size=96, special_tokens=["<pad>", "<eos>", "<bos>"], initial_alphabet=alphabet
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    # The trainer may add characters beyond the seed alphabet: size the model to the tokenizer.
    model, _ = tiny_model("qwen3_moe", vocab_size=len(fast), pad_token_id=fast.pad_token_id,
                          eos_token_id=fast.eos_token_id)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def test_capture_command_end_to_end(cli, tmp_path, checkpoint):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def fib(n):", "domain": "code"}) + "\n"
                       + json.dumps({"prompt": "the old keeper"}) + "\n")
    out = tmp_path / "t.npz"
    result = cli("capture", "--model", checkpoint, "--prompts", prompts, "--domain", "prose",
                 "--max-new-tokens", "4", "--batch-size", "2", "-o", out)
    assert result.exit_code == 0, result.output
    info = json.loads(cli("info", out, "--json", "-").stdout)
    assert info["sequences"] == 2 and info["decode_tokens"] <= 8 and info["layers"] == 3
    assert set(info["domains"]) == {"code", "prose"}


def test_capture_errors_are_clear(cli, tmp_path, checkpoint):
    result = cli("capture", "--model", tmp_path, "-o", tmp_path / "t.npz")
    assert result.exit_code == 1 and "no config.json" in result.output
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    result = cli("capture", "--model", checkpoint, "--prompts", bad, "-o", tmp_path / "t.npz")
    assert result.exit_code == 1 and "p.jsonl: line 2" in result.output


def test_capture_records_the_gate_lookahead(family):
    name, model, moe_layers = family
    trace = capture_generation(model, [PROMPTS[0]], max_new_tokens=3)
    for look in (trace.lookahead, trace.lookahead_late):  # early and late
        assert look is not None, name
        width = min(2 * trace.top_k, trace.num_experts)
        assert look.shape == (trace.num_tokens, moe_layers, width)
        assert np.all(look[:, 0] == -1)  # nothing comes before the first MoE layer
        rest = look[:, 1:]
        assert rest.min() >= 0 and rest.max() < trace.num_experts
        assert all(len(set(row)) == width for row in rest.reshape(-1, width).tolist())


def test_the_lookahead_of_the_trained_model_foresees_most_of_the_next_layers_picks():
    from stmoe.hf.capture_generate import DEFAULT_PROMPTS, capture_text, load_model
    from stmoe.models import SHIPPED_MODEL

    model, tok = load_model(SHIPPED_MODEL)
    trace = capture_text(model, tok, list(DEFAULT_PROMPTS[:2]), max_new_tokens=16)
    k = trace.top_k
    picks = trace.experts[:, 1:]

    def recall(look: np.ndarray) -> float:
        ahead = look[:, 1:, :k]
        pairs = zip(ahead.reshape(-1, k).tolist(), picks.reshape(-1, k).tolist(), strict=True)
        return sum(len(set(a) & set(p)) for a, p in pairs) / picks.size

    early, late = recall(trace.lookahead), recall(trace.lookahead_late)
    assert early > 0.6, early  # random would be K/N = 0.25; measured about 0.8
    assert late > early + 0.03, (early, late)  # closer to the router's input; measured +0.05


def test_the_late_lookahead_uses_the_norm_that_feeds_the_moe_block():
    import transformers

    from stmoe.hf.layout import late_points
    from tiny_moe import COMMON

    model, _ = tiny_model("qwen3_moe")  # pre-norm: post_attention_layernorm feeds the MoE
    points = late_points(model, experts_modules(model))
    assert points is not None
    assert all(norm is layer.post_attention_layernorm for layer, norm in points)
    # OLMo-2-style post-norm layers (FlexOlmo) feed the MoE block the raw residual stream
    config = transformers.FlexOlmoConfig(**{**COMMON, "num_experts": 8, "num_experts_per_tok": 2})
    flex = transformers.AutoModelForCausalLM.from_config(config).eval()
    points = late_points(flex, experts_modules(flex))
    assert points is not None and all(isinstance(n, torch.nn.Identity) for _, n in points)
    assert capture_generation(flex, [PROMPTS[0]], max_new_tokens=2).lookahead_late is not None
