"""`stmoe serve` live on 127.0.0.1, driven by the official openai client: completions and
chat, streamed and not, concurrent clients whose texts equal their solo runs on the
resident model, a client that disconnects mid-stream, the bounded queue's 429, and every
bad input answered with the OpenAI error object while the server goes on serving."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from stmoe.models import SHIPPED_MODEL  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.serve.runner import ServerThread  # noqa: E402
from stmoe.serve.service import Service  # noqa: E402

NAME = "tiny-moe"
PROMPTS = ["def fib(n):", "The capital of France is", "import numpy as np\n", "Once upon a"]


@pytest.fixture(scope="module")
def server():
    om = offload(SHIPPED_MODEL, capacity="50%", predictor="stmoe-plus")
    service = Service(om, NAME, max_batch=3, max_queue=2)
    try:
        with ServerThread(service) as url:
            yield url, service
    finally:
        om.close()


@pytest.fixture(scope="module")
def solo():
    """Greedy text of the resident model, run alone."""
    return solo_text(AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL).eval())


def solo_text(model: torch.nn.Module):
    """``run(prompt, n)``: ``model``'s greedy text of ``n`` tokens, alone."""
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    eos = model.generation_config.eos_token_id

    def run(prompt: str, n: int) -> str:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=eos)
        return tok.decode([t for t in out[0, ids.shape[1]:].tolist() if t != eos],
                          skip_special_tokens=True)

    return run


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask_together(c, lengths: list[int]) -> dict[int, str]:
    """PROMPTS[i] for lengths[i] tokens each, the clients a little apart: their texts."""
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        got[i] = c.completions.create(model=NAME, prompt=PROMPTS[i],
                                      max_tokens=lengths[i]).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(lengths))]
    for t in threads:
        t.start()
        time.sleep(0.03)
    for t in threads:
        t.join(120)
    return got


def _post(url: str, body: str | bytes) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as f:
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as f:
        return f.read().decode()


def test_completion_and_chat_equal_the_solo_run(server, solo):
    url, _ = server
    c = _client(url)
    r = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12)
    assert r.choices[0].text == solo(PROMPTS[0], 12)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    extra = r.usage.model_extra["stmoe"]
    assert 0 <= extra["hit_rate"] <= 1 and extra["bytes_read"] >= 0
    assert extra["weights"].startswith("native") and extra["resident_weights"] == "native"
    chat = c.chat.completions.create(model=NAME, max_tokens=8,
                                     messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == solo("user: hello\nassistant:", 8)
    parts = c.chat.completions.create(model=NAME, max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text",
                                                                       "text": "lo"}]}])
    assert parts.choices[0].message.content == chat.choices[0].message.content
    assert [m.id for m in c.models.list().data] == [NAME]
    assert json.loads(_get(url + "/health"))["status"] == "ok"


def test_streaming_gives_the_same_text_and_the_usage(server, solo):
    url, _ = server
    c = _client(url)
    chunks = list(c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10,
                                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == solo(PROMPTS[1], 10)
    assert chunks[-1].usage.completion_tokens == 10
    chat = list(c.chat.completions.create(model=NAME, max_tokens=6, stream=True,
                                          messages=[{"role": "user", "content": "hi"}]))
    content = "".join(ch.choices[0].delta.content or "" for ch in chat)
    assert content == solo("user: hi\nassistant:", 6)
    assert chat[-1].choices[0].finish_reason in ("length", "stop")


def test_a_stop_string_ends_the_completion_there(server, solo):
    url, _ = server
    full = solo(PROMPTS[2], 16)
    stop = full.strip()[:3]
    assert stop and stop in full
    r = _client(url).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, stop=stop)
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_solo_output(server, solo):
    url, service = server
    c = _client(url)
    lengths = [14, 6, 10, 8]
    before = service.batcher.steps
    got = _ask_together(c, lengths)
    assert got == {i: solo(PROMPTS[i], lengths[i]) for i in range(4)}
    assert service.batcher.steps > before
    assert max(service.batcher.decode_sizes()) >= 2  # they shared steps


