"""`stmoe serve` live on 127.0.0.1, driven by the official openai client: completions and
chat, streamed and not, concurrent clients whose texts equal their solo runs on the
resident model, a client that disconnects (counted cancelled), the one default
max_tokens, the bounded queue's 429, and every bad input (strictly typed: never
reinterpreted) answered with the OpenAI error object while the server goes on serving.

Nothing here depends on the machine's speed: where requests must run together, or one
must still be running when its client leaves, a gate on the batcher's steps
(``serve_live.StepGate``) holds them there; waits have a ceiling for a hang, no margin."""

from __future__ import annotations

import json
import socket
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_live import (  # noqa: E402
    NAME,
    PROMPTS,
    Solo,
    StepGate,
    all_submitted,
    get,
    post,
    until,
)
from serve_live import client as _client  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from stmoe.models import SHIPPED_MODEL  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.serve.runner import ServerThread  # noqa: E402
from stmoe.serve.service import Service  # noqa: E402

_post, _get = post, get


def _ask_together(c, batcher, lengths: list[int]) -> dict[int, str]:
    """PROMPTS[i] for lengths[i] tokens each, from clients on threads of their own: their
    texts. No step runs until every request is in (``all_submitted``): they share steps
    however far apart a busy machine starts their clients."""
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        got[i] = c.completions.create(model=NAME, prompt=PROMPTS[i], temperature=0,
                                      max_tokens=lengths[i]).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(lengths))]
    with StepGate(batcher, all_submitted(batcher, len(lengths))):
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    return got


def test_completion_and_chat_equal_the_solo_run(server, solo):
    url, _ = server
    c = _client(url)
    r = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == solo(PROMPTS[0], 12)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    extra = r.usage.model_extra["stmoe"]
    assert 0 <= extra["hit_rate"] <= 1 and extra["bytes_read"] >= 0
    assert extra["weights"].startswith("native") and extra["resident_weights"] == "native"
    chat = c.chat.completions.create(model=NAME, max_tokens=8, temperature=0,
                                     messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == solo("user: hello\nassistant:", 8)
    parts = c.chat.completions.create(model=NAME, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text",
                                                                       "text": "lo"}]}])
    assert parts.choices[0].message.content == chat.choices[0].message.content
    assert [m.id for m in c.models.list().data] == [NAME]
    assert json.loads(_get(url + "/health"))["status"] == "ok"


def test_streaming_gives_the_same_text_and_the_usage(server, solo):
    url, _ = server
    c = _client(url)
    chunks = list(c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == solo(PROMPTS[1], 10)
    assert chunks[-1].usage.completion_tokens == 10
    chat = list(c.chat.completions.create(model=NAME, max_tokens=6, stream=True, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}]))
    content = "".join(ch.choices[0].delta.content or "" for ch in chat)
    assert content == solo("user: hi\nassistant:", 6)
    assert chat[-1].choices[0].finish_reason in ("length", "stop")


def test_a_stop_string_ends_the_completion_there(server, solo):
    url, _ = server
    full = solo(PROMPTS[2], 16)
    stop = full.strip()[:3]
    assert stop and stop in full
    r = _client(url).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, stop=stop,
                                        temperature=0)
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_solo_output(server, solo):
    url, service = server
    c = _client(url)
    lengths = [14, 6, 10, 8]
    before = service.batcher.steps
    got = _ask_together(c, service.batcher, lengths)
    assert got == {i: solo(PROMPTS[i], lengths[i]) for i in range(4)}
    assert service.batcher.steps > before
    assert max(service.batcher.decode_sizes()) >= 2  # they shared steps


def _held_until_cancelled(after: int):
    """A ``StepGate`` hold: a step waits while one of its requests has ``after`` tokens and
    is not cancelled, so it cannot finish before its client's going is seen."""
    return lambda step: any(len(m.request.output) >= after and not m.request.cancelled.is_set()
                            for m in step)


