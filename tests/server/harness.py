"""Start a real uvicorn server for ``create_app(engine, server_args)`` on a loopback port, in a thread.

``start_server(engine_factory, server_args)`` builds the engine with the factory (a FakeEngine here, the
real engine in GPU tests), binds a free port itself (no race) and returns once uvicorn is serving.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from baton.config import ServerArgs
from baton.server.app import create_app, timed_http_protocol


@dataclasses.dataclass
class RunningServer:
    url: str
    engine: Any
    server_args: ServerArgs
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_server(
    engine_factory: Callable[[ServerArgs], Any], server_args: ServerArgs, timeout: float = 30.0
) -> RunningServer:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((server_args.host, 0))
    server_args = dataclasses.replace(server_args, port=sock.getsockname()[1])
    engine = engine_factory(server_args)
    config = uvicorn.Config(
        create_app(engine, server_args), log_level="warning", lifespan="on", timeout_graceful_shutdown=2,
        http=timed_http_protocol(server_args.read_timeout), timeout_keep_alive=server_args.timeout_keep_alive,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    url = f"http://{server_args.host}:{server_args.port}"
    return RunningServer(url, engine, server_args, server, thread)


def sse_payloads(lines: Any) -> list[Any]:
    """The ``data:`` payloads of an SSE stream given its lines: parsed JSON, or the string ``[DONE]``."""
    payloads: list[Any] = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: ") :]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
