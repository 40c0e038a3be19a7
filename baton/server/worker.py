"""The engine thread: one thread owns the engine and runs queued requests one at a time, in FIFO order.

Owns ``EngineWorker`` (the thread and its queue), ``Job`` (one request's handle: an asyncio queue the
thread feeds with ``loop.call_soon_threadsafe``, and an abort flag the engine polls once per step) and
``ServerMetrics`` (the request accounting the thread sees, rendered in Prometheus text format).
An exception inside ``engine.generate`` ends that request only: the thread reports it and takes the next.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from baton import env
from baton.engine.api import EngineAPI
from baton.types import Request, StepOutput

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """A request that failed inside the engine; ``status`` is 400 for ValueError, 500 otherwise."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def _is_abort(out: StepOutput) -> bool:
    return (out.finish_reason or {}).get("type") == "abort"


def _abort_output(message: str) -> StepOutput:
    return StepOutput(token_ids=[], finished=True, finish_reason={"type": "abort", "message": message})


SHUTDOWN_STATUS = 503


class Job:
    """One request in flight. Created on the event loop; fed by the engine thread."""

    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.req = req
        self.loop = loop
        self.aborted = False
        self.shutdown_message: str | None = None  # set when the server's shutdown aborted this request
        self.answered = False  # the event loop already sent this (queued) request its error
        self._outputs: asyncio.Queue[StepOutput | EngineError] = asyncio.Queue()

    def abort(self, shutdown_message: str | None = None) -> None:
        """Ask the engine to stop this request; a no-op once it has finished. With ``shutdown_message`` the
        request ends with that error (503) instead of an ``abort`` finish."""
        if shutdown_message is not None and self.shutdown_message is None:
            self.shutdown_message = shutdown_message
        self.aborted = True

    def is_aborted(self) -> bool:
        return self.aborted

    async def get(self) -> StepOutput:
        """The next StepOutput; raises EngineError when the engine failed on this request."""
        item = await self._outputs.get()
        if isinstance(item, EngineError):
            raise item
        return item

    def push(self, item: StepOutput | EngineError) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.aborted = True


