"""Server test fixtures: ``server_factory(engine_factory, **server_args)`` starts a live server on loopback
(stopped when the module ends); ``fake_server`` is one shared server over a default FakeEngine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from harness import RunningServer, start_server

from baton.config import ServerArgs

ServerFactory = Callable[..., RunningServer]


@pytest.fixture(scope="module")
def server_factory() -> Iterator[ServerFactory]:
    servers: list[RunningServer] = []

    def start(engine_factory: Callable[[ServerArgs], Any], **server_args: Any) -> RunningServer:
        running = start_server(engine_factory, ServerArgs(host="127.0.0.1", port=0, **server_args))
        servers.append(running)
        return running

    yield start
    for running in servers:
        running.stop()


@pytest.fixture(scope="module")
def fake_server(server_factory: ServerFactory) -> RunningServer:
    return server_factory(lambda args: FakeEngine())


@pytest.fixture()
def http(fake_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_server.url, timeout=10.0) as client:
        yield client


@pytest.fixture()
def oai(fake_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused", max_retries=0, timeout=10.0)
