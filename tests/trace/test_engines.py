"""Serving engines' routing in: vLLM and SGLang responses, vLLM arrays and profiles.

Every file here is laid out the way the engine's own writer lays it out, for three
requests of different prompt and generation lengths on a model whose first layer
is dense (the engine's buffer keeps its fill there).
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from stmoe import TraceError, load_trace
from stmoe.trace import sniff_format
from stmoe.trace.engines import EngineOptions, ImportNote

PROMPTS, GENS = (5, 3, 7), (4, 1, 6)  # tokens per request: prompt + generated - 1 routed
N_LAYERS, K, N = 4, 2, 8  # model layers (layer 0 dense), top-k, routed experts


def routing(fill: int, seed: int = 0) -> list[np.ndarray]:
    """One [P + G - 1, L, K] array per request; dense layer 0 holds ``fill``."""
    rng = np.random.default_rng(seed)
    out = []
    for p, g in zip(PROMPTS, GENS, strict=True):
        rows = p + g - 1
        ex = np.stack([rng.permutation(N)[:K] for _ in range(rows * N_LAYERS)])
        ex = ex.reshape(rows, N_LAYERS, K).astype(np.int32)
        ex[:, 0] = fill
        out.append(ex)
    return out


def check(trace, per_request, token_ids=True):
    lengths = [len(r) for r in per_request]
    assert trace.seq_starts.tolist() == [0, lengths[0], lengths[0] + lengths[1]]
    assert np.array_equal(trace.experts, np.concatenate(per_request)[:, 1:])
    assert trace.meta.extra["model_layer_ids"] == [1, 2, 3]
    decode = [int(trace.is_decode[sl].sum()) for _, sl in trace.sequences()]
    assert decode == [g - 1 for g in GENS]
    assert (trace.token_ids is not None) == token_ids


def npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def vllm_response(per_request, dtype=np.uint8):
    """vllm/entrypoints/openai/serving_completion.py (vllm-project/vllm): with
    enable_return_routed_experts each choice carries routed_experts as base64 of .npy
    bytes (uint8/uint16/int32), (num_tokens - 1, num_hidden_layers, top_k) as filled by
    vllm/model_executor/layers/fused_moe/routed_experts_capturer.py (zeros buffer)."""
    choices = []
    for i, (ex, p, g) in enumerate(zip(per_request, PROMPTS, GENS, strict=False)):
        choices.append({"index": i, "text": "x", "routed_experts": npy_b64(ex.astype(dtype)),
                        "prompt_token_ids": list(range(100, 100 + p)),
                        "token_ids": list(range(200, 200 + g))})
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices,
            "usage": {"prompt_tokens": sum(PROMPTS), "completion_tokens": sum(GENS)}}


def test_vllm_completions_response(tmp_path):
    """vLLM OpenAI server /v1/completions (vllm/entrypoints/openai/serving_completion.py,
    choices[].routed_experts); dense layer 0 holds the buffer's 0."""
    per = routing(fill=0)
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(vllm_response(per), indent=2))  # pretty-printed, too
    assert sniff_format(path) == "vllm"
    with pytest.warns(ImportNote, match="dense layer 0"):
        trace = load_trace(path)
    check(trace, per)
    assert trace.token_ids[:5].tolist() == [100, 101, 102, 103, 104]
    assert trace.token_ids[5:8].tolist() == [200, 201, 202]


def test_vllm_single_choice_prompt_from_usage_and_bad_base64(tmp_path):
    """vLLM: usage.prompt_tokens gives the prompt when prompt_token_ids is not returned
    (vllm/entrypoints/openai/serving_completion.py)."""
    per = routing(fill=-1)[:1]
    doc = vllm_response(per, dtype=np.int32)
    del doc["choices"][0]["prompt_token_ids"]
    doc["usage"]["prompt_tokens"] = PROMPTS[0]
    path = tmp_path / "one.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    assert int(trace.is_decode.sum()) == GENS[0] - 1 and trace.token_ids is None
    doc["choices"][0]["routed_experts"] = doc["choices"][0]["routed_experts"][:-7]
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"choices\[0\].routed_experts.*base64|truncated"):
        load_trace(path)


def test_vllm_offline_npy_with_prompt_lengths_and_dense_layer(tmp_path, cli):
    """vllm/outputs.py CompletionOutput.routed_experts, saved with np.save: one
    [prompt + generated - 1, num_hidden_layers, top_k] array; several joined with
    --seq-starts."""
    per = routing(fill=0)
    path = tmp_path / "routed.npy"
    np.save(path, np.concatenate(per))
    starts = f"0,{len(per[0])},{len(per[0]) + len(per[1])}"
    result = cli("import", path, "-o", tmp_path / "o.npz", "--seq-starts", starts,
                 "--prompt-lengths", ",".join(map(str, PROMPTS)))
    assert result.exit_code == 0, result.output
    assert "note: dropped dense layer 0" in result.output
    check(load_trace(tmp_path / "o.npz"), per, token_ids=False)
    info = json.loads(cli("info", tmp_path / "o.npz", "--json", "-").stdout)
    assert (info["tokens"], info["layers"], info["sequences"], info["decode_tokens"]) == (
        sum(len(r) for r in per),
        3,
        3,
        sum(GENS) - 3,
    )
    moe = cli("import", path, "-o", tmp_path / "m.npz", "--moe-layers", "2-3")
    assert moe.exit_code == 0 and load_trace(tmp_path / "m.npz").meta.extra[
        "model_layer_ids"] == [2, 3]


