"""``run_server``: uvicorn on the configured host and port, one ready line on stdout, clean shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent

SCRIPT = """
import sys
sys.path.insert(0, {here!r})
from fake_engine import FakeEngine
from baton.config import ServerArgs
from baton.server.app import run_server
run_server(ServerArgs(port={port}, log_level="info"), lambda args: FakeEngine())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_server_prints_one_ready_line() -> None:
    port = _free_port()
    code = SCRIPT.format(here=str(HERE), port=port)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=HERE.parent.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert line == f"baton ready: http://127.0.0.1:{port} (model fake-model, spec off)\n", (
            proc.stderr.read()
        )
        r = httpx.post(
            f"http://127.0.0.1:{port}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert out == "", "only the ready line goes to stdout"


def _serve_then_terminate(args: list[str], timeout_s: float = 120) -> tuple[int, str]:
    """``baton serve ARGS`` until its ready line, one request, then SIGTERM (what a supervisor or `kill` sends)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton", "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("baton ready:"), proc.stderr.read() if proc.poll() is not None else line
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, err


def test_sigterm_stops_a_tp2_server_cleanly(ling_path) -> None:
    """At TP 2, SIGTERM (after uvicorn's graceful shutdown) must still tell rank 1 to stop: before, the re-raised
    signal ended rank 0 on the spot and rank 1 died on a closed connection with a traceback."""
    rc, err = _serve_then_terminate(["--model-path", ling_path, "--tp-size", "2", "--disable-cuda-graph"])
    assert rc == 0, err
    assert "Traceback" not in err, err


def test_sigterm_mid_request_at_tp2_ends_the_stream_and_exits_cleanly(ling_path) -> None:
    """Bounded shutdown under tensor parallelism: the running request is aborted after --shutdown-timeout (its
    stream ends with an error chunk and [DONE]), then rank 0 tells rank 1 to stop and both exit."""
    import json
    import time

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton", "serve", "--model-path", ling_path, "--tp-size", "2", "--disable-cuda-graph",
         "--shutdown-timeout", "1", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    events = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("baton ready:"), proc.stderr.read() if proc.poll() is not None else line
        body = {"input_ids": [1, 2, 3], "stream": True,
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/generate", json=body, timeout=120) as r:
            for raw in r.iter_lines():
                if not raw.startswith("data: "):
                    continue
                data = raw[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 3:
                    sent = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"], events[-3:]
    assert exited - sent < 60, f"{exited - sent:.0f} s from SIGTERM to exit"
