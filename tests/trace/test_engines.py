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

from conftest import one_line_error
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


# the note is asserted by the CLI test of the dense layer below
@pytest.mark.filterwarnings('ignore:dropped dense layer 0:stmoe.errors.StmoeNote')
def test_vllm_single_choice_prompt_from_usage_and_bad_base64(tmp_path):
    """vLLM: usage.prompt_tokens gives the prompt when prompt_token_ids is not returned
    (vllm/entrypoints/openai/serving_completion.py)."""
    per = routing(fill=-1)[:1]
    doc = vllm_response(per, dtype=np.int32)
    del doc["choices"][0]["prompt_token_ids"]
    doc["usage"].update(prompt_tokens=PROMPTS[0], completion_tokens=GENS[0])
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
    wrong = cli("import", path, "-o", tmp_path / "o2.npz", "--layers", str(N_LAYERS * K + 1))
    one_line_error(wrong, f"{N_LAYERS * K} ids per token are not a multiple of "
                   f"{N_LAYERS * K + 1} layers")
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


# the note is asserted by the CLI test of the dense layer
@pytest.mark.filterwarnings('ignore:dropped dense layer 0:stmoe.errors.StmoeNote')
def test_export_vllm_and_sglang_round_trip(tmp_path, cli):
    """stmoe export writes the two engines' layouts; importing them gives the trace back."""
    per = routing(fill=-1)
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(vllm_response(per, dtype=np.int32)))
    trace = load_trace(path)
    # (SGLang's bytes do not say L, but stmoe's export does: no --layers needed since a
    # reliability review)
    for fmt, extra in (("vllm", []), ("sglang", []), ("sglang", ["--layers", N_LAYERS])):
        out = tmp_path / f"back.{fmt}.json"
        assert cli("export", path, "-o", out, "--format", fmt).exit_code == 0
        res = cli("import", out, "-o", tmp_path / f"{fmt}.npz", *extra)
        assert res.exit_code == 0, res.output
        back = load_trace(tmp_path / f"{fmt}.npz")
        assert np.array_equal(back.experts, trace.experts)
        assert np.array_equal(back.is_decode, trace.is_decode)
        assert back.meta.extra["model_layer_ids"] == [1, 2, 3]


# ---- issue 30: ids at their stored width, token counts that must fit the rows ------------


def write_json(path, doc):
    path.write_text(json.dumps(doc))
    return path


# the note is asserted by the CLI test of the dense layer
@pytest.mark.filterwarnings('ignore:dropped dense layer 0:stmoe.errors.StmoeNote')
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "int16", "int32", "int64"])
def test_ids_are_read_at_every_stored_width(tmp_path, dtype):
    per = routing(fill=0 if dtype.startswith("u") else -1)
    vllm = write_json(tmp_path / "v.json", vllm_response(per, dtype=np.dtype(dtype)))
    check(load_trace(vllm), per)
    docs = [sglang_response(ex, p, g, dtype) for ex, p, g in zip(per, PROMPTS, GENS,
                                                                 strict=True)]
    sglang = write_json(tmp_path / "s.json", docs)
    check(load_trace(sglang, engine=EngineOptions(layers=N_LAYERS, top_k=K)), per,
          token_ids=False)


@pytest.mark.parametrize(("dtype", "bad"), [("int64", 4294967299), ("uint32", 0xFFFFFFFF),
                                            ("uint64", 2**63 + 1), ("int64", -2)])
def test_an_id_that_a_cast_would_wrap_is_refused(tmp_path, cli, dtype, bad):
    """4294967299 as int32 is expert 3, 0xFFFFFFFF an empty slot: refused as stored."""
    per = [r.astype(dtype) if bad >= 0 else r for r in routing(fill=0)]
    per[1][2, 3, 1] = bad
    vllm = write_json(tmp_path / "v.json", vllm_response(per, dtype=np.dtype(dtype)))
    result = cli("import", vllm, "-o", tmp_path / "o.npz")
    one_line_error(result, "v.json", f"expert id {bad} is out of range",
                   "choices[1].routed_experts, token 2, layer 3, slot 1", dtype)
    if dtype in ("int64", "uint32") and bad >= 0:
        docs = [sglang_response(ex, p, g, dtype)
                for ex, p, g in zip(per, PROMPTS, GENS, strict=True)]
        sglang = write_json(tmp_path / "s.json", docs)
        result = cli("import", sglang, "-o", tmp_path / "o.npz", "--layers", N_LAYERS,
                     "--top-k", K)
        one_line_error(result, "s.json", f"expert id {bad} is out of range", "response 1")
    assert not (tmp_path / "o.npz").exists()


def test_sglang_int64_id_above_32_bits_and_a_declared_n(tmp_path):
    per = [r.astype(np.int64) for r in routing(fill=-1)]
    per[0][0, 1, 0] = 2**32 + 2  # int32 would read expert 2
    doc = write_json(tmp_path / "s.json", sglang_response(per[0], PROMPTS[0], GENS[0], "int64"))
    with pytest.raises(TraceError, match=r"expert id 4294967298 is out of range.*0\.\.32767"):
        load_trace(doc, engine=EngineOptions(layers=N_LAYERS, top_k=K))
    per[0][0, 1, 0] = 9
    write_json(doc, sglang_response(per[0], PROMPTS[0], GENS[0], "int64"))
    with pytest.raises(TraceError, match=r"response 0.*token 0, layer 1, slot 0.*0\.\.7"):
        load_trace(doc, num_experts=8, engine=EngineOptions(layers=N_LAYERS, top_k=K))


def _b64_rows(ex: np.ndarray, rows: slice) -> str:
    return base64.b64encode(ex[rows].astype("<i4").tobytes()).decode()