def _raw(url: str, body: str) -> socket.socket:
    """A connection that sent ``body`` to /v1/completions (the caller closes it)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=120)
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    return s


def _flowing_past(after: int, seen: threading.Event):
    """A ``StepGate`` hold that never holds: it only tells (``seen``) when a request has
    ``after`` tokens, the others still coming every step."""
    def hold(step) -> bool:
        if any(len(m.request.output) >= after for m in step):
            seen.set()
        return False

    return hold


@pytest.mark.parametrize("mode", ["stream", "held", "flowing"])
def test_a_client_that_disconnects_is_cancelled_and_counted_so(server, solo, mode):
    """``held``: a whole answer's client goes while its steps wait; ``flowing``: while its
    tokens keep coming (every few ms: its going must be seen all the same, not after its
    last token)."""
    url, service = server
    body = json.dumps({"model": NAME, "prompt": PROMPTS[0], "max_tokens": 1000,
                       "stream": mode == "stream"})
    counts = service.counters.requests
    before = {k: counts.get(k, 0) for k in ("cancelled", "error", "ok")}
    seen = threading.Event()
    hold = _flowing_past(8, seen) if mode == "flowing" else _held_until_cancelled(8)
    with StepGate(service.batcher, hold) as gate:
        with _raw(url, body) as s:
            if mode == "stream":  # mid-stream: some of its text came
                received = b""
                while b"data:" not in received:
                    received += s.recv(4096)
            else:  # mid-run: its 8th token made (the rest held, or still coming)
                assert (seen if mode == "flowing" else gate.held).wait(120)
        until(lambda: counts.get("cancelled", 0) == before["cancelled"] + 1,
              "counted cancelled")
    until(lambda: service.batcher.queue_depth() == (0, 0), "out of the batch")
    assert {k: counts.get(k, 0) for k in ("error", "ok")} == {"error": before["error"],
                                                              "ok": before["ok"]}
    metrics = _get(url + "/metrics")
    assert f'stmoe_requests_total{{outcome="cancelled"}} {before["cancelled"] + 1}' in metrics
    r = _client(url).completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=5,
                                        temperature=0)
    assert r.choices[0].text == solo(PROMPTS[3], 5)  # and the server goes on


def _prompt_of(solo, tokens: int) -> tuple[str, list[int]]:
    """A chat message whose rendered prompt is ``tokens`` tokens: (content, the ids)."""
    for k in range(tokens, 0, -1):
        content = " ".join(["one"] * k)
        ids = solo.ids(f"user: {content}\nassistant:")
        if len(ids) <= tokens:
            return content, ids
    raise AssertionError("no such prompt")


def test_max_tokens_absent_or_null_is_one_default_up_to_the_context(server, solo):
    """The default is the positions the prompt leaves (both endpoints, absent or null
    alike): a prompt that fits is never refused for a filled-in default."""
    url, service = server
    for left in (1, 3):
        ids = [5 + i % 50 for i in range(service.positions - left)]
        want = {"text": solo.text_of(ids, left), "tokens": len(solo.tokens(ids, left))}
        for extra in ({}, {"max_tokens": None}):
            code, answer = _post(url + "/v1/completions",
                                 json.dumps({"model": NAME, "prompt": ids, "temperature": 0,
                                             **extra}))
            assert code == 200, answer
            got = {"text": answer["choices"][0]["text"],
                   "tokens": answer["usage"]["completion_tokens"]}
            assert got == want, (left, extra)
    content, ids = _prompt_of(solo, service.positions - 2)
    left = service.positions - len(ids)
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        code, answer = _post(url + "/v1/chat/completions", json.dumps(
            {"model": NAME, "messages": [{"role": "user", "content": content}],
             "temperature": 0, **extra}))
        assert code == 200, answer
        assert answer["choices"][0]["message"]["content"] == solo.text_of(ids, left), extra
        assert answer["usage"]["prompt_tokens"] == len(ids)


DEEP = "[" * 3000 + "]" * 3000
BAD = [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (b"\xff\xfe", 400, None, "not valid JSON"),
    (json.dumps({"model": NAME, "prompt": "x", "colour": 1}), 400, "colour", "unknown field"),
    # an unknown field named as sent, whatever it looks like (a capital, a type's name:
    # once taken for pydantic's union tags, "unknown field None")
    (json.dumps({"model": NAME, "prompt": "x", "Temperature": 0.5}), 400, "Temperature",
     "unknown field 'Temperature'"),
    (json.dumps({"model": NAME, "prompt": "x", "str": 1}), 400, "str", "unknown field"),
    # UTF-8 only: json.loads of bytes guessed UTF-16 and skipped a byte-order mark
    (json.dumps({"model": NAME, "prompt": "x"}).encode("utf-16"), 400, None, "not UTF-8"),
    (b"\xef\xbb\xbf" + json.dumps({"model": NAME, "prompt": "x"}).encode(), 400, None,
     "BOM"),
    (json.dumps({"prompt": "x"}), 400, "model", "missing"),
    (json.dumps({"model": NAME, "prompt": "x", "n": 6}), 400, "n", "--max-batch + --max-queue"),
    (json.dumps({"model": NAME, "prompt": "x", "n": 0}), 400, "n", "greater than or equal to 1"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": 10**9}), 400, "max_tokens",
     "positions"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": 0}), 400, "max_tokens",
     "at least 1"),
    (json.dumps({"model": NAME, "prompt": "word " * 2000}), 400, "prompt", "positions"),
    (json.dumps({"model": NAME, "prompt": [5, 10**6]}), 400, "prompt", "vocabulary"),
    (json.dumps({"model": NAME, "prompt": []}), 400, "prompt", "empty"),
    (json.dumps({"model": NAME, "prompt": ["a", "b"]}), 400, "prompt", "one prompt"),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": 2.5}), 400, "temperature",
     "less than or equal to 2"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}), 404, "model", "not served"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": "many"}), 400, "max_tokens", ""),
    # strictly typed: never reinterpreted (issue 44)
    (json.dumps({"model": NAME, "prompt": ["1", 2]}), 400, "prompt", "token ids (integers)"),
    (json.dumps({"model": NAME, "prompt": [True, False]}), 400, "prompt", "boolean"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": True}), 400, "max_tokens",
     "valid integer"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": 2.0}), 400, "max_tokens",
     "valid integer"),
    (json.dumps({"model": NAME, "prompt": "x", "stream": 1}), 400, "stream", "boolean"),
    (json.dumps({"model": NAME, "prompt": "x", "n": True}), 400, "n", "valid integer"),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": "0"}), 400, "temperature",
     "valid number"),
    (json.dumps({"model": NAME, "prompt": "x", "stop": 5}), 400, "stop", "a string"),
    (json.dumps({"model": NAME, "prompt": "x", "stop": ["a", None]}), 400, "stop", "a string"),
    (json.dumps({"model": NAME, "prompt": "x", "stop": ""}), 400, "stop",
     "an empty string is no stop string"),
    (json.dumps({"model": NAME, "prompt": "x", "stop": ["a"] * 5}), 400, "stop",
     "at most 4 stop strings, got 5"),
    (json.dumps({"model": NAME, "prompt": "x", "stream": True,
                 "stream_options": {"include_usage": 1}}), 400,
     "stream_options.include_usage", "boolean"),
    (json.dumps({"model": NAME, "prompt": "x", "stream_options": {"include_usage": True}}),
     400, "stream_options", "send it with stream: true"),  # (at its default: taken)
    (json.dumps({"model": 5, "prompt": "x"}), 400, "model", "valid string"),
    # failures of parsing and encoding: the error object, never a 500
    (json.dumps({"model": NAME, "prompt": "abc\ud800def"}), 400, "prompt", "lone surrogate"),
    (json.dumps({"model": NAME, "prompt": "x", "user": "\udc00"}), 400, "user", "surrogate"),
    (json.dumps({"model": NAME, "prompt": "x", "\ud800": 1}), 400, "\\ud800",
     "field's name of invalid Unicode"),
    (json.dumps({"model": NAME, "prompt": "x", "logit_bias": {"\ud800": 1}}), 400,
     "logit_bias.\\ud800", "lone surrogate"),  # (a field taken only at its default)
    (f'{{"model": "{NAME}", "prompt": {DEEP}}}', 400, None, "nested too deeply"),
    (DEEP, 400, None, "nested too deeply"),
    (f'{{"model": "{NAME}", "prompt": "x", "max_tokens": {"9" * 5000}}}', 400, None,
     "not valid JSON"),
    (b'{"model": "tiny-moe", "prompt": "\xed\xa0\x80"}', 400, "prompt", "lone surrogate"),
    (b'{"model": "tiny-moe", "prompt": "\xff"}', 400, None, "not valid JSON"),
    (b"", 400, None, "not valid JSON"),
]


@pytest.mark.parametrize(("body", "status", "param", "says"), BAD)
def test_bad_input_gets_the_openai_error_and_the_server_goes_on(server, body, status, param,
                                                                 says):
    url, service = server
    counts = service.counters.requests
    invalid = counts.get("invalid", 0)
    code, answer = _post(url + "/v1/completions", body)
    assert code == status, answer
    error = answer["error"]
    assert says in error["message"] and error["param"] == param, error
    assert error["type"] in ("invalid_request_error", "not_found_error")
    assert counts.get("invalid", 0) == invalid + 1  # counted on /metrics, once
    ok, _ = _post(url + "/v1/completions", json.dumps({"model": NAME, "prompt": "x",
                                                       "max_tokens": 2}))
    assert ok == 200 and counts.get("invalid", 0) == invalid + 1
    assert f'stmoe_requests_total{{outcome="invalid"}} {invalid + 1}' in _get(url + "/metrics")


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path):
    """One line naming the port, exit 1, in seconds; no "serving" line for a port the server
    never got (it had printed one, then uvicorn's traceback-free error and exit 3)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "stmoe", "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "serving" not in run.stdout, (run.stdout, run.stderr)
    assert run.stderr.strip().splitlines() == [
        f"error: --host 127.0.0.1 --port {port}: cannot listen there: the port is in use; "
        "stop what listens there or pick another --port"]


def test_bad_chat_messages_are_refused(server):
    url, _ = server

    def user(content) -> str:
        return json.dumps({"model": NAME, "messages": [{"role": "user", "content": content}]})

    for body, param, says in (
            (json.dumps({"model": NAME, "messages": []}), "messages", "messages"),
            (json.dumps({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}),
             "messages.0.role", "role"),
            (user([{"type": "image_url", "image_url": {"url": "x"}}]), "messages.0.content",
             "content"),
            (user("abc\ud800def"), "messages.0.content", "lone surrogate"),
            (user([{"type": "text", "text": "\ud800"}]), "messages.0.content.0.text",
             "surrogate"),
            # fields kept as JSON, or only at their default: once a 500 (the refusal quoted
            # the value), or taken (a key of metadata)
            (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                         "tool_choice": "\ud800"}), "tool_choice", "lone surrogate"),
            (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                         "metadata": {"\ud800": "x"}}), "metadata.\\ud800", "surrogate"),
            (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                         "prompt_cache_options": {"a": "\udfff"}}), "prompt_cache_options.a",
             "surrogate"),
            (user(5), "messages.0.content", "a string"),
            (user(["hi"]), "messages.0.content", "content part"),
            (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                         "max_completion_tokens": True}), "max_completion_tokens", "integer"),
            (json.dumps({"model": NAME, "messages": "hi"}), "messages", "list"),
            (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x",
                                                     "Name": "y"}]}), "messages.0.Name",
             "unknown field"),
            (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                         "max_completion_tokens": 5, "max_tokens": -7}), "max_tokens",
             "max_tokens must be at least 1, got -7"),
            # the limit refused under the name it was sent by
            (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                         "max_completion_tokens": 0, "max_tokens": 5}),
             "max_completion_tokens", "max_completion_tokens must be at least 1"),
            (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                         "max_completion_tokens": 10**6}), "max_completion_tokens",
             "exceed the model's")):
        code, answer = _post(url + "/v1/chat/completions", body)
        assert code == 400 and says in answer["error"]["message"], answer
        assert answer["error"]["param"] == param, answer


