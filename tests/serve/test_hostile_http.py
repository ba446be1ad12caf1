"""`stmoe serve` against clients that misbehave at the HTTP level: limits hold before the
body is read (a huge Content-Length refused at once, a chunked body cut off at the
limit), partial requests time out (slowloris: headers or a body that never finish, a
body sent a byte at a time), and a client gone mid-body leaves no traceback in the log.
The server here gives a request TIMEOUT seconds to arrive whole."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from serve_live import CEILING, NAME, post, until

from stmoe.models import SHIPPED_MODEL
from stmoe.runtime.api import offload
from stmoe.serve.app import MAX_BODY
from stmoe.serve.runner import ServerThread
from stmoe.serve.service import Service

TIMEOUT = 1.0  # seconds for a request to arrive whole, on this test's server
GOOD = json.dumps({"model": NAME, "prompt": "def f(", "max_tokens": 2})


class Records(logging.Handler):
    """What the server's loggers said (uvicorn's do not reach pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def failures(self) -> list[str]:
        return [r.getMessage() for r in self.records
                if r.levelno >= logging.ERROR or r.exc_info is not None]


@pytest.fixture(scope="module")
def hostile():
    """(url, the uvicorn server, its log records)."""
    om = offload(SHIPPED_MODEL, capacity="50%", predictor="ondemand")
    records = Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "stmoe.serve")]
    try:
        thread = ServerThread(Service(om, NAME, max_batch=2, max_queue=2),
                              request_timeout=TIMEOUT)
        with thread as url:
            for lg in loggers:
                lg.addHandler(records)
            yield url, thread.server, records
    finally:
        for lg in loggers:
            lg.removeHandler(records)
        om.close()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=CEILING)


def _head(length: int | None = None, chunked: bool = False) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", "Host: test", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer(s: socket.socket) -> tuple[int, dict, float]:
    """Everything until the server closes: (status, JSON body, seconds it took)."""
    start, data = time.monotonic(), b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), time.monotonic() - start


def _still_serves(url: str) -> None:
    code, answer = post(url + "/v1/completions", GOOD)
    assert code == 200, answer


def test_a_content_length_over_the_limit_is_refused_before_its_body(hostile):
    url, _, _ = hostile
    with _connect(url) as s:
        s.sendall(_head(10**12))  # and not one byte of the body
        status, answer, _ = _answer(s)
    assert status == 413 and "over the" in answer["error"]["message"]
    _still_serves(url)


def test_a_chunked_body_is_cut_off_at_the_limit(hostile):
    """The client sends a little more than the limit and then waits: the server answers
    from what it has read, it does not wait for the rest."""
    url, _, _ = hostile
    piece = b"x" * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    with _connect(url) as s:
        s.sendall(_head(chunked=True))
        for _ in range(MAX_BODY // len(piece)):
            s.sendall(chunk)
        s.sendall(b"1\r\nx\r\n")  # one byte over; all of it read (no reset), never ended
        status, answer, _ = _answer(s)
    assert status == 413 and "over the" in answer["error"]["message"]
    _still_serves(url)


@pytest.mark.parametrize("partial", ["headers", "body"])
def test_a_request_that_does_not_arrive_whole_times_out(hostile, partial):
    url, _, _ = hostile
    with _connect(url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: te" if partial == "headers"
                  else _head(100) + b'{"model"')
        status, answer, took = _answer(s)
    assert status == 408 and "did not arrive whole" in answer["error"]["message"]
    assert took >= TIMEOUT * 0.5  # the deadline, not at once
    _still_serves(url)


def test_slowloris_connections_are_closed_even_while_bytes_trickle_in(hostile):
    """Twenty connections at once, each sending its body a byte at a time, never done:
    every one is closed at the deadline (answered 408)."""
    url, _, _ = hostile
    sockets = [_connect(url) for _ in range(20)]
    closed = threading.Event()

    def trickle() -> None:
        while not closed.is_set():
            for s in sockets:
                with contextlib.suppress(OSError):  # closed by the server: as wanted
                    s.sendall(b" ")
            closed.wait(0.1)

    for s in sockets:
        s.sendall(_head(10**6) + b"{")
    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        statuses = [_closed(s) for s in sockets]
    finally:
        closed.set()
        sender.join()
        for s in sockets:
            s.close()
    assert set(statuses) <= {408, "reset"} and 408 in statuses, statuses
    _still_serves(url)


def _closed(s: socket.socket) -> int | str:
    """The status the server answered before closing, or "reset" where a byte the client
    sent after the close made the server's side reset the connection (which may drop the
    answer unread); a connection left open fails at the socket's timeout."""
    try:
        return _answer(s)[0]
    except ConnectionResetError:
        return "reset"


def test_a_client_gone_mid_body_leaves_no_traceback(hostile):
    url, server, records = hostile
    before = len(records.failures())
    for _ in range(3):
        with _connect(url) as s:
            s.sendall(_head(1000) + b'{"model": "tiny-')
            time.sleep(0.05)  # let the app start reading (not a margin: either way passes)
    state = server.server_state
    until(lambda: not state.tasks and not state.connections, "done with the connections")
    _still_serves(url)
    assert records.failures()[before:] == []