@pytest.mark.parametrize("cut", ["first 3 tokens", "last token removed", "one token more"])
def test_sglang_routing_that_does_not_fill_its_token_counts_is_refused(tmp_path, cli, cut):
    """A cut routed_experts was taken for a later span (prompt tokens filed as the last
    positions, marked decode): the rows must be prompt + completion - 1."""
    per = routing(fill=-1)
    ex, p, g = per[2], PROMPTS[2], GENS[2]
    doc = sglang_response(ex, p, g)
    end = p + g - 1
    if cut == "one token more":
        doc["meta_info"]["routed_experts"] = _b64_rows(np.concatenate([ex, ex[:1]]),
                                                       slice(None))
    else:
        doc["meta_info"]["routed_experts"] = _b64_rows(
            ex, slice(0, 3) if cut == "first 3 tokens" else slice(0, end - 1))
    path = write_json(tmp_path / "s.json", doc)
    result = cli("import", path, "-o", tmp_path / "o.npz", "--layers", N_LAYERS, "--top-k", K)
    rows = {"first 3 tokens": 3, "last token removed": end - 1, "one token more": end + 1}[cut]
    one_line_error(result, "s.json", "response 0, meta_info.routed_experts",
                   f"{rows} routed tokens but prompt_tokens + completion_tokens - 1 is {end}",
                   "truncated")
    assert not (tmp_path / "o.npz").exists()


def test_vllm_rows_must_fit_the_prompt_and_generated_ids(tmp_path, cli):
    per = routing(fill=-1)
    doc = vllm_response(per, dtype=np.int32)
    doc["choices"][1]["prompt_token_ids"] = list(range(10 * len(per[1])))  # 10x the rows
    path = write_json(tmp_path / "v.json", doc)
    one_line_error(cli("import", path, "-o", tmp_path / "o.npz"), "v.json", "choices[1]")
    doc = vllm_response(per, dtype=np.int32)
    del doc["choices"][2]["token_ids"]
    doc["choices"][2]["prompt_token_ids"] = list(range(len(per[2]) + 5))
    write_json(path, doc)
    one_line_error(cli("import", path, "-o", tmp_path / "o.npz"), "v.json", "choices[2]",
                   f"a prompt of {len(per[2]) + 5} tokens but only {len(per[2])} routed")
    # rows = prompt + generated + 1: the ids were dropped and the import went on
    doc = vllm_response(per, dtype=np.int32)
    doc["choices"][0]["routed_experts"] = npy_b64(np.concatenate([per[0], per[0][:2]]))
    write_json(path, doc)
    one_line_error(cli("import", path, "-o", tmp_path / "o.npz"), "v.json",
                   "choices[0].routed_experts", f"{len(per[0]) + 2} routed tokens but "
                   f"prompt_token_ids ({PROMPTS[0]}) and token_ids ({GENS[0]})")
    one = vllm_response(per[:1], dtype=np.int32)  # usage of one choice: its own counts
    del one["choices"][0]["prompt_token_ids"], one["choices"][0]["token_ids"]
    one["usage"].update(prompt_tokens=PROMPTS[0], completion_tokens=GENS[0] + 3)
    write_json(path, one)
    one_line_error(cli("import", path, "-o", tmp_path / "o.npz"), "v.json",
                   "usage says", f"expected {PROMPTS[0] + GENS[0] + 2} rows")
    assert not (tmp_path / "o.npz").exists()


def test_a_request_without_a_prompt_length_is_all_prefill_with_a_note(tmp_path, cli):
    per = routing(fill=-1)
    doc = vllm_response(per, dtype=np.int32)
    del doc["choices"][1]["prompt_token_ids"]
    path = write_json(tmp_path / "v.json", doc)
    result = cli("import", path, "-o", tmp_path / "o.npz")
    assert result.exit_code == 0, result.output
    assert "note: choices[1]: the file gives no prompt length" in result.output
    assert "note: token ids dropped from every sequence: choices[1] has none" in result.output
    trace = load_trace(tmp_path / "o.npz")
    assert not trace.is_decode[trace.seq_starts[1]:trace.seq_starts[2]].any()
    docs = [sglang_response(ex, p, g) for ex, p, g in zip(per, PROMPTS, GENS, strict=True)]
    del docs[0]["meta_info"]["prompt_tokens"]
    path = write_json(tmp_path / "s.json", docs)
    result = cli("import", path, "-o", tmp_path / "s.npz", "--layers", N_LAYERS, "--top-k", K)
    assert result.exit_code == 0, result.output
    assert "note: response 0: the file gives no prompt length" in result.output
    given = cli("import", path, "-o", tmp_path / "p.npz", "--layers", N_LAYERS, "--top-k", K,
                "--prompt-lengths", ",".join(map(str, PROMPTS)))
    assert given.exit_code == 0 and "note: response 0" not in given.output
    check(load_trace(tmp_path / "p.npz"), per, token_ids=False)


@pytest.mark.parametrize("axis", [1, 2])
def test_vllm_choices_of_different_layers_or_top_k_are_refused(tmp_path, cli, axis):
    per = routing(fill=-1)
    per[2] = np.concatenate([per[2], per[2]], axis=axis)
    if axis == 2:  # distinct ids in the wider slots
        per[2][:, :, K:] = (per[2][:, :, :K] + 3) % N
        per[2][:, :, K:][per[2][:, :, :K] < 0] = -1
    path = write_json(tmp_path / "v.json", vllm_response(per, dtype=np.int32))
    layers, slots = per[2].shape[1:]
    one_line_error(cli("import", path, "-o", tmp_path / "o.npz"), "v.json", "choices[2]",
                   f"{layers} layers x {slots} slots here but {N_LAYERS} x {K} in choices[0]")