def test_a_client_that_disconnects_mid_stream_is_cancelled(server, solo):
    url, service = server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": NAME, "prompt": PROMPTS[0], "max_tokens": 500, "stream": True})
    before = service.counters.requests.get("cancelled", 0)
    with socket.create_connection((host, int(port))) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        received = b""
        while received.count(b"data:") < 3:
            received += s.recv(4096)
    deadline = time.monotonic() + 30
    while service.batcher.queue_depth() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.batcher.queue_depth() == (0, 0)  # it left the batch
    assert service.counters.requests.get("cancelled", 0) == before + 1
    r = _client(url).completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=5)
    assert r.choices[0].text == solo(PROMPTS[3], 5)  # and the server goes on


BAD = [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (b"\xff\xfe", 400, None, "not valid JSON"),
    (json.dumps({"model": NAME, "prompt": "x", "colour": 1}), 400, "colour", "unknown field"),
    (json.dumps({"prompt": "x"}), 400, "model", "missing"),
    (json.dumps({"model": NAME, "prompt": "x", "n": 2}), 400, "n", "n must be 1"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": 10**9}), 400, "max_tokens",
     "positions"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": 0}), 400, "max_tokens",
     "at least 1"),
    (json.dumps({"model": NAME, "prompt": "word " * 2000}), 400, "prompt", "positions"),
    (json.dumps({"model": NAME, "prompt": [5, 10**6]}), 400, "prompt", "vocabulary"),
    (json.dumps({"model": NAME, "prompt": []}), 400, "prompt", "empty"),
    (json.dumps({"model": NAME, "prompt": ["a", "b"]}), 400, "prompt", "one prompt"),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": 0.8}), 400, "temperature",
     "greedily"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}), 404, "model", "not served"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": "many"}), 400, "max_tokens", ""),
]


@pytest.mark.parametrize(("body", "status", "param", "says"), BAD)
def test_bad_input_gets_the_openai_error_and_the_server_goes_on(server, body, status, param,
                                                                 says):
    url, _ = server
    code, answer = _post(url + "/v1/completions", body)
    assert code == status, answer
    error = answer["error"]
    assert says in error["message"] and error["param"] == param, error
    assert error["type"] in ("invalid_request_error", "not_found_error")
    ok, _ = _post(url + "/v1/completions", json.dumps({"model": NAME, "prompt": "x",
                                                       "max_tokens": 2}))
    assert ok == 200


def test_bad_chat_messages_are_refused(server):
    url, _ = server
    for body, says in ((json.dumps({"model": NAME, "messages": []}), "messages"),
                       (json.dumps({"model": NAME, "messages": [{"role": "wizard",
                                                                 "content": "x"}]}), "role"),
                       (json.dumps({"model": NAME, "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": "x"}}]}]}), "content")):
        code, answer = _post(url + "/v1/chat/completions", body)
        assert code == 400 and says in answer["error"]["message"], answer


def test_more_clients_than_the_batch_and_queue_get_429(server):
    url, service = server
    c = _client(url)
    streams = [c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=400, stream=True)
               for _ in range(5)]  # 3 running + 2 queued
    try:
        with pytest.raises(openai.RateLimitError, match="retry later"):
            c.completions.create(model=NAME, prompt="x", max_tokens=2)
    finally:
        for s in streams:
            s.close()
    deadline = time.monotonic() + 60
    while service.batcher.queue_depth() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.batcher.queue_depth() == (0, 0)
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
    alone = solo_text(resident)
    lengths = [12, 5, 9]

    monkeypatch.setenv("STMOE_CACHE", str(tmp_path))  # its int4 store packed there
    om = offload(SHIPPED_MODEL, capacity="50%", predictor="stmoe-plus", format="int4",
                 quantize_resident="int4")
    service = Service(om, NAME, max_batch=3, max_queue=2)
    try:
        assert service.batcher.batched
        with ServerThread(service) as url:
            got = _ask_together(_client(url), lengths)
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
