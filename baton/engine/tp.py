"""Tensor-parallel serving: one Engine per rank, in lockstep, with rank 0 facing the server or the terminal.

``run_tp`` starts the ranks (baton.dist.launch_ranks); each builds its Engine on its own GPU. Rank 0 wraps its
engine in ``TPEngine``, which the server and ``baton generate`` use like an Engine: each request is validated
on rank 0, then broadcast to the other ranks (a pickled Request on the CPU gloo group) before rank 0 runs it;
the followers (``follow``) run the same request through the same loop. Every rank's tokens are identical (the
greedy argmax and the gathered logits are the same on every rank; a sampled request's seed is fixed by rank 0
before the broadcast), so every rank stops at the same step without talking.

Aborts (a client that disconnects, ``/abort_request``): rank 0's decision is broadcast every
``ABORT_POLL_STEPS`` steps, at the step boundary where every rank polls ``should_abort``: one 8-byte CPU
broadcast per 8 steps, no per-step host round trip, and in the CUDA-graph loop it overlaps the step already
enqueued; an abort takes effect within 8 steps. The same poll counts progress for the supervisor's hang check.
A rank that raises inside a request cannot rejoin the lockstep, so the whole run ends (baton.dist.fatal).

``TPEngine.call_all`` runs a function on every rank's engine at once (the census at TP > 1: each rank replays
its captured steps, whose collectives pair up across ranks).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from baton import dist
from baton.config import ConfigError, ServerArgs
from baton.engine.api import RequestTrace, run_warm_up
from baton.types import Request, SpecStats, StepOutput

if TYPE_CHECKING:
    from baton.engine.engine import Engine

log = logging.getLogger(__name__)

ABORT_POLL_STEPS = 8


class StepPoll:
    """The ``should_abort`` every rank passes to ``Engine.generate``: counts steps, and every
    ``ABORT_POLL_STEPS`` calls returns rank 0's decision on all ranks (``decide`` is read on rank 0 only)."""

    def __init__(self, decide: Callable[[], bool] | None = None) -> None:
        self.decide = decide
        self.calls = 0
        self.forced = False

    def force(self) -> None:
        """Rank 0 abandons the request: abort at the next poll."""
        self.forced = True

    def __call__(self) -> bool:
        dist.progress()
        self.calls += 1
        if self.calls % ABORT_POLL_STEPS:
            return False
        local = self.forced or (self.decide is not None and self.decide())
        return dist.broadcast_flag(local)


@dataclass(frozen=True)
class Generate:
    """Run this request (its seed already fixed by rank 0)."""

    req: Request


@dataclass(frozen=True)
class FlushCache:
    """Forget every cached state."""


@dataclass(frozen=True)
class CallAll:
    """Run ``fn(engine, *args)`` (a module-level function: it is pickled)."""

    fn: Callable[..., object]
    args: tuple


@dataclass(frozen=True)
class Stop:
    """Leave ``follow``: the run is over."""


RankMessage = Generate | FlushCache | CallAll | Stop


class TPEngine:
    """Rank 0's engine under tensor parallelism: the EngineAPI (baton/engine/api.py), with every request and cache
    flush mirrored on the other ranks as a RankMessage. ``engine`` is rank 0's own Engine (for tools that work on
    one rank's model: the census, the gate's checks)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # one broadcast sequence at a time (engine thread vs. shutdown)
        self.server_args = engine.server_args
        self.tokenizer = engine.tokenizer
        self.model_path = engine.model_path
        self.served_model_name = engine.served_model_name
        self.context_length = engine.context_length
        self.vocab_size = engine.vocab_size

    @property
    def spec_stats(self) -> SpecStats:
        return self.engine.spec_stats

    def validate_request(self, req: Request) -> None:
        self.engine.validate_request(req)

    def model_info(self) -> dict[str, Any]:
        return self.engine.model_info()

    def server_info(self) -> dict[str, Any]:
        return self.engine.server_info()

    def prefix_cache_info(self) -> dict[str, Any]:
        return self.engine.prefix_cache_info()  # every rank's tree is the same (decisions from token ids only)

    def add_observer(self, fn: Callable[[RequestTrace], None]) -> None:
        self.engine.add_observer(fn)

    def warm_up(self) -> None:
        run_warm_up(self, long_prompt=self.engine.device.type == "cuda")  # through generate: every rank runs it

    def generate(self, req: Request, should_abort: Callable[[], bool] | None = None) -> Iterator[StepOutput]:
        self.engine.validate_request(req)  # a rejected request never reaches the other ranks
        req = _with_seed(req)
        with self._lock:
            yield from self._run(req, should_abort)

    def _run(self, req: Request, should_abort: Callable[[], bool] | None) -> Iterator[StepOutput]:
        _send(Generate(req))
        poll = StepPoll(should_abort)
        dist.set_busy(True)
        inner = self.engine.generate(req, poll)
        done = False
        try:
            for out in inner:
                done = out.finished
                yield out
            done = True
        except Exception as e:
            dist.fatal(f"failed inside a request, the ranks are out of step: {type(e).__name__}: {e}")
        finally:
            if not done:  # the consumer left early: run on to the next poll, where every rank stops
                poll.force()
                for _ in inner:
                    pass
            dist.set_busy(False)

    def flush_cache(self) -> None:
        with self._lock:
            _send(FlushCache())
            self.engine.flush_cache()

    def call_all(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(engine, *args)`` on every rank at once (each on its own Engine) and return rank 0's result:
        for work whose collectives must run in lockstep outside a request, such as the census replaying the
        captured steps. ``fn`` and ``args`` must pickle (a module-level function)."""
        with self._lock:
            _send(CallAll(fn, args))
            return fn(self.engine, *args)

    def shutdown(self) -> None:
        """Tell the other ranks to leave ``follow`` (after the request in flight, if any)."""
        with self._lock:
            _send(Stop())