def test_a_prompt_of_megabytes_is_refused_from_its_first_characters(server, monkeypatch):
    """A text prompt that cannot fit is refused from its first 32 characters per position,
    never tokenized whole (4 MB: seconds and most of a GiB on a thread every client's
    request needs); one that fits is tokenized whole, as before."""
    url, service = server
    from stmoe.serve.service import PREFIX_CHARS

    seen: list[int] = []
    tok = service.tokenizer

    class Recording:  # the tokenizer, each text it tokenizes (directly) recorded
        def __call__(self, text: str, **kw):
            seen.append(len(text))
            return tok(text, **kw)

        def __getattr__(self, name: str):
            return getattr(tok, name)

    monkeypatch.setattr(service, "tokenizer", Recording())
    for endpoint, body in (("completions", {"prompt": "word " * 800_000}),
                           ("chat/completions",
                            {"messages": [{"role": "user", "content": "word " * 800_000}]})):
        seen.clear()
        code, answer = _post(f"{url}/v1/{endpoint}", json.dumps({"model": NAME, **body}))
        assert code == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert seen and max(seen) <= service.positions * PREFIX_CHARS, seen
    seen.clear()
    code, _ = _post(url + "/v1/completions", json.dumps({"model": NAME, "prompt": "word " * 100,
                                                         "max_tokens": 2}))
    assert code == 200 and seen == [500]


