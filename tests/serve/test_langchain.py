"""A framework that sends OpenAI's defaults, live against `stmoe serve`: langchain-openai's
``ChatOpenAI`` (chat; streamed) and ``OpenAI`` (completions, which sends ``temperature:
0.7``, ``top_p: 1``, zero penalties, ``logprobs: null``, ``n: 1`` and the prompt as a list
of one string). Only paths that count no tokens are used: counting loads tiktoken's
encodings from the network, which a test here cannot reach."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is not installed (pip install -e '.[dev]')")

from serve_live import NAME, PROMPTS  # noqa: E402

from stmoe.runtime.batcher import Sampling  # noqa: E402


@pytest.fixture
def base(server, monkeypatch):
    monkeypatch.setenv("LANGSMITH_TRACING", "false")  # nothing sent anywhere
    url, _ = server
    return {"model": NAME, "base_url": url + "/v1", "api_key": "unused", "max_retries": 0,
            "timeout": 120}


def test_chat_openai_greedy_streamed_and_seeded(base, solo):
    prompt = "user: hello\nassistant:"
    greedy = langchain_openai.ChatOpenAI(**base, temperature=0, max_tokens=8)
    assert greedy.invoke("hello").content == solo(prompt, 8)
    assert "".join(c.content for c in greedy.stream("hello")) == solo(prompt, 8)
    seeded = langchain_openai.ChatOpenAI(**base, temperature=0.9, seed=21, max_tokens=8)
    tokens, _ = solo.sampled(solo.ids(prompt), 8, Sampling(0.9, seed=21))
    assert seeded.invoke("hello").content == solo.text(tokens)


def test_openai_completions_with_its_defaults(base, solo):
    llm = langchain_openai.OpenAI(**base, seed=8, max_tokens=8)  # temperature 0.7 by default
    assert llm.temperature == 0.7
    tokens, _ = solo.sampled(solo.ids(PROMPTS[0]), 8, Sampling(0.7, seed=8))
    assert llm.invoke(PROMPTS[0]) == solo.text(tokens)
