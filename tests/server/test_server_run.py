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
