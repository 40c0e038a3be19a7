"""Bounded shutdown of ``run_server`` (a real process, real signals): SIGTERM stops accepting, running requests get
``--shutdown-timeout`` seconds, then queued requests get a 503 and a running stream a final error chunk and
``[DONE]``; a second signal aborts at once; the process exits 0 with no traceback in every case."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent

SCRIPT = """
import sys
sys.path.insert(0, {here!r})
from fake_engine import FakeEngine
from baton.config import ServerArgs
from baton.server.app import run_server
run_server(ServerArgs(port={port}, log_level="info", shutdown_timeout={grace}),
           lambda args: FakeEngine(step_delay={step_delay}, context_length=4096))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, grace: float, step_delay: float = 0.02) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = SCRIPT.format(here=str(HERE), port=self.port, grace=grace, step_delay=step_delay)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=HERE.parent.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = self.proc.stdout.readline()
        assert line.startswith("baton ready:"), self.proc.stderr.read() if self.proc.poll() is not None else line

    def signal(self, sig: int) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()

    def wait(self, timeout: float = 30) -> tuple[int, str, float]:
        """(exit code, stderr, the time it exited)."""
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err, time.monotonic()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture()
def make_server():
    servers: list[Server] = []

    def make(**kwargs) -> Server:
        servers.append(Server(**kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.kill()


class Stream(threading.Thread):
    """A streaming /v1/completions request in a thread; ``events`` are its SSE payloads, ``first`` is set at the
    first one."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list = []
        self.first = threading.Event()
        self.status: int | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        body = {"model": "fake-model", "prompt": "tell me", "max_tokens": self.max_tokens, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.first.set()
        self.ended_at = time.monotonic()


class Plain(threading.Thread):
    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.response: httpx.Response | None = None

    def run(self) -> None:
        body = {"text": "queued", "sampling_params": {"max_new_tokens": self.max_tokens}}
        self.response = httpx.post(self.url + "/generate", json=body, timeout=60)


def _wait_queued(url: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(url + "/metrics", timeout=5).text
        if f"baton:num_queue_reqs {float(count)!r}" in metrics:
            return
        time.sleep(0.02)
    raise AssertionError("the request was never queued")


def _assert_clean(rc: int, err: str) -> None:
    assert rc == 0, err
    assert "Traceback" not in err, err


def test_sigterm_aborts_after_the_grace_period(make_server) -> None:
    server = make_server(grace=1.0)
    stream = Stream(server.url, max_tokens=2000)  # 40 s of tokens at 20 ms a step
    stream.start()
    assert stream.first.wait(10)
    queued = Plain(server.url, max_tokens=5)
    queued.start()
    _wait_queued(server.url, 1)
    sent = server.signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(server.url + "/health", timeout=2)
    rc, err, exited = server.wait()
    stream.join(10)
    queued.join(10)
    _assert_clean(rc, err)
    assert stream.status == 200 and stream.events[-1] == "[DONE]"
    assert "shutting down" in stream.events[-2]["error"]["message"], stream.events[-3:]
    assert all("error" not in e for e in stream.events[:-2])
    assert queued.response.status_code == 503, queued.response.text
    assert "shutting down" in queued.response.json()["error"]["message"]
    assert 0.9 < stream.ended_at - sent < 4.0, stream.ended_at - sent
    assert exited - sent < 6.0, f"shutdown took {exited - sent:.1f} s"


def test_sigterm_lets_a_request_finish_within_the_grace_period(make_server) -> None:
    server = make_server(grace=20.0)
    stream = Stream(server.url, max_tokens=50)  # about 1 s
    stream.start()
    assert stream.first.wait(10)
    sent = server.signal(signal.SIGTERM)
    rc, err, exited = server.wait()
    stream.join(10)
    _assert_clean(rc, err)
    assert stream.events[-1] == "[DONE]"
    assert stream.events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in stream.events[:-1])
    assert len(text) == 50
    assert exited - sent < 10.0, "an idle server must not wait out the grace period"


def test_second_signal_aborts_at_once(make_server) -> None:
    server = make_server(grace=60.0)
    stream = Stream(server.url, max_tokens=2000)
    stream.start()
    assert stream.first.wait(10)
    server.signal(signal.SIGTERM)
    time.sleep(0.5)
    sent = server.signal(signal.SIGINT)
    rc, err, exited = server.wait()
    stream.join(10)
    _assert_clean(rc, err)
    assert stream.events[-1] == "[DONE]" and "shutting down" in stream.events[-2]["error"]["message"]
    assert "second signal" in stream.events[-2]["error"]["message"]
    assert exited - sent < 5.0, f"{exited - sent:.1f} s after the second signal"


def test_sigterm_on_an_idle_server_exits_at_once(make_server) -> None:
    server = make_server(grace=30.0)
    sent = server.signal(signal.SIGTERM)
    rc, err, exited = server.wait()
    _assert_clean(rc, err)
    assert exited - sent < 3.0