class _Call:
    """A function to run on the engine thread between requests (flush_cache)."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()


def _set_future(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class EngineWorker:
    """Runs ``engine.generate`` for submitted requests on one dedicated thread, first come first served."""

    def __init__(self, engine: EngineAPI, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self._queue: queue.SimpleQueue[Job | _Call | None] = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._current: Job | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._draining: str | None = None  # the shutdown message, once the server stops taking requests
        self._lock = threading.Lock()  # _current vs. abort_all's view of which jobs are queued

    # ---- event-loop side ----
    def start(self) -> None:
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything queued or running and join the thread (at most ``timeout`` seconds: a step that
        does not end in that time is left to the daemon thread)."""
        self._stopped = True
        self.abort_all(self._draining or "server shutting down")
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s; leaving it", timeout)
            self._thread = None

    def begin_shutdown(self, message: str) -> None:
        """Stop taking requests: from now on a submitted request gets ``message`` as a 503 error. What is
        queued or running goes on until ``abort_all``."""
        self._draining = message

    @property
    def busy(self) -> bool:
        """A request is queued or running."""
        return bool(self._jobs)

    def abort_all(self, message: str) -> int:
        """Shutdown: the running request stops at its next step and ends with ``message`` (a 503 error: a
        stream's final error chunk); queued requests get it now. Returns how many were aborted."""
        with self._lock:
            jobs = list(self._jobs.values())
            current = self._current
            for job in jobs:
                job.abort(message)
                if job is not current and not job.answered:
                    job.answered = True
                    job.push(EngineError(message, SHUTDOWN_STATUS))
        return len(jobs)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return max(len(self._jobs) - self.num_running, 0)

    @property
    def num_running(self) -> int:
        return int(self._current is not None)

    def submit(self, req: Request) -> Job:
        """Queue a request; call on the event loop that will consume the job's outputs."""
        self.start()
        job = Job(req, asyncio.get_running_loop())
        if self._stopped or self._draining is not None:
            job.push(EngineError(self._draining or "server shutting down", SHUTDOWN_STATUS))
            return job
        self._jobs[req.rid] = job
        self._queue.put(job)
        return job

    def call(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on the engine thread after every request queued before it."""
        call = _Call(fn, asyncio.get_running_loop())
        if self._stopped:
            call.future.set_exception(RuntimeError("server shutting down"))
        else:
            self._queue.put(call)
        return call.future

    def abort(self, rid: str | None = None) -> int:
        """Abort one request by id, or all when ``rid`` is None; returns how many were asked to stop."""
        jobs = list(self._jobs.values()) if rid is None else [j for j in [self._jobs.get(rid)] if j]
        for job in jobs:
            job.abort()
        return len(jobs)

    # ---- engine-thread side ----
    def _run(self) -> None:
        self._pin_thread()
        while True:
            item = self._queue.get()
            if item is None:
                break
            if isinstance(item, _Call):
                self._run_call(item)
                continue
            try:
                self._run_job(item)
            finally:
                with self._lock:
                    self._current = None
                    if self._jobs.get(item.req.rid) is item:
                        del self._jobs[item.req.rid]
        for job in list(self._jobs.values()):
            if not job.answered:
                job.push(EngineError(self._draining or "server shutting down", SHUTDOWN_STATUS))

    def _pin_thread(self) -> None:
        core = env.pin_cpu_core()
        if core is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})  # on Linux, pid 0 is the calling thread

    def _run_call(self, call: _Call) -> None:
        if call.future.cancelled():
            return
        try:
            result, exc = call.fn(), None
        except Exception as e:
            logger.exception("engine call %s failed", getattr(call.fn, "__name__", call.fn))
            result, exc = None, e
        try:
            call.loop.call_soon_threadsafe(_set_future, call.future, result, exc)
        except RuntimeError:
            pass

    def _run_job(self, job: Job) -> None:
        req = job.req
        with self._lock:
            if not job.aborted:
                self._current = job
        if job.aborted:  # the client left, or the server is shutting down, while the request was queued
            if job.shutdown_message is not None:
                if not job.answered:
                    job.push(EngineError(job.shutdown_message, SHUTDOWN_STATUS))
            else:
                job.push(_abort_output("client disconnected before the request started"))
            self.metrics.observe_request(len(req.input_ids), 0, req.arrival_time, None, None, "abort")
            return
        start = time.perf_counter()
        first_token_time: float | None = None
        num_tokens = 0
        last: StepOutput | None = None
        try:
            for out in self.engine.generate(req, should_abort=job.is_aborted):
                if out.token_ids and first_token_time is None:
                    first_token_time = time.perf_counter()
                num_tokens += len(out.token_ids)
                last = out
                if out.finished and job.shutdown_message is not None and _is_abort(out):
                    # the shutdown's abort: the text so far, then the error (a stream's final error chunk)
                    job.push(dataclasses.replace(out, finished=False, finish_reason=None))
                    job.push(EngineError(job.shutdown_message, SHUTDOWN_STATUS))
                    break
                job.push(out)
                if out.finished:
                    break
        except Exception as e:
            self._fail(job, e, num_tokens, first_token_time)
            return
        if last is None or not last.finished:  # the engine ended without a finished output
            last = _abort_output("engine stopped without finishing the request")
            job.push(last)
        kind = (last.finish_reason or {}).get("type", "stop")
        self.metrics.observe_request(
            len(req.input_ids), num_tokens, req.arrival_time, start, first_token_time, kind
        )

    def _fail(self, job: Job, exc: Exception, num_tokens: int, first_token_time: float | None) -> None:
        if isinstance(exc, ValueError):
            err = EngineError(str(exc), 400)
            logger.info("request %s rejected by the engine: %s", job.req.rid, exc)
        else:
            err = EngineError(f"internal error while generating: {type(exc).__name__}: {exc}", 500)
            logger.exception("request %s failed inside the engine", job.req.rid)
        job.push(err)
        self.metrics.observe_request(
            len(job.req.input_ids), num_tokens, job.req.arrival_time, None, first_token_time, "error"
        )


_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_TPOT_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
)


class Histogram:
    """Cumulative-bucket histogram in Prometheus semantics."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines = []
        cumulative = itertools.accumulate(self.counts)
        for bound, n in zip(self.bounds + (float("inf"),), cumulative, strict=True):
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {n}')
        lines += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return lines


class ServerMetrics:
    """Counters and latency histograms updated by the engine thread; rendered for ``GET /metrics``."""

    PREFIX = "baton:"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(_LATENCY_BUCKETS)
        self.tpot = Histogram(_TPOT_BUCKETS)
        self.e2e = Histogram(_LATENCY_BUCKETS)
        self.queue_time = Histogram(_LATENCY_BUCKETS)

    def observe_request(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        arrival: float,
        start: float | None,
        first_token_time: float | None,
        finish_reason: str,
    ) -> None:
        end = time.perf_counter()
        with self._lock:
            self.requests[finish_reason] = self.requests.get(finish_reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            if start is not None:
                self.queue_time.observe(start - arrival)
                self.e2e.observe(end - arrival)
            if first_token_time is not None:
                self.ttft.observe(first_token_time - arrival)
                if completion_tokens > 1:
                    self.tpot.observe((end - first_token_time) / (completion_tokens - 1))

    def render(self, extra: list[tuple[str, str, str, float | None]]) -> str:
        """Prometheus text exposition. ``extra`` holds (name, kind, help, value) series read elsewhere
        (queue length, accept length); a None value leaves the family without a sample."""
        p = self.PREFIX
        out: list[str] = []
        with self._lock:
            _family(
                out,
                f"{p}num_requests_total",
                "counter",
                "Finished requests by finish reason",
                [
                    f'{p}num_requests_total{{finish_reason="{k}"}} {v}'
                    for k, v in sorted(self.requests.items())
                ],
            )
            _family(
                out,
                f"{p}prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests",
                [f"{p}prompt_tokens_total {self.prompt_tokens}"],
            )
            _family(
                out,
                f"{p}generation_tokens_total",
                "counter",
                "Generated tokens of finished requests",
                [f"{p}generation_tokens_total {self.generation_tokens}"],
            )
            for name, hist, text in (
                ("time_to_first_token_seconds", self.ttft, "Time from arrival to the first output token"),
                ("time_per_output_token_seconds", self.tpot, "Mean time per output token after the first"),
                ("e2e_request_latency_seconds", self.e2e, "Time from arrival to the last output token"),
                ("queue_time_seconds", self.queue_time, "Time a request waited for the engine"),
            ):
                _family(out, p + name, "histogram", text, hist.render(p + name))
        for name, kind, text, value in extra:
            _family(out, p + name, kind, text, [] if value is None else [f"{p}{name} {float(value)!r}"])
        return "\n".join(out) + "\n"


def _family(out: list[str], name: str, kind: str, text: str, samples: list[str]) -> None:
    out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples]
