"""The request surface of `stmoe serve`, fuzzed (hypothesis): generated bodies for
/v1/completions and /v1/chat/completions, valid ones and ones a mutation broke (a field
of the wrong type or value, a field dropped or unknown, a body that is not an object or
not JSON). Each is checked against a small model of the API written here (``spec``):
a body it refuses must get a 4xx OpenAI error object, one it accepts must get 200 and,
at temperature 0, the resident model's greedy output of the request it parses to in
each of its ``n`` choices (``max_tokens`` is always set: the default, up to the context,
is tested in test_server.py; sampling in test_sampling.py). The server
answers a known request correctly afterwards. Examples are derandomized: the same ones
on every run."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_live import NAME, post  # noqa: E402

VOCAB = 4096
ROLES = ("system", "user", "assistant", "developer")
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

text = st.text(alphabet="ab (=:\n\u00e9\u4e2d", max_size=10)
junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**20), st.floats(),
                 st.just("\ud800x"), text, st.lists(st.integers(-1, VOCAB + 1), max_size=2),
                 st.lists(st.one_of(text, st.booleans()), max_size=2),
                 st.dictionaries(text, st.integers(), max_size=1))
# per field, values a loose parser would take for another type (or a near one)
NEAR = {
    "model": [5, None, [NAME], NAME + "\ud800", "gpt-4"],
    "prompt": [["1", 2], [True, False], [1, "a"], [[1]], [1.0], [-1], [VOCAB], [],
               ["a", "b"], "abc\ud800def", 5, {"a": 1}],
    "max_tokens": [True, False, 1.0, "2", [2], 0, -1, 10**6],
    "n": [True, 1.0, "1", 2, None, 0, 6],
    "stop": [5, ["a", None], "", ["\ud800"], ["a"] * 5, True, [["a"]]],
    "stream": [1, 0, "true", None],
    "temperature": ["0", True, False, 0.5, float("nan"), None, 2.5, -1],
    "messages": ["hi", [], [5], [{"role": "user"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": ["hi"]}], [{"role": True, "content": "x"}],
                 [{"role": "user", "content": "\ud800"}],
                 [{"role": "user", "content": [{"type": "text", "text": 1}]}],
                 [{"role": "user", "content": "x", "name": 5}]],
}
prompts = st.one_of(text, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                    st.lists(text, min_size=1, max_size=1))
stops = st.one_of(st.none(), st.text(alphabet="ab =:", min_size=1, max_size=2),
                  st.lists(st.text(alphabet="ab =:", min_size=1, max_size=2), max_size=2))
contents = st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                           "text": text}), max_size=2))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES),
                                           "content": contents}), min_size=1, max_size=2)


@st.composite
def bodies(draw: Any, chat: bool) -> Any:
    """A valid body, then up to two mutations; now and then raw bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.one_of(st.binary(max_size=12), st.sampled_from(
            [b"[1]", b'"x"', b"null", b"{", b'{"model": "tiny-moe"'])))
    body: dict[str, Any] = {"model": NAME, "max_tokens": draw(st.integers(1, 4))}
    if chat:
        body["messages"] = draw(messages)
    else:
        body["prompt"] = draw(prompts)
    body["temperature"] = draw(st.sampled_from([0, 0.0]))  # greedy: its output is known
    for key, values in (("stop", stops), ("stream", st.booleans()), ("n", st.integers(1, 2))):
        if draw(st.booleans()):
            body[key] = draw(values)
    fields = ["model", "max_tokens", "stop", "stream", "n", "temperature",
              "messages" if chat else "prompt"]
    for _ in range(draw(st.integers(0, 2))):
        how = draw(st.sampled_from(["near", "near", "set", "drop", "extra"]))
        key = draw(st.sampled_from(fields))
        if how == "near":
            body[key] = draw(st.sampled_from(NEAR[key]))
        elif how == "set":
            body[key] = draw(junk.filter(lambda v, k=key: not (k == "max_tokens" and v is None)))
        elif how == "drop" and key != "max_tokens":
            body.pop(key, None)
        elif how == "extra":
            body[draw(st.sampled_from(["colour", "prompts", "max_token"]))] = 1
    return body


def _is_int(v: Any) -> bool:
    return type(v) is int


def _text(v: Any) -> bool:
    """A string that can be encoded (no lone surrogate)."""
    if not isinstance(v, str):
        return False
    try:
        v.encode()
    except UnicodeEncodeError:
        return False
    return True


