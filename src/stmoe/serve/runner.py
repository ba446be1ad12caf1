"""Running the app: uvicorn in the foreground (``stmoe serve``) or on a thread (tests,
benchmarks, a notebook), the service closed when it stops."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from stmoe.errors import OffloadError
from stmoe.serve.app import create_app
from stmoe.serve.service import Service


def _server(service: Service, host: str, port: int, log_level: str) -> Any:
    import uvicorn

    config = uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level,
                            access_log=log_level in ("info", "debug"), lifespan="off")
    return uvicorn.Server(config)


def serve_forever(service: Service, host: str = "127.0.0.1", port: int = 8000,
                  log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C), then close the service."""
    try:
        _server(service, host, port, log_level).run()
    finally:
        service.close()


class ServerThread:
    """The server on a background thread of this process, on a free port by default.

        with ServerThread(service) as url:   # http://127.0.0.1:PORT
            ...
    """

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0) -> None:
        self.service, self.host = service, host
        self.port = port or free_port(host)
        self.server = _server(service, host, self.port, "warning")
        self.thread = threading.Thread(target=self.server.run, name="stmoe-serve", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
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
