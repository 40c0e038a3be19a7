"""Speculation sweeps (``baton sweep``): the serving benchmark over a grid of NEXTN depths or DSpark gammas.

For each configuration (NEXTN ``--steps s``: ``s`` steps and ``s + 1`` draft tokens; DSpark ``--gamma g``:
``g + 1`` draft tokens) a baton server is started (a ``baton serve`` subprocess on a free port, or with
``--in-process`` an engine and uvicorn thread in this process), waited for on ``/v1/models``, benchmarked
with ``run_benchmark`` and stopped. Against an already-running server (``--base-url``/``--port``) the sweep
measures that server's single configuration.

The table is the seed write-up's: accept length, mean TPOT, the derived step time (mean TPOT x accept
length: a product of two aggregates, an estimate rather than a measurement) and the steady-state rate
1000 / TPOT; the best configuration is the one with the lowest mean TPOT. One JSONL line per configuration
goes to ``--output-file``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

_READY_POLL_S = 0.5
_STOP_TIMEOUT_S = 30.0
_LOG_TAIL_CHARS = 3000


class SweepError(RuntimeError):
    """A sweep that cannot run, or a server that would not start; the message says why."""


@dataclass(frozen=True)
class SweepConfig:
    """One point of the grid, as SGLang's speculative flags."""

    algorithm: str
    num_steps: int | None = None
    num_draft_tokens: int | None = None

    @property
    def label(self) -> str:
        if self.algorithm == "NEXTN":
            return f"{self.num_steps} / {self.num_draft_tokens}"
        return f"gamma {self.gamma}"

    @property
    def gamma(self) -> int | None:
        return None if self.num_draft_tokens is None else self.num_draft_tokens - 1

    def flags(self, with_algorithm: bool = True) -> list[str]:
        flags = ["--speculative-algorithm", self.algorithm] if with_algorithm else []
        if self.num_steps is not None:
            flags += ["--speculative-num-steps", str(self.num_steps)]
        if self.num_draft_tokens is not None:
            flags += ["--speculative-num-draft-tokens", str(self.num_draft_tokens)]
        return flags

    def apply(self, server_args: Any) -> Any:
        """``server_args`` (a ServerArgs) with this configuration's speculative settings."""
        from baton.speculative.shipped import is_shipped, with_shipped_drafts

        spec = server_args.spec
        if server_args.is_embedded and is_shipped(spec.draft_model_path):  # the default draft: re-pick per kind
            spec = dataclasses.replace(spec, draft_model_path=None, dspark_confidence_sts_path=None)
        spec = dataclasses.replace(spec, algorithm=self.algorithm, num_steps=self.num_steps,
                                   num_draft_tokens=self.num_draft_tokens, adaptive=False)  # each point: its depth
        if server_args.is_embedded and spec.draft_model_path is None and self.algorithm is not None:
            spec = with_shipped_drafts(spec, True, self.algorithm)
        return dataclasses.replace(server_args, spec=spec)


def nextn_configs(steps: Sequence[int]) -> list[SweepConfig]:
    return [SweepConfig("NEXTN", s, s + 1) for s in steps]


def dspark_configs(gammas: Sequence[int], algorithm: str = "DSPARK") -> list[SweepConfig]:
    return [SweepConfig(algorithm, None, g + 1) for g in gammas]


# ---- launching servers ----
class Launcher(Protocol):
    def launch(self, config: SweepConfig | None) -> contextlib.AbstractContextManager[str]:
        """Serve ``config`` and yield the base URL; stop the server on exit."""
        ...


class ExistingServer:
    """A server someone else started: one configuration, never stopped here."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    @contextlib.contextmanager
    def launch(self, config: SweepConfig | None) -> Iterator[str]:
        yield self.base_url


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_until_serving(base_url: str, timeout_s: float, alive: Callable[[], str | None] = lambda: None) -> None:
    """Poll ``GET /v1/models`` until 200; ``alive()`` returns a reason when the server is already gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if (reason := alive()) is not None:
            raise SweepError(reason)
        if time.monotonic() > deadline:
            raise SweepError(f"{base_url} did not answer /v1/models within {timeout_s:.0f} s")
        time.sleep(_READY_POLL_S)