def test_a_chat_template_prompt_of_megabytes_is_refused_too():
    """A chat template's rendering is checked the same way (the shipped model has none)."""
    from transformers import AutoTokenizer

    from stmoe.serve.protocol import ApiError, ChatRequest
    from stmoe.serve.service import Service

    service = Service.__new__(Service)  # (its tokenizer and positions are all chat_ids reads)
    service.tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    service.tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                       "\n{% endfor %}<assistant>")
    service.positions = 1024

    def chat(content: str) -> ChatRequest:
        return ChatRequest.model_validate({"model": NAME, "messages": [
            {"role": "user", "content": content}]})

    with pytest.raises(ApiError, match="its first 32768 characters alone"):
        service.chat_ids(chat("word " * 800_000))
    short = [{"role": "user", "content": "word " * 100}]
    rendered = service.tokenizer.apply_chat_template(short, add_generation_prompt=True,
                                                     tokenize=False)
    assert service.chat_ids(chat("word " * 100)) == service.tokenizer(
        rendered, add_special_tokens=False).input_ids


def test_a_chat_template_renders_the_prompt(server, solo, monkeypatch):
    """A model with a chat template (every real chat model; the shipped one has none): the
    rendered messages are the prompt. transformers 5 answers the template's tokens as a
    BatchEncoding, which was taken for the ids, so every such chat request failed."""
    url, service = server
    monkeypatch.setattr(service.tokenizer, "chat_template", "{% for m in messages %}<{{ "
                        "m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>", raising=False)
    code, answer = _post(url + "/v1/chat/completions", json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": "def f(x):"}],
         "max_tokens": 6, "temperature": 0}))
    assert code == 200, answer
    ids = service.tokenizer("<user>def f(x):\n<assistant>", add_special_tokens=False).input_ids
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["choices"][0]["message"]["content"] == solo.text_of(ids, 6)


