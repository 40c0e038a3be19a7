"""Connection limits: a connection that sends nothing, or trickles its request head or body, is closed after
``--read-timeout``; the server answers normal requests meanwhile, also beside 200 such connections; a client that
leaves mid-body costs one log line and no traceback."""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from fake_engine import FakeEngine, expected_text

READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def timed_server(server_factory):
    return server_factory(lambda args: FakeEngine(), read_timeout=READ_TIMEOUT, timeout_keep_alive=30.0)


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed ``sock`` within ``seconds``, and what it sent before closing."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    received = b""
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, received
        if not data:
            return True, received
        received += data
    return False, received


def _ok(url: str) -> None:
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=5)
    assert r.status_code == 200 and r.json()["text"] == expected_text("hi", 3)


def test_silent_connection_is_closed(timed_server) -> None:
    sock = _connect(timed_server.url)
    try:
        closed, data = _closed_within(sock, READ_TIMEOUT + 3)
        assert closed and data == b""
    finally:
        sock.close()


def test_trickled_request_head_is_closed(timed_server) -> None:
    """One header byte every 0.2 s would keep a connection open forever without a deadline on the whole head."""
    sock = _connect(timed_server.url)
    head = b"POST /generate HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100
    start = time.monotonic()
    try:
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            if _closed_within(sock, 0.2)[0]:
                break
        elapsed = time.monotonic() - start
        assert elapsed < READ_TIMEOUT + 2, f"still open after {elapsed:.1f} s"
    finally:
        sock.close()


def test_trickled_body_gets_408_and_is_closed(timed_server) -> None:
    sock = _connect(timed_server.url)
    try:
        sock.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 200\r\n\r\n{\"text\": ")
        closed, data = _closed_within(sock, READ_TIMEOUT + 3)
        assert closed
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b'"code": 408' in data and b"read-timeout" not in data.split(b"\r\n\r\n")[0]
    finally:
        sock.close()


def test_keep_alive_connection_stays_open_between_requests(timed_server) -> None:
    """The head deadline starts at a request's first byte: an idle kept-alive connection lives until
    --timeout-keep-alive, longer than --read-timeout."""
    with httpx.Client(base_url=timed_server.url, timeout=5) as client:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        first = client.post("/generate", json=body)
        time.sleep(READ_TIMEOUT + 0.5)
        second = client.post("/generate", json=body)
        assert first.status_code == second.status_code == 200
        assert second.extensions["network_stream"] is not None
        # the same connection served both (httpx would reconnect silently otherwise: compare the local ports)
        assert first.extensions["network_stream"].get_extra_info("client_addr") == (
            second.extensions["network_stream"].get_extra_info("client_addr"))


def test_responsive_beside_200_idle_connections(timed_server) -> None:
    socks = []
    try:
        for i in range(200):
            sock = _connect(timed_server.url)
            if i % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost")  # half of them start a head and stop
            socks.append(sock)
        start = time.monotonic()
        _ok(timed_server.url)
        assert time.monotonic() - start < 2.0
        time.sleep(READ_TIMEOUT + 1.0)
        still_open = sum(not _closed_within(s, 0.05)[0] for s in socks)
        assert still_open == 0, f"{still_open} of 200 connections still open after the read timeout"
        _ok(timed_server.url)
    finally:
        for sock in socks:
            sock.close()


def test_disconnect_mid_body_logs_one_line(timed_server, caplog) -> None:
    caplog.set_level(logging.INFO)
    sock = _connect(timed_server.url)
    sock.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 500\r\n\r\n{\"text\": \"abc")
    time.sleep(0.3)
    sock.close()
    time.sleep(0.5)
    _ok(timed_server.url)
    records = [r for r in caplog.records if r.name.startswith(("baton", "uvicorn"))]
    assert not [r for r in records if r.exc_info or r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    lines = [r.getMessage() for r in records if "disconnected while sending the request body" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in records]
