"""How long `baton serve` takes to stop under load: a streaming chat request without max_tokens (it would run to
the context length) and a second one queued behind it, then SIGTERM (and optionally a second signal).

    python benchmarks/bench_shutdown.py [--shutdown-timeout 5] [--second-signal-after S] [-- SERVE ARGS...]

Prints one JSON line: seconds from SIGTERM to the stream's end and to the process's exit, the exit code, whether
the stream ended with an error chunk and [DONE], the queued request's status, and whether stderr had a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shutdown-timeout", type=float, default=5.0)
    p.add_argument("--second-signal-after", type=float, default=None, metavar="S",
                   help="send SIGINT this many seconds after the SIGTERM")
    p.add_argument("--tokens-before-signal", type=int, default=10)
    p.add_argument("serve_args", nargs="*", help="more `baton serve` flags (after --)")
    ns = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton", "serve", "--port", str(port), "--shutdown-timeout",
         str(ns.shutdown_timeout), *ns.serve_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    if not line.startswith("baton ready:"):
        print(proc.stderr.read(), file=sys.stderr)
        return 1
    queued: dict = {}

    def queue_one() -> None:
        r = httpx.post(url + "/v1/chat/completions", timeout=600,
                       json={"messages": [{"role": "user", "content": "And another story."}]})
        queued["status"] = r.status_code

    events: list = []
    sent = stream_end = None
    body = {"messages": [{"role": "user", "content": "Write a long story about a robot who learns to paint."}],
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for raw in r.iter_lines():
            if not raw.startswith("data: "):
                continue
            data = raw[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 2:
                threading.Thread(target=queue_one, daemon=True).start()
            if len(events) == ns.tokens_before_signal:
                sent = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                if ns.second_signal_after is not None:
                    threading.Timer(ns.second_signal_after, proc.send_signal, (signal.SIGINT,)).start()
        stream_end = time.monotonic()
    _, err = proc.communicate(timeout=600)
    exited = time.monotonic()
    time.sleep(0.5)
    last_error = events[-2].get("error", {}).get("message") if len(events) >= 2 and events[-2] != "[DONE]" else None
    print(json.dumps({
        "shutdown_timeout_s": ns.shutdown_timeout, "second_signal_after_s": ns.second_signal_after,
        "stream_end_after_sigterm_s": round(stream_end - sent, 3), "exit_after_sigterm_s": round(exited - sent, 3),
        "exit_code": proc.returncode, "stream_ended_with_done": events[-1] == "[DONE]", "final_error": last_error,
        "queued_request_status": queued.get("status"), "traceback_in_stderr": "Traceback" in err,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