def test_a_sentencepiece_completion_keeps_its_first_space(server, solo, monkeypatch):
    """With a sentencepiece-style tokenizer (Llama's, Mixtral's, Gemma's) a completion's
    text is what it adds to the prompt's: its first word's space kept, streamed or not.
    Decoded alone, as it was, every answer began without it ("Sayhello")."""
    from metaspace_tokenizer import metaspace_tokenizer

    url, service = server
    monkeypatch.setattr(service, "tokenizer", metaspace_tokenizer(
        int(service.om.model.config.vocab_size)))
    ids = [5, 6, 7, 8, 9]
    tokens = [t for t in solo.tokens(ids, 5) if t not in solo.eos]
    assert tokens and min(tokens) >= 2  # words only (ids 0 and 1 are unk and BOS)
    want = "".join(f" w{t}" for t in tokens)
    code, answer = _post(url + "/v1/completions", json.dumps(
        {"model": NAME, "prompt": ids, "max_tokens": 5, "temperature": 0}))
    assert code == 200 and answer["choices"][0]["text"] == want, answer
    streamed = _client(url).completions.create(model=NAME, prompt=ids, max_tokens=5,
                                               temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_a_messages_name_reaches_the_prompt():
    """OpenAI's participant name: passed to a chat template (as vLLM's server does), and
    in the plain rendering `role (name): content`; it was accepted and dropped."""
    from transformers import AutoTokenizer

    from stmoe.serve.protocol import ChatRequest
    from stmoe.serve.service import Service

    service = Service.__new__(Service)
    service.tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    service.positions = 1024
    req = ChatRequest.model_validate({"model": NAME, "messages": [
        {"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]})
    tok = service.tokenizer
    assert service.chat_ids(req) == tok("user (ann): hi\nuser: yo\nassistant:").input_ids
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}{% if m.name %} {{ m.name }}"
                         "{% endif %}>{{ m['content'] }}{% endfor %}<assistant>")
    assert tok.decode(service.chat_ids(req)) == "<user ann>hi<user>yo<assistant>"


def test_more_clients_than_the_batch_and_queue_get_429(server):
    """No step runs while the five are sent (a gate), so none can finish and free a place:
    the sixth is refused whatever the machine's load, and whether or not the batcher's
    thread has moved the queued ones into the batch yet."""
    url, service = server
    c = _client(url)
    with StepGate(service.batcher, lambda step: True):
        streams = [c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=400,
                                        stream=True) for _ in range(5)]  # 3 running + 2 queued
        try:
            assert sum(service.batcher.queue_depth()) == 5
            with pytest.raises(openai.RateLimitError, match="retry later"):
                c.completions.create(model=NAME, prompt="x", max_tokens=2)
            # the two queued clients go away: their places are free at once, not when a
            # running request ends (no step runs: none can end)
            cancelled = service.counters.requests.get("cancelled", 0)
            for s in streams[3:]:
                s.close()
            until(lambda: service.counters.requests.get("cancelled", 0) == cancelled + 2,
                  "the queued clients' going seen")
            # (the gate may hold the batcher's thread before it moved all three into the
            # batch: a CI run saw (1, 2); the places are what counts)
            assert sum(service.batcher.queue_depth()) == 3
            streams.append(c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=400,
                                                stream=True))  # taken, not a 429
            assert sum(service.batcher.queue_depth()) == 4
        finally:
            for s in streams:
                s.close()
    until(lambda: service.batcher.queue_depth() == (0, 0), "out of the batch")
    metrics = _get(url + "/metrics")
    assert 'stmoe_requests_total{outcome="rejected"}' in metrics
    for name in ("hit_rate", "stall_seconds_total", "bytes_read_total", "prefetch_recall",
                 "bytes_wasted_total", "queue_depth", "decode_tokens_per_second"):
        assert f"\nstmoe_{name}" in metrics, name


def test_int4_server_batches_decode_steps_and_keeps_each_clients_solo_output(tmp_path,
                                                                           monkeypatch):
    """--format int4 --quantize-resident int4: decode steps run as one batched forward,
    and every client's text is its solo run on the resident model in int4."""
    from stmoe.quant import parse_format
    from stmoe.quant.experts import quantize_model
    from stmoe.quant.linears import quantize_linears

    resident = quantize_model(AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL).eval(),
                              parse_format("int4"))
    quantize_linears(resident, parse_format("int4"))
    alone = Solo(resident)
    lengths = [12, 5, 9]

    monkeypatch.setenv("STMOE_CACHE", str(tmp_path))  # its int4 store packed there
    om = offload(SHIPPED_MODEL, capacity="50%", predictor="stmoe-plus", format="int4",
                 quantize_resident="int4")
    service = Service(om, NAME, max_batch=3, max_queue=2)
    try:
        assert service.batcher.batched
        with ServerThread(service) as url:
            got = _ask_together(_client(url), service.batcher, lengths)
            usage = _client(url).completions.create(model=NAME, prompt=PROMPTS[0],
                                                    max_tokens=2).usage.model_extra["stmoe"]
            metrics = _get(url + "/metrics")
    finally:
        om.close()
    assert got == {i: alone(PROMPTS[i], lengths[i]) for i in range(3)}
    assert max(service.batcher.decode_sizes()) >= 2  # they shared steps
    steps = service.batcher.step_forward.steps
    assert steps > 0 and f"stmoe_batched_forward_steps_total {steps}" in metrics
    # the lossy format is named in every response
    assert "int4" in usage["weights"] and "lossy" in usage["weights"]
    assert usage["resident_weights"] == "int4"


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server, monkeypatch):
    """A prompt of megabytes takes seconds to tokenize (then it is refused: too long); the
    server answers other clients meanwhile. Its tokenizing is held here until another
    client got its answer: on the event loop, that answer could never come."""
    url, service = server
    holding, release = threading.Event(), threading.Event()
    real = service._encode

    def encode(text: str) -> list[int]:
        if len(text) > 10**6:
            holding.set()
            release.wait(120)
        return real(text)

    monkeypatch.setattr(service, "_encode", encode)
    answers: dict[str, tuple[int, dict]] = {}
    big = threading.Thread(target=lambda: answers.setdefault("big", _post(
        url + "/v1/completions", json.dumps({"model": NAME, "prompt": "hello world " * 200_000,
                                             "max_tokens": 1}))))
    big.start()
    try:
        assert holding.wait(120), "the huge prompt never reached the tokenizer"
        assert json.loads(_get(url + "/health"))["status"] == "ok"  # while it is tokenized
    finally:
        release.set()
        big.join(120)
    code, answer = answers["big"]
    assert code == 400 and answer["error"]["code"] == "context_length_exceeded", answer