def _number(v: Any) -> bool:
    return type(v) in (int, float) and v == v  # not NaN


def spec(body: Any, chat: bool, solo: Any, positions: int) -> tuple[list[int], int, list[str],
                                                                     int, bool] | None:
    """What this API makes of ``body``: (prompt ids, max_tokens, stops, n, greedy), or None
    where it must be refused (n at most 5: the batch and queue of the server)."""
    if not isinstance(body, dict):
        return None
    allowed = {"model", "max_tokens", "stop", "stream", "n", "temperature",
               "messages" if chat else "prompt"}
    if not set(body) <= allowed or "model" not in body or body["model"] != NAME:
        return None
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    stops = [] if stops is None else stops
    if not (isinstance(stops, list) and len(stops) <= 4 and all(_text(s) and s for s in stops)):
        return None
    n, temperature = body.get("n"), body.get("temperature")
    n = 1 if n is None else n
    if not (isinstance(body.get("stream", False), bool) and _is_int(n) and 1 <= n <= 5
            and (temperature is None or (_number(temperature) and 0 <= temperature <= 2))):
        return None
    ids = _chat_ids(body, solo) if chat else _prompt_ids(body, solo)
    most = body.get("max_tokens")
    if ids is None or not ids or not _is_int(most) or not 1 <= most <= positions - len(ids):
        return None
    return ids, most, stops, n, temperature == 0


def _prompt_ids(body: dict, solo: Any) -> list[int] | None:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if _text(p):
        return solo.ids(p)
    if isinstance(p, list) and p and all(_is_int(t) and 0 <= t < VOCAB for t in p):
        return p
    return None


def _chat_ids(body: dict, solo: Any) -> list[int] | None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return None
    lines = []
    for m in msgs:
        if not (isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES):
            return None
        c = m["content"]
        if isinstance(c, list) and all(isinstance(p, dict) and set(p) == {"type", "text"}
                                       and p["type"] == "text" for p in c):
            c = "".join(p["text"] if _text(p["text"]) else "\ud800" for p in c)
        if not _text(c):
            return None
        lines.append(f"{m['role']}: {c}\n")
    return solo.ids("".join(lines) + "assistant:")


def _expected(solo: Any, ids: list[int], n: int, stops: list[str]) -> str:
    full = solo.text_of(ids, n)
    found = [at for at in (full.find(s) for s in stops) if at >= 0]
    return full[: min(found)] if found else full


def _answer_texts(raw: bytes, chat: bool) -> dict[int, str]:
    """Each choice's text from a JSON answer or a stream of server-sent events."""
    if not raw.startswith(b"data:"):
        answer = json.loads(raw)
        return {c["index"]: c["message"]["content"] if chat else c["text"]
                for c in answer["choices"]}
    out: dict[int, str] = {}
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        for c in event["choices"]:
            piece = (c["delta"].get("content") or "") if chat else c["text"]
            out[c["index"]] = out.get(c["index"], "") + piece
    return out


def _check(url: str, solo: Any, positions: int, body: Any, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, raw = post(url + path, data, raw=True)
    want = spec(body, chat, solo, positions)
    event(f"{'accepted' if want else 'refused'}: {code}")  # --hypothesis-show-statistics
    if want is None:
        assert 400 <= code < 500, (body, code, raw)
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), error
        assert error["param"] is None or isinstance(error["param"], str), error
        return
    assert code == 200, (body, raw)
    ids, most, stops, n, greedy = want
    texts = _answer_texts(raw, chat)
    assert sorted(texts) == list(range(n)), (body, texts)
    if greedy:  # else sampled: test_sampling.py checks what a seed gives
        assert set(texts.values()) == {_expected(solo, ids, most, stops)}, body


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_generated_body_gets_an_error_object_or_its_solo_output(server, solo, chat):
    url, service = server

    @SETTINGS
    @given(bodies(chat))
    def fuzz(body: Any) -> None:
        _check(url, solo, service.positions, body, chat)

    fuzz()
    known = {"model": NAME, "prompt": "def fib(n):", "max_tokens": 6, "temperature": 0}
    code, raw = post(url + "/v1/completions", json.dumps(known).encode(), raw=True)
    assert code == 200 and _answer_texts(raw, False) == {0: solo("def fib(n):", 6)}
