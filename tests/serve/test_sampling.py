"""Sampling through a live `stmoe serve`, driven by the official openai client: a seeded
request gets its solo run's tokens whether it runs alone or beside three others; choice i
of ``n`` is the solo run of ``seed + i``, streamed or not; without a seed each request
draws its own; log-probabilities are the model's for the tokens returned; OpenAI's
standard fields sent at their defaults are accepted, and at a value this server cannot
honour refused by name, saying why."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve_live import NAME, PROMPTS, StepGate, all_submitted, post
from serve_live import client as _client

from stmoe.runtime.batcher import Sampling

# (prompt, what the request asks besides it): four different samplers
ASKED = [(PROMPTS[0], {"temperature": 1.0, "seed": 1}),
         (PROMPTS[1], {"temperature": 0.7, "top_p": 0.9, "seed": 2}),
         (PROMPTS[2], {"temperature": 1.3, "seed": 3, "extra_body": {"top_k": 20}}),
         (PROMPTS[3], {"temperature": 1.0, "seed": 2**63 + 5})]
LENGTH = 12


def _sampling(asked: dict, logprobs: int | None = None) -> Sampling:
    """The server's ``Sampling`` of a request asked with the client's arguments."""
    top_k = asked.get("extra_body", {}).get("top_k", 0)
    return Sampling(asked.get("temperature", 1.0), asked.get("top_p", 1.0), top_k,
                    asked.get("seed"), logprobs)


def _want(solo, prompt: str, asked: dict, n: int = LENGTH) -> str:
    tokens, _ = solo.sampled(solo.ids(prompt), n, _sampling(asked))
    return solo.text(tokens)


def test_seeded_requests_alone_or_together_are_their_solo_runs(server, solo):
    url, service = server
    c = _client(url)
    want = [_want(solo, p, a) for p, a in ASKED]
    alone = [c.completions.create(model=NAME, prompt=p, max_tokens=LENGTH, **a).choices[0].text
             for p, a in ASKED]
    assert alone == want
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        p, a = ASKED[i]
        got[i] = c.completions.create(model=NAME, prompt=p, max_tokens=LENGTH,
                                      **a).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    before = len(service.batcher.decode_sizes())
    with StepGate(service.batcher, all_submitted(service.batcher, 4)):
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert got == dict(enumerate(want))
    assert max(service.batcher.decode_sizes()[before:]) >= 2  # they shared steps
    assert len(set(want)) == 4 and want[0] != solo(PROMPTS[0], LENGTH)  # they sampled


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_the_solo_runs_of_seed_plus_index(server, solo, stream):
    url, _ = server
    c = _client(url)
    messages = [{"role": "user", "content": "hello"}]
    asked = {"temperature": 1.0, "seed": 40}
    reply = c.chat.completions.create(model=NAME, messages=messages, max_tokens=8, n=3,
                                      stream=stream, **asked)
    texts: dict[int, str] = {}
    if stream:
        for chunk in reply:
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    else:
        texts = {ch.index: ch.message.content for ch in reply.choices}
    prompt = "user: hello\nassistant:"
    assert texts == {i: _want(solo, prompt, {**asked, "seed": 40 + i}, 8) for i in range(3)}
    one = c.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                    temperature=1.0, seed=41)
    assert one.choices[0].message.content == texts[1]


def test_without_a_seed_each_request_draws_its_own(server):
    url, _ = server
    c = _client(url)
    texts = {c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16).choices[0].text
             for _ in range(4)}  # temperature 1 by default, as OpenAI's
    assert len(texts) > 1


def test_chat_logprobs_are_the_models_for_the_tokens_returned(server, solo):
    url, _ = server
    c = _client(url)
    messages = [{"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                  logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ids = solo.ids("user: hello\nassistant:")
    tokens, record = solo.sampled(ids, 10, Sampling(logprobs=3))
    shown = [e for e in record if e.token not in solo.eos]
    assert r.choices[0].message.content == solo.text(tokens)
    assert b"".join(bytes(e.bytes) for e in content) == r.choices[0].message.content.encode()
    assert [e.logprob for e in content] == [e.logprob for e in shown]  # bit for bit
    for e in content:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    sampled = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                        temperature=1.0, seed=9, logprobs=True)
    tokens, record = solo.sampled(ids, 10, Sampling(1.0, seed=9, logprobs=0))
    assert [e.logprob for e in sampled.choices[0].logprobs.content] == [
        e.logprob for e in record if e.token not in solo.eos]


def test_completion_logprobs_streamed_or_not_and_their_offsets(server):
    url, _ = server
    c = _client(url)
    asked = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 1.0,
             "seed": 5, "logprobs": 2}
    whole = c.completions.create(**asked).choices[0]
    lp = whole.logprobs
    assert "".join(lp.tokens) == whole.text  # this prompt's text is whole characters
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and 2 <= len(top) <= 3  # the 2 best and the chosen one
        assert value <= max(top.values())
    tokens, values, offsets, text = [], [], [], ""
    for chunk in c.completions.create(**asked, stream=True):
        ch = chunk.choices[0]
        text += ch.text
        if ch.logprobs is not None:
            tokens += ch.logprobs.tokens
            values += ch.logprobs.token_logprobs
            offsets += ch.logprobs.text_offset
    assert (text, tokens, values, offsets) == (whole.text, lp.tokens, lp.token_logprobs,
                                               lp.text_offset)


# what the official client, langchain-openai and others send at OpenAI's defaults
DEFAULTS = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "seed": None,
            "top_p": 1, "user": "someone", "stop": None, "n": 1, "stream": False}
CHAT_DEFAULTS = {**DEFAULTS, "logprobs": False, "top_logprobs": 0,
                 "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                 "functions": [], "function_call": "auto", "parallel_tool_calls": True,
                 "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                 "modalities": ["text"], "audio": None, "prediction": None,
                 "reasoning_effort": None, "verbosity": "medium", "web_search_options": None,
                 "prompt_cache_key": "k", "safety_identifier": "s",
                 "stream_options": {"include_usage": False}}
COMPLETION_DEFAULTS = {**DEFAULTS, "logprobs": None, "echo": False, "suffix": "",
                       "best_of": 1}


def test_standard_fields_at_their_defaults_are_accepted(server, solo):
    url, _ = server
    code, answer = post(url + "/v1/completions", json.dumps(
        {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
         **COMPLETION_DEFAULTS}))
    assert code == 200, answer
    assert answer["choices"][0]["text"] == solo(PROMPTS[0], 6)
    code, answer = post(url + "/v1/chat/completions", json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "yes", "tool_calls": [],
                                      "refusal": None},
                                     {"role": "user", "content": "go on"}],
         "max_completion_tokens": 6, "temperature": 0, **CHAT_DEFAULTS}))
    assert code == 200, answer
    assert answer["choices"][0]["message"]["content"] == solo(
        "user: hi\nassistant: yes\nuser: go on\nassistant:", 6)


REFUSED = [  # (field, value, chat, what the message says)
    ("presence_penalty", 0.5, False, "applies no penalties"),
    ("frequency_penalty", -1, True, "applies no penalties"),
    ("logit_bias", {"5": 100}, True, "does not bias logits"),
    ("echo", True, False, "prompt is not returned"),
    ("suffix", "end", False, "does not insert text"),
    ("best_of", 3, False, "every choice is returned"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], True, "does not call tools"),
    ("tool_choice", "required", True, "does not call tools"),
    ("functions", [{"name": "f"}], True, "does not call tools"),
    ("response_format", {"type": "json_object"}, True, "does not constrain its output"),
    ("store", True, True, "keeps no completions"),
    ("modalities", ["text", "audio"], True, "text only"),
    ("audio", {"voice": "alloy", "format": "wav"}, True, "text only"),
    ("prediction", {"type": "content", "content": "x"}, True, "predicted outputs"),
    ("reasoning_effort", "high", True, "no reasoning setting"),
    ("service_tier", "priority", True, "one tier"),
    ("web_search_options", {}, True, "does not search the web"),
    ("top_logprobs", 2, True, "needs logprobs: true"),
    ("top_logprobs", 21, True, "less than or equal to 20"),
    ("logprobs", 21, False, "less than or equal to 20"),
    ("temperature", 2.5, True, "less than or equal to 2"),
    ("top_p", 0, False, "greater than 0"),
    ("top_k", -2, False, "greater than or equal to -1"),
    ("seed", 2**64, False, "less than or equal to"),
]


@pytest.mark.parametrize(("field", "value", "chat", "says"), REFUSED,
                         ids=[f"{f}={json.dumps(v)[:20]}" for f, v, _, _ in REFUSED])
def test_values_this_server_cannot_honour_are_refused_by_name(server, field, value, chat,
                                                              says):
    url, _ = server
    body = {"model": NAME, "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    code, answer = post(url + ("/v1/chat/completions" if chat else "/v1/completions"),
                        json.dumps(body))
    assert code == 400, answer
    error = answer["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: "), error
    assert says in error["message"] and "unknown field" not in error["message"], error