class SubprocessLauncher:
    """``baton serve <server_args> <config flags>`` in its own process group; its log goes to a temp file
    whose tail is shown when it fails to start."""

    def __init__(self, server_args: Sequence[str], host: str = "127.0.0.1", timeout_s: float = 900.0) -> None:
        self.server_args = list(server_args)
        self.host = host
        self.timeout_s = timeout_s

    def command(self, config: SweepConfig | None, port: int) -> list[str]:
        flags = []
        if config is not None:
            flags = config.flags(with_algorithm="--speculative-algorithm" not in self.server_args)
        return [sys.executable, "-m", "baton.cli", "serve", *self.server_args, *flags,
                "--host", self.host, "--port", str(port)]

    @contextlib.contextmanager
    def launch(self, config: SweepConfig | None) -> Iterator[str]:
        port = free_port(self.host)
        cmd = self.command(config, port)
        with tempfile.NamedTemporaryFile("w+", prefix="baton-sweep-", suffix=".log", delete=False) as log:
            print(f"launching: {shlex.join(cmd)}  (log {log.name})", flush=True)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                url = f"http://{self.host}:{port}"
                wait_until_serving(url, self.timeout_s, lambda: _exited(proc))
                yield url
            except SweepError as e:
                raise SweepError(f"{e}\n--- server log tail ({log.name}) ---\n{_tail(log.name)}") from None
            finally:
                _stop(proc)
        os.unlink(log.name)


def _exited(proc: subprocess.Popen) -> str | None:
    code = proc.poll()
    return None if code is None else f"the server exited with status {code} before it was ready"


def _tail(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-_LOG_TAIL_CHARS:]


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful shutdown) to the server's own process group, SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class InProcessLauncher:
    """Build the engine here and serve it with uvicorn on a thread (no process start-up; for small models
    and tests). ``engine_factory(server_args)`` defaults to ``Engine``."""

    def __init__(self, server_args: Any, engine_factory: Callable[[Any], Any] | None = None,
                 timeout_s: float = 60.0) -> None:
        self.server_args = server_args
        self.engine_factory = engine_factory
        self.timeout_s = timeout_s

    @contextlib.contextmanager
    def launch(self, config: SweepConfig | None) -> Iterator[str]:
        import uvicorn

        from baton.server.app import create_app

        args = config.apply(self.server_args) if config is not None else self.server_args
        factory = self.engine_factory
        if factory is None:
            from baton.engine.engine import Engine as factory
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((args.host, 0))
        args = dataclasses.replace(args, port=sock.getsockname()[1])
        try:
            engine = factory(args)
        except BaseException:
            sock.close()
            raise
        server = uvicorn.Server(uvicorn.Config(create_app(engine, args), log_level="warning",
                                               timeout_graceful_shutdown=2))
        del engine  # the app holds it; dropping the server below frees it
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            url = f"http://{args.host}:{args.port}"
            wait_until_serving(url, self.timeout_s, lambda: None if thread.is_alive() else "the server thread died")
            yield url
        finally:
            server.should_exit = True
            thread.join(_STOP_TIMEOUT_S)
            sock.close()
            del server
            gc.collect()