def test_a_wrong_method_gets_405_with_allow_and_an_unknown_path_404(server):
    import urllib.error
    import urllib.request

    url, _ = server
    for path, method, status in (("/v1/completions", "GET", 405), ("/nowhere", "GET", 404),
                                 ("/health", "POST", 405)):
        req = urllib.request.Request(url + path, method=method, data=b"{}" if method == "POST"
                                     else None)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=120)
        e = caught.value
        assert e.code == status and "error" in json.loads(e.read()), path
        if status == 405:  # HTTP requires the methods it takes
            assert e.headers["Allow"] == ("POST" if method == "GET" else "GET"), e.headers


def test_a_chat_templates_own_refusal_is_the_clients_error():
    """Mixtral's template raises on roles that do not alternate: a 400 naming the messages
    and the template's words (it was a 500)."""
    from transformers import AutoTokenizer

    from stmoe.serve.protocol import ApiError, ChatRequest
    from stmoe.serve.service import Service

    service = Service.__new__(Service)
    service.tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    service.positions = 1024
    service.tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    req = ChatRequest.model_validate({"model": NAME, "messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    with pytest.raises(ApiError, match="chat template refused the messages: roles must "
                       "alternate") as caught:
        service.chat_ids(req)
    assert caught.value.status == 400 and caught.value.param == "messages"