def _send(msg: RankMessage) -> None:
    dist.broadcast_object(msg)


def _receive() -> RankMessage:
    msg = dist.broadcast_object(None)
    if not isinstance(msg, Generate | FlushCache | CallAll | Stop):
        raise TypeError(f"rank 0 sent {type(msg).__name__}, not a RankMessage")
    return msg


def follow(engine: Engine) -> None:
    """A rank other than 0: run what rank 0 broadcasts until it says stop."""
    while True:
        msg = _receive()
        match msg:
            case Stop():
                return
            case FlushCache():
                engine.flush_cache()
            case CallAll(fn, args):
                fn(engine, *args)
            case Generate(req):
                dist.set_busy(True)
                for _ in engine.generate(req, StepPoll()):
                    pass
                dist.set_busy(False)


def _with_seed(req: Request) -> Request:
    """A sampled request without a seed gets one here, so every rank draws the same numbers."""
    sp = req.sampling
    if sp.is_greedy or sp.seed is not None:
        return req
    return dataclasses.replace(req, sampling=dataclasses.replace(sp, seed=time.time_ns() % (2**63)))


def rank_main(args: ServerArgs, leader: Callable[..., Any], leader_args: tuple = (),
              setup: Callable[[Engine], None] | None = None) -> Any:
    """What every rank runs: build the Engine (``setup`` may adjust it, on every rank alike), then rank 0 runs
    ``leader(TPEngine, *leader_args)`` and the others follow it. Returns the leader's result on rank 0."""
    from baton.engine.engine import Engine

    engine = Engine(args)
    if setup is not None:
        setup(engine)
    if dist.tp_rank() != 0:
        follow(engine)
        return None
    tp = TPEngine(engine)
    try:
        return leader(tp, *leader_args)
    finally:
        tp.shutdown()


def run_tp(args: ServerArgs, leader: Callable[..., Any], leader_args: tuple = (), *,
           setup: Callable[[Engine], None] | None = None, rank0_in_caller: bool = True,
           timeout_s: float | None = None) -> Any:
    """Start ``args.tp_size`` ranks and run ``leader`` on rank 0 (see rank_main); ``leader``, ``setup`` and
    their arguments must pickle (module-level functions)."""
    backend = "nccl" if _uses_cuda(args) else "gloo"
    _check(args, backend)
    return dist.launch_ranks(rank_main, args.tp_size, (args, leader, leader_args, setup), backend=backend,
                             timeout_s=timeout_s, rank0_in_caller=rank0_in_caller)


def _check(args: ServerArgs, backend: str) -> None:
    import torch

    if args.tp_size < 1:
        raise ConfigError(f"--tp-size {args.tp_size}: must be at least 1")
    if backend == "nccl" and torch.cuda.device_count() < args.tp_size:
        raise ConfigError(f"--tp-size {args.tp_size} needs {args.tp_size} GPUs; {torch.cuda.device_count()} visible")
    cfg = _model_config(args)
    if cfg is not None:  # shapes that do not divide: one clear error before any rank starts
        from baton.models.build import build_model

        with dist.layout_context(0, args.tp_size):
            build_model(cfg, "meta", torch.float32)


def _model_config(args: ServerArgs):
    """The model's config, or None when it cannot be read here (the ranks then report why)."""
    from baton.config import load_model_config, parse_model_config

    try:
        if args.is_embedded or args.model_path.endswith(".gguf"):
            from baton.models.gguf import find_embedded_gguf, read_gguf_llama_config

            path = find_embedded_gguf() if args.is_embedded else args.model_path
            return parse_model_config(read_gguf_llama_config(path), args.json_model_override_args)
        return load_model_config(args.model_path, args.json_model_override_args)
    except Exception as e:
        log.debug("cannot pre-check the model config: %s", e)
        return None


def _uses_cuda(args: ServerArgs) -> bool:
    import torch

    if args.device:
        return torch.device(args.device).type == "cuda"
    return torch.cuda.is_available()