def test_layers_first_array_warns_and_ltk_reads_it(tmp_path):
    """A [L, T, K] array read as [T, L, K] would swap the axes silently."""
    ex = np.concatenate(routing(fill=-1))[:, 1:]
    np.save(tmp_path / "ltk.npy", ex.transpose(1, 0, 2))
    with pytest.warns(ImportNote, match="--layout ltk"):
        load_trace(tmp_path / "ltk.npy")
    trace = load_trace(tmp_path / "ltk.npy", engine=EngineOptions(layout="ltk"))
    assert np.array_equal(trace.experts, ex)


def sglang_response(ex: np.ndarray, p: int, g: int, dtype="int32") -> dict:
    """python/sglang/srt/layers/moe/routed_experts_capturer.py (sgl-project/sglang):
    get_routed_experts reads req_to_token[:seqlen - 1], the tokenizer manager puts the
    raw bytes in meta_info.routed_experts as base64 (int32 unless
    routed_experts_dtype says otherwise); L and K are not in the response."""
    raw = ex.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    return {"text": "x", "meta_info": {"id": "r", "prompt_tokens": p, "completion_tokens": g,
                                       "routed_experts": base64.b64encode(raw).decode(),
                                       "routed_experts_dtype": dtype}}


def test_sglang_generate_batch_and_errors(tmp_path, cli):
    """SGLang /generate with a list of prompts returns a JSON list of responses."""
    per = routing(fill=-1)
    path = tmp_path / "batch.json"
    docs = [sglang_response(ex, p, g) for ex, p, g in zip(per, PROMPTS, GENS, strict=True)]
    path.write_text(json.dumps(docs))
    assert sniff_format(path) == "sglang"
    result = cli("import", path, "-o", tmp_path / "o.npz", "--layers", N_LAYERS, "--top-k", K)
    assert result.exit_code == 0, result.output
    check(load_trace(tmp_path / "o.npz"), per, token_ids=False)
    missing = cli("import", path, "-o", tmp_path / "o2.npz")
    assert missing.exit_code == 1 and "--layers L --top-k K" in missing.output
    assert f"{N_LAYERS * K} ids per token" in missing.output
    one = sglang_response(per[0], PROMPTS[0], GENS[0])
    one["meta_info"]["routed_experts"] = base64.b64encode(
        per[0].astype("<i4").tobytes()[:-2]).decode()
    path.write_text(json.dumps(one))
    bad = cli("import", path, "-o", tmp_path / "o3.npz", "--layers", N_LAYERS, "--top-k", K)
    assert bad.exit_code == 1 and "not a whole number of int32 ids" in bad.output
    assert len(bad.output.strip().splitlines()) == 1 and not (tmp_path / "o3.npz").exists()


def test_vllm_routing_profile_jsonl(tmp_path):
    """Published vLLM routing profiles: one line per (token, layer) with token_pos the
    index inside the forward batch (0..P-1 in prefill, 0 for each decode step)."""
    per = routing(fill=0)
    lines = []
    for pid, (ex, p) in enumerate(zip(per, PROMPTS, strict=True)):
        for t in range(len(ex)):
            for layer in (1, 2, 3):  # the profiler hooks MoE layers only
                lines.append({"problem_id": f"q{pid}", "layer": layer,
                              "token_pos": t if t < p else 0,
                              "experts": ex[t, layer].tolist(),
                              "gating_probs": [0.7, 0.3]})
    path = tmp_path / "profile.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert sniff_format(path) == "vllm-profile"
    check(load_trace(path), per, token_ids=False)


def test_export_vllm_and_sglang_round_trip(tmp_path, cli):
    """stmoe export writes the two engines' layouts; importing them gives the trace back."""
    per = routing(fill=-1)
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(vllm_response(per, dtype=np.int32)))
    trace = load_trace(path)
    for fmt, extra in (("vllm", []), ("sglang", ["--layers", N_LAYERS, "--top-k", K])):
        out = tmp_path / f"back.{fmt}.json"
        assert cli("export", path, "-o", out, "--format", fmt).exit_code == 0
        res = cli("import", out, "-o", tmp_path / f"{fmt}.npz", *extra)
        assert res.exit_code == 0, res.output
        back = load_trace(tmp_path / f"{fmt}.npz")
        assert np.array_equal(back.experts, trace.experts)
        assert np.array_equal(back.is_decode, trace.is_decode)
        assert back.meta.extra["model_layer_ids"] == [1, 2, 3]
