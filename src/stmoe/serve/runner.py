"""Running the app: uvicorn in the foreground (``stmoe serve``) or on a thread (tests,
benchmarks, a notebook), the service closed when it stops.

uvicorn times out an idle keep-alive connection, but not a request that arrives
slowly: a client that sends half its headers, or a body a byte at a time, holds its
connection for as long as it likes (slowloris). ``DeadlineH11`` gives every request a
deadline to arrive whole, headers and body, from its first byte (or the connection's
opening): past it the client gets a 408 and the connection is closed, whatever the
app is doing.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from stmoe.errors import OffloadError, StmoeError
from stmoe.serve.app import BODY_TIMEOUT, QuietErrors, create_app
from stmoe.serve.protocol import ApiError
from stmoe.serve.service import Service

REQUEST_TIMEOUT = BODY_TIMEOUT  # seconds for a request to arrive whole, headers and body
ARRIVING = (h11.IDLE, h11.SEND_BODY)  # the client's states while its request is incomplete


def _timeout_response(seconds: float) -> bytes:
    """A 408 with the OpenAI error object, written as raw bytes: the request may not even
    have its headers yet, so h11 has no request to answer."""
    body = json.dumps(ApiError(408, f"the request did not arrive whole within {seconds:g} s")
                      .body()).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's arrival (module docstring).
    Armed when a connection opens and when a request's first byte comes; disarmed once the
    request is whole."""

    request_timeout = REQUEST_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request on a kept-alive connection begins
        super().data_received(data)
        if self.conn.their_state not in ARRIVING:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(self.request_timeout, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.transport.is_closing() or self.conn.their_state not in ARRIVING:
            return
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # nothing answered yet
            self.transport.write(_timeout_response(self.request_timeout))
        self.transport.close()


def _server(service: Service, host: str, port: int, log_level: str,
            request_timeout: float = REQUEST_TIMEOUT) -> Any:
    import uvicorn

    protocol = type("DeadlineH11", (DeadlineH11,), {"request_timeout": request_timeout})
    app = QuietErrors(create_app(service, body_timeout=request_timeout))
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=log_level in ("info", "debug"), lifespan="off",
                            http=protocol)
    return uvicorn.Server(config)


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use (or an address not
    this machine's) fails in a second with one clear line, not after minutes of loading,
    and no "serving" line is printed for a port the server never gets."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise StmoeError(f"--host {host}: not an address to listen on ({exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn's own)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = ("the port is in use; stop what listens there or pick another --port"
               if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc))
        raise StmoeError(f"--host {host} --port {port}: cannot listen there: {why}") from None
    return sock


def serve_forever(service: Service, sock: socket.socket, log_level: str = "info") -> None:
    """Serve on ``sock`` (``listening_socket``) until interrupted (Ctrl-C), then close the
    service."""
    host, port = sock.getsockname()[:2]
    try:
        _server(service, host, port, log_level).run(sockets=[sock])
    finally:
        service.close()


class ServerThread:
    """The server on a background thread of this process, on a free port by default.

        with ServerThread(service) as url:   # http://127.0.0.1:PORT
            ...
    """

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0,
                 request_timeout: float = REQUEST_TIMEOUT) -> None:
        self.service, self.host = service, host
        self.port = port or free_port(host)
        self.server = _server(service, host, self.port, "warning", request_timeout)
        self.thread = threading.Thread(target=self.server.run, name="stmoe-serve", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 120  # a ceiling for a hang, not a margin
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OffloadError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.service.close()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