# ---- running and reporting ----
@dataclass
class SweepRow:
    label: str
    config: SweepConfig | None
    record: dict[str, Any] | None = None
    error: str | None = None

    @property
    def accept_length(self) -> float | None:
        return (self.record or {}).get("accept_length")

    @property
    def mean_tpot_ms(self) -> float | None:
        return (self.record or {}).get("mean_tpot_ms")

    @property
    def step_time_ms(self) -> float | None:
        """Mean TPOT x accept length (plain decoding: one token per step)."""
        if not self.mean_tpot_ms:
            return None
        return self.mean_tpot_ms * (self.accept_length or 1.0)

    @property
    def steady_state_tok_s(self) -> float | None:
        return 1000.0 / self.mean_tpot_ms if self.mean_tpot_ms else None

    def to_json(self, is_best: bool) -> dict[str, Any]:
        cfg = self.config
        record = {k: v for k, v in (self.record or {}).items()
                  if k not in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")}
        return {"config": self.label, "speculative_algorithm": cfg.algorithm if cfg else None,
                "speculative_num_steps": cfg.num_steps if cfg else None,
                "speculative_num_draft_tokens": cfg.num_draft_tokens if cfg else None,
                "gamma": cfg.gamma if cfg and cfg.algorithm != "NEXTN" else None,
                "accept_length": self.accept_length, "mean_tpot_ms": self.mean_tpot_ms,
                "median_tpot_ms": record.get("median_tpot_ms"), "step_time_ms": self.step_time_ms,
                "steady_state_tok_s": self.steady_state_tok_s, "output_throughput": record.get("output_throughput"),
                "best": is_best, "error": self.error, "bench": record or None}


@dataclass
class SweepResult:
    rows: list[SweepRow]

    @property
    def best(self) -> SweepRow | None:
        done = [r for r in self.rows if r.mean_tpot_ms]
        return min(done, key=lambda r: r.mean_tpot_ms) if done else None

    @property
    def failed(self) -> list[SweepRow]:
        return [r for r in self.rows if r.error is not None]


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(result: SweepResult) -> str:
    """The seed's table, one row per configuration, then the best one."""
    lines = ["| config | accept length | mean TPOT (ms) | step time (ms, derived) | steady-state tok/s |",
             "|---|---|---|---|---|"]
    for r in result.rows:
        if r.error is not None:
            lines.append(f"| {r.label} | failed: {r.error.splitlines()[0][:60]} | | | |")
            continue
        lines.append(f"| {r.label} | {_num(r.accept_length, '.2f')} | {_num(r.mean_tpot_ms, '.3f')} | "
                     f"{_num(r.step_time_ms, '.3f')} | {_num(r.steady_state_tok_s, '.0f')} |")
    best = result.best
    if best is not None:
        lines.append(f"best: {best.label} (lowest mean TPOT, {best.mean_tpot_ms:.3f} ms)")
    return "\n".join(lines)


def _label_from_server(base_url: str) -> tuple[str, SweepConfig | None]:
    try:
        info = httpx.get(f"{base_url}/server_info", timeout=30.0).json()
    except (httpx.HTTPError, ValueError):
        return base_url, None
    algorithm = info.get("speculative_algorithm")
    if not algorithm:
        return "plain", None
    cfg = SweepConfig(algorithm, info.get("speculative_num_steps"), info.get("speculative_num_draft_tokens"))
    return cfg.label, cfg


def load_tokenizer_or_ids(path: str | None) -> Any:
    """The bench's tokenizer; for a model directory without tokenizer files (random or dummy weights), the
    token-ids-as-text tokenizer its server falls back to."""
    from baton.bench import serving

    try:
        return serving.load_bench_tokenizer(path)
    except Exception as e:
        config_path = os.path.join(path or "", "config.json")
        if not os.path.isfile(config_path):
            raise
        from baton.tokenizer import IdTokenizer

        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        eos = config.get("eos_token_id")
        print(f"no tokenizer at {path} ({type(e).__name__}); sending token ids as text, as its server reads them")
        return IdTokenizer(int(config["vocab_size"]), eos[0] if isinstance(eos, list) else eos)


def _bench_once(url: str, bench_args: argparse.Namespace, tokenizer_loader: Any) -> dict[str, Any]:
    from baton.bench.serving import run_benchmark

    args = argparse.Namespace(**(vars(bench_args) | {"base_url": url, "output_file": os.devnull}))
    return run_benchmark(args, tokenizer_loader or load_tokenizer_or_ids)


def run_sweep(
    configs: Sequence[SweepConfig | None],
    bench_args: argparse.Namespace,
    launcher: Launcher,
    output_file: str | None = None,
    tokenizer_loader: Any = None,
    out: Any = None,
) -> SweepResult:
    """Benchmark each configuration on a server from ``launcher`` (``None``: whatever it serves); a config
    whose server fails is reported and skipped. Appends one JSONL line per config to ``output_file`` and
    prints the table to ``out`` (stdout by default)."""
    rows = []
    for config in configs:
        row = SweepRow(config.label if config else "?", config)
        print(f"\n=== sweep: {row.label} ===", flush=True)
        try:
            with launcher.launch(config) as url:
                if config is None:
                    row.label, row.config = _label_from_server(url)
                row.record = _bench_once(url, bench_args, tokenizer_loader)
        except Exception as e:  # one failed config must not lose the others' results
            row.error = f"{type(e).__name__}: {e}"
            print(f"sweep: {row.label} failed: {row.error}", file=sys.stderr)
        rows.append(row)
    result = SweepResult(rows)
    _write_jsonl(result, output_file)
    print("\n" + format_table(result), file=out or sys.stdout, flush=True)
    return result


def _write_jsonl(result: SweepResult, path: str | None) -> None:
    if not path:
        return
    best = result.best
    with open(path, "a", encoding="utf-8") as f:
        for row in result.rows:
            f.write(json.dumps(row.to_json(row is best), default=str) + "\n")


# ---- command line ----
def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _configs(ns: argparse.Namespace) -> list[SweepConfig | None]:
    if ns.steps:
        return list(nextn_configs(ns.steps))
    if ns.gamma:
        return list(dspark_configs(ns.gamma, ns.dspark_algorithm))
    return [None]


def _launcher(ns: argparse.Namespace, configs: list[SweepConfig | None]) -> Launcher:
    if ns.base_url or ns.port:
        if len(configs) > 1:
            raise SweepError("a running server serves one configuration; drop --base-url/--port to launch one "
                             "server per configuration")
        from baton.bench.serving import resolve_base_url

        return ExistingServer(resolve_base_url(ns))
    if configs == [None]:
        raise SweepError("give --steps or --gamma (servers launched per config), or --base-url of a running server")
    if ns.in_process:
        return InProcessLauncher(_parse_server_args(ns.server_args or "", ns.host), timeout_s=ns.server_timeout)
    return SubprocessLauncher(shlex.split(ns.server_args or ""), ns.host, ns.server_timeout)


def _parse_server_args(text: str, host: str) -> Any:
    from baton.args import add_engine_args, add_server_args, server_args_from

    parser = argparse.ArgumentParser(prog="--server-args", add_help=False)
    add_engine_args(parser)
    add_server_args(parser)
    return dataclasses.replace(server_args_from(parser.parse_args(shlex.split(text))), host=host)


def add_sweep_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from baton.bench.serving import add_bench_args

    g = p.add_argument_group("grid")
    grid = g.add_mutually_exclusive_group()
    grid.add_argument("--steps", type=parse_int_list, default=None, metavar="S,S,...",
                      help="NEXTN steps; each config uses steps + 1 draft tokens (e.g. 1,2,3,4,5)")
    grid.add_argument("--gamma", type=parse_int_list, default=None, metavar="G,G,...",
                      help="DSpark gammas; each config uses gamma + 1 draft tokens (e.g. 4,8,16)")
    g.add_argument("--dspark-algorithm", default="DSPARK", choices=["DSPARK", "DFLASH"],
                   help="algorithm for --gamma when --server-args does not name one")
    s = p.add_argument_group("launched servers")
    s.add_argument("--server-args", default=None, metavar="FLAGS",
                   help="`baton serve` flags shared by every config, as one string, e.g. \"--model-path M "
                        "--speculative-draft-model-path D\"; the grid's flags are appended")
    s.add_argument("--in-process", action="store_true",
                   help="serve each config from an engine in this process instead of a `baton serve` subprocess")
    s.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for a server to be ready")
    b = p.add_argument_group("benchmark (baton bench flags; --base-url/--port: measure that running server)")
    add_bench_args(b)
    p.add_argument("--no-flush-cache", dest="flush_cache", action="store_false",
                   help="keep warmup requests in the server's accept length")
    p.set_defaults(max_concurrency=1, flush_cache=True)
    return p


def main(ns: argparse.Namespace) -> int:
    try:
        configs = _configs(ns)
        result = run_sweep(configs, ns, _launcher(ns, configs), ns.output_file)
    except SweepError as e:
        print(f"baton sweep: error: {e}", file=sys.stderr)
        return 2
    return 1 if result.failed else 0


def add_sweep_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sweep", help="benchmark a grid of NEXTN steps or DSpark gammas",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__ + "\nExamples:\n"
        "  baton sweep --steps 3,4,5 --server-args \"--model-path M --speculative-draft-model-path D\" \\\n"
        "      --dataset-name random --random-input-len 8192 --random-output-len 1024 --random-range-ratio 1 \\\n"
        "      --num-prompts 50 --output-file sweep.jsonl\n"
        "  baton sweep --base-url http://127.0.0.1:30000 --num-prompts 50   # the running server's config\n\n"
        "The benchmark defaults to --max-concurrency 1 and --flush-cache (accept length without warmup).")
    add_sweep_args(p)
    p.set_defaults(func=main)
