"""Tensor parallelism over torch.distributed: the only module that imports it.

Owns the process-wide TP state (``TPGroup``: rank, size, the compute group, a CPU gloo group for requests and
flags, the registered fast all-reduce, the shared progress counters), the collectives the layers call
(``all_reduce``, ``all_gather``, ``broadcast``; no-ops at size 1, so a single-rank run never touches
torch.distributed), the object/flag broadcasts the engine uses to keep ranks in lockstep, and ``launch_ranks``:
one process per rank from one command, with a supervisor that turns a rank that dies or stops making progress
into a non-zero exit with a message naming the rank, instead of a hang.

Timeouts: the compute group (NCCL on CUDA, gloo on CPU) times out after ``timeout_s``; the CPU group, which
also carries the wait for the next request while the server is idle, effectively never does, so idle ranks
are watched by the supervisor (exit codes) and busy ranks by their progress counters.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as tdist

from baton import env

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # collectives of the compute group; also the supervisor's no-progress limit
IDLE_TIMEOUT = timedelta(days=365)  # the CPU group: a follower waits here for the next request


class TPError(RuntimeError):
    """A tensor-parallel run failed: a rank raised, died or hung. The message names the rank."""


class FastAllReduce(Protocol):
    def accepts(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class TPGroup:
    """Where this process stands in the tensor-parallel group. ``size == 1`` and no groups when uninitialised."""

    rank: int = 0
    size: int = 1
    group: Any = None  # compute ProcessGroup (NCCL on CUDA, gloo on CPU)
    cpu_group: Any = None  # gloo ProcessGroup: requests, abort flags, barriers
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    fast_all_reduce: FastAllReduce | None = None
    progress: Any = None  # shared int64 array [size]: per-rank step counters (launch_ranks)
    busy: Any = None  # shared int8 array [size]: 1 while a rank is inside a request

    @property
    def initialized(self) -> bool:
        return self.group is not None


_STATE = TPGroup()


def state() -> TPGroup:
    return _STATE


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


@contextlib.contextmanager
def layout_context(rank: int, size: int) -> Iterator[None]:
    """Build modules with the shapes of ``rank`` of ``size`` without a process group (loader tests, the
    single-rank twin that dummy weights are drawn from, the DSpark draft that every rank holds whole: built at
    ``(0, 1)``, its layers keep size 1 and never reduce). Collectives must not run inside."""
    global _STATE
    saved = _STATE
    _STATE = TPGroup(rank=rank, size=size)
    try:
        yield
    finally:
        _STATE = saved


# ---- setup ----


def init_tp(rank: int, world_size: int, backend: str = "gloo", init_method: str = "env://",
            timeout_s: float = DEFAULT_TIMEOUT_S, fast_all_reduce: bool = True) -> TPGroup:
    """Join the group as ``rank``: the compute group (``backend``), a CPU gloo group, and on NCCL the one-shot
    all-reduce over symmetric memory when it sets up (NCCL otherwise)."""
    global _STATE
    if _LEFT_BEHIND or tdist.is_initialized():
        raise TPError("this process already ran a tensor-parallel group (an NCCL group cannot be torn down "
                      "safely, see baton.dist.destroy_tp): start each tensor-parallel job in its own process, "
                      "e.g. launch_ranks(..., rank0_in_caller=False)")
    env.configure_tp_environment()
    device = torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    else:  # CPU ranks share the cores: without this their thread pools spin against each other
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    tdist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                             timeout=timedelta(seconds=timeout_s), **kwargs)
    group = tdist.group.WORLD
    cpu_group = tdist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _STATE = TPGroup(rank, world_size, group, cpu_group, device, backend, None, _STATE.progress, _STATE.busy)
    if backend == "nccl" and fast_all_reduce and env.tp_allreduce() != "nccl":
        from baton.ops.allreduce import create_one_shot

        _STATE.fast_all_reduce = create_one_shot(group, device)
    return _STATE


TEARDOWN_TIMEOUT_S = 30.0  # a rank's whole teardown; past it the group is left behind (the process is ending)
_LEFT_BEHIND: list[Any] = []  # NCCL groups never torn down (see destroy_tp): referenced, so never destructed


def nccl_left_behind() -> bool:
    """True once this process has left an NCCL group behind: it must end with ``os._exit`` (``hard_exit``),
    since the group's destructor at interpreter exit would try the teardown that hangs."""
    return bool(_LEFT_BEHIND)


def hard_exit(code: int) -> None:
    """Flush and end the process now, without interpreter teardown (see ``nccl_left_behind``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def destroy_tp(timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Leave the group: every rank finishes its queued GPU work and meets the others on the CPU group (bounded
    by ``timeout_s``; a rank that cannot is logged with where it is stuck). A gloo group is then destroyed.

    An NCCL group is left behind instead: on the project's 2 x H200 machine (torch 2.11, CUDA 13) the NCCL
    teardown itself hangs on every rank after all work is done and after this barrier, in
    ``destroy_process_group`` and in ``_abort_process_group`` alike (docs/performance.md points to the stacks).
    A process that ran an NCCL rank therefore ends with ``hard_exit`` (the spawned
    ranks always do; the CLI does when ``nccl_left_behind``), and cannot join a second NCCL group: run each
    tensor-parallel job in its own process (``launch_ranks(..., rank0_in_caller=False)`` does)."""
    global _STATE
    st = _STATE
    _STATE = TPGroup()
    if not (st.initialized and tdist.is_initialized()):
        return

    group = (st.group, st.cpu_group, st.fast_all_reduce)
    errors: list[BaseException] = []

    def teardown() -> None:
        try:
            if st.device.type == "cuda":
                torch.cuda.synchronize(st.device)
            with contextlib.suppress(Exception):  # a peer that already left must not block this one
                tdist.barrier(group=st.cpu_group)
            if st.backend == "nccl":
                _LEFT_BEHIND.append(group)
            else:
                tdist.destroy_process_group()
        except BaseException as e:  # reported by the caller's thread
            errors.append(e)

    thread = threading.Thread(target=teardown, name="baton-tp-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _LEFT_BEHIND.append(group)
        frame = sys._current_frames().get(thread.ident)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
        log.warning("rank %d: tensor-parallel teardown did not finish in %.0f s; leaving the group behind. "
                    "It is stuck at:\n%s", st.rank, timeout_s, where)
    elif errors:
        log.warning("rank %d: tensor-parallel teardown failed: %s", st.rank, errors[0])


# ---- collectives the layers call ----


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks. Returns the reduced tensor: ``x`` itself (reduced in place) on the process-group path, a
    new tensor on the fast path. Identity at size 1."""
    s = _STATE
    if s.size == 1:
        return x
    fast = s.fast_all_reduce
    if fast is not None and fast.accepts(x):
        return fast(x)
    tdist.all_reduce(x, group=s.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, in rank order."""
    s = _STATE
    if s.size == 1:
        return x
    x = x.contiguous()
    if s.backend == "nccl":
        out = torch.empty((s.size, *x.shape), dtype=x.dtype, device=x.device)
        tdist.all_gather_into_tensor(out, x, group=s.group)
        parts = list(out.unbind(0))
    else:
        parts = [torch.empty_like(x) for _ in range(s.size)]
        tdist.all_gather(parts, x, group=s.group)
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank, in place on the compute group (a data-dependent decision that every
    rank must take alike, e.g. DSpark's prefix length). Identity at size 1."""
    s = _STATE
    if s.size == 1:
        return x
    tdist.broadcast(x, src=src, group=s.group)
    return x


# ---- lockstep between ranks (CPU group) ----


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (pickled over the CPU group); waits as long as rank 0 takes."""
    if _STATE.size == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0, group=_STATE.cpu_group)
    return box[0]


def broadcast_flag(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank: one 8-byte broadcast on the CPU group."""
    if _STATE.size == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64)
    tdist.broadcast(t, src=0, group=_STATE.cpu_group)
    return bool(t.item())


def barrier() -> None:
    """Wait for every rank on the CPU group (no timeout to speak of: e.g. after loading weights)."""
    if _STATE.size > 1:
        tdist.barrier(group=_STATE.cpu_group)


def progress() -> None:
    """Count one step of this rank (read by the supervisor's hang check)."""
    if _STATE.progress is not None:
        _STATE.progress[_STATE.rank] += 1


def set_busy(busy: bool) -> None:
    """Mark this rank as inside a request (the supervisor checks progress only then)."""
    if _STATE.busy is not None:
        _STATE.busy[_STATE.rank] = int(busy)


def fatal(message: str) -> None:
    """End the whole tensor-parallel run now: a rank that cannot stay in lockstep (e.g. it raised in the
    middle of a request) must not leave the others waiting in a collective."""
    sys.stderr.write(f"baton: tensor-parallel rank {_STATE.rank}: {message}\n")
    sys.stderr.flush()
    if _SUPERVISOR is not None:
        _SUPERVISOR.fail(f"rank {_STATE.rank} failed: {message}")
    if _CHILD_SHARED is not None:
        _report(_CHILD_SHARED, _STATE.rank, message)
    os._exit(1)


# ---- launching ranks ----


@dataclass
class _Shared:
    progress: Any
    busy: Any
    errors: Any  # mp.Queue of (rank, message)
    results: Any  # mp.Queue of rank 0's return value (when rank 0 is a child)


_SUPERVISOR: _Supervisor | None = None  # in the launching process while rank 0 runs there
_CHILD_SHARED: _Shared | None = None  # in a spawned rank


def launch_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), *, backend: str | None = None,
                 timeout_s: float | None = None, rank0_in_caller: bool = True) -> Any:
    """Run ``fn(*args)`` on ``world_size`` ranks (one process each, spawned) after ``init_tp``; return rank 0's
    result. ``fn`` and ``args`` must pickle (a module-level function). Rank 0 runs in the calling process when
    ``rank0_in_caller`` (the CLI: rank 0 serves HTTP); otherwise every rank is a child and the caller only
    supervises (tests). When any rank raises, dies or makes no progress for ``timeout_s`` inside a request,
    every rank is stopped: the caller then exits with status 1 (rank 0 in the caller; it may be stuck in a
    collective) or raises TPError. The message names the rank."""
    if world_size == 1:
        return fn(*args)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout_s = timeout_s if timeout_s is not None else env.tp_timeout_s() or DEFAULT_TIMEOUT_S
    env.configure_tp_environment()  # inherited by the children
    ctx = mp.get_context("spawn")
    shared = _Shared(ctx.Array("q", world_size, lock=False), ctx.Array("b", world_size, lock=False),
                     ctx.Queue(), ctx.Queue())
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    first = 1 if rank0_in_caller else 0
    procs = {}
    for rank in range(first, world_size):
        procs[rank] = ctx.Process(target=_rank_entry, name=f"baton-tp-rank{rank}", daemon=True,
                                  args=(fn, args, rank, world_size, backend, init_method, timeout_s, shared,
                                        os.getpid()))
        procs[rank].start()
    sup = _Supervisor(procs, shared, world_size, timeout_s, hard_exit=rank0_in_caller)
    sup.start()
    if rank0_in_caller:
        return _run_rank0_here(fn, args, world_size, backend, init_method, timeout_s, shared, sup)
    return sup.wait_result()


def _run_rank0_here(fn, args, world_size, backend, init_method, timeout_s, shared: _Shared, sup: _Supervisor):
    global _SUPERVISOR
    _SUPERVISOR = sup
    _STATE.progress, _STATE.busy = shared.progress, shared.busy
    try:
        init_tp(0, world_size, backend, init_method, timeout_s)
        result = fn(*args)
    except KeyboardInterrupt:
        sup.fail("interrupted", hard_exit=False, quiet=True)
        raise
    except BaseException as e:
        sup.fail(sup.explain_own_failure(f"{type(e).__name__}: {e}"), hard_exit=False)
        raise
    # Tear the group down together with the other ranks, which do so as their fn returns, and only then wait
    # for them to exit: NCCL's communicator teardown waits for every rank, so waiting for them first deadlocks
    # (rank 0 here would wait for children that wait for rank 0).
    destroy_tp()
    sup.wait_children()
    _SUPERVISOR = None
    return result


def _rank_entry(fn, args, rank, world_size, backend, init_method, timeout_s, shared: _Shared, parent: int) -> None:
    """A spawned rank: watch the parent, join the group, run ``fn``; report an exception and exit 1."""
    global _CHILD_SHARED
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it then stops the others
    _watch_parent(parent)
    _CHILD_SHARED = shared
    _STATE.progress, _STATE.busy = shared.progress, shared.busy
    try:
        init_tp(rank, world_size, backend, init_method, timeout_s)
        result = fn(*args)
        if rank == 0:
            shared.results.put(result)
            shared.results.close()
            shared.results.join_thread()
    except BaseException as e:
        traceback.print_exc()
        _report(shared, rank, f"{type(e).__name__}: {e}")
        os._exit(1)  # no teardown: peers may be stuck in a collective with us
    destroy_tp()
    hard_exit(0)  # the result is delivered: no interpreter teardown (or a left-behind NCCL group) to wait on


def _report(shared: _Shared, rank: int, message: str) -> None:
    shared.errors.put((rank, message))
    shared.errors.close()
    shared.errors.join_thread()
    sys.stderr.flush()


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)  # the launcher is gone

    threading.Thread(target=watch, name="baton-tp-parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Supervisor(threading.Thread):
    """Watches the spawned ranks from the launching process: exit codes, reported exceptions, and progress
    counters of ranks inside a request. On a failure it prints one message, stops every child, and either
    exits the process (``hard_exit``) or lets ``wait_result`` raise."""

    POLL_S = 0.1
    STRAGGLE_S = TEARDOWN_TIMEOUT_S + 10.0  # after rank 0 finished: the others' bounded teardown and a margin

    def __init__(self, procs: dict[int, Any], shared: _Shared, world_size: int, timeout_s: float,
                 hard_exit: bool) -> None:
        super().__init__(name="baton-tp-supervisor", daemon=True)
        self.procs, self.shared, self.world_size = procs, shared, world_size
        self.timeout_s, self.hard_exit = timeout_s, hard_exit
        self.errors: dict[int, str] = {}
        self.error: str | None = None
        self.result: Any = None
        self.has_result = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._seen = [(-1, 0, time.monotonic())] * world_size  # (progress, busy, since)

    def run(self) -> None:
        while not self._done.is_set() and self.error is None:
            self._drain()
            reason = self._exited() or self._stalled()
            if reason:
                self.fail(reason)
                return
            time.sleep(self.POLL_S)

    def _drain(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                rank, msg = self.shared.errors.get_nowait()
                self.errors[rank] = msg
        with contextlib.suppress(Exception):
            while not self.has_result:
                self.result = self.shared.results.get_nowait()
                self.has_result = True

    def _exited(self, also: dict[int, str] | None = None) -> str | None:
        """The failure to report among ranks that reported an error or exited non-zero (and ``also``: rank 0's
        error in this process): a rank whose own error came first, not a peer's broken connection or timeout."""
        failed = dict(also or {})
        failed.update(self.errors)
        for rank, p in self.procs.items():
            code = p.exitcode
            if code is None or code == 0 or rank in failed:
                continue
            time.sleep(0.2)  # give the queue a moment: the message is sent before the exit
            self._drain()
            how = f"exited with code {code}" if code > 0 else f"killed by signal {-code}"
            failed[rank] = self.errors.get(rank, how)
        if not failed:
            return None
        rank = min(failed, key=lambda r: (_is_peer_failure(failed[r]), r))
        reason = f"rank {rank} failed: {failed[rank]}"
        if _is_peer_failure(failed[rank]):  # a peer left it waiting: name the live ranks that fell behind
            behind = [r for r in self._live_ranks(failed) if self.shared.progress[r] < self.shared.progress[rank]]
            if behind:
                names = ", ".join(map(str, behind))
                reason = f"rank {names} stopped making progress (behind the others; hung?), then {reason}"
        return reason

    def _live_ranks(self, failed: dict[int, str]) -> list[int]:
        live = [r for r, p in self.procs.items() if p.exitcode is None and r not in failed]
        if self.hard_exit and 0 not in failed:  # rank 0 runs in this process
            live.insert(0, 0)
        return live

    def explain_own_failure(self, message: str) -> str:
        """Rank 0 (in this process) raised: when that is a peer's broken connection or a timeout, wait briefly
        for the peer's own report, to name it instead."""
        deadline = time.monotonic() + (3.0 if _is_peer_failure(message) else 0.0)
        while time.monotonic() < deadline:
            self._drain()
            if self.errors or any(p.exitcode not in (None, 0) for p in self.procs.values()):
                break
            time.sleep(self.POLL_S)
        return self._exited({0: message}) or f"rank 0 failed: {message}"

    def _stalled(self) -> str | None:
        now = time.monotonic()
        stalled = []
        for rank in range(self.world_size):
            count, busy = self.shared.progress[rank], self.shared.busy[rank]
            last_count, last_busy, since = self._seen[rank]
            if count != last_count or busy != last_busy:
                self._seen[rank] = (count, busy, now)
            elif busy and now - since > self.timeout_s:
                stalled.append(rank)
        if not stalled:
            return None
        blame = _blame(stalled, self.shared.progress)
        return f"{blame} no progress for {self.timeout_s:.0f} s inside a request (hung?)"

    def status(self) -> str:
        lines = []
        for rank in range(self.world_size):
            p = self.procs.get(rank)
            if p is None:
                state = "the launching process"
            elif p.exitcode is None:
                state = f"pid {p.pid}, running"
            else:
                state = f"pid {p.pid}, exit code {p.exitcode}"
            lines.append(f"  rank {rank}: {state}, {self.shared.progress[rank]} steps"
                         + (", in a request" if self.shared.busy[rank] else ""))
        return "\n".join(lines)

    def fail(self, reason: str, hard_exit: bool | None = None, quiet: bool = False) -> None:
        """Report, stop every child, and exit (rank 0 in this process) or record the error for wait_result."""
        with self._lock:
            if self.error is not None or self._done.is_set():  # done: the run is over, stragglers are stopped
                return
            self._drain()
            self.error = f"tensor-parallel run failed: {reason}\n{self.status()}"
            if not quiet:
                sys.stderr.write(f"baton: {self.error}\n")
                sys.stderr.flush()
            self._stop_children()
        if self.hard_exit if hard_exit is None else hard_exit:
            os._exit(1)

    def _stop_children(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + 3.0
        for p in self.procs.values():
            p.join(max(deadline - time.monotonic(), 0.0))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)

    def _stop_stragglers(self) -> None:
        """Rank 0's work is done but others have not left: stop watching (so their exit is no failure), kill."""
        log.warning("tensor-parallel ranks did not exit after rank 0 finished; stopping them\n%s", self.status())
        self._done.set()
        self._stop_children()

    def wait_children(self) -> None:
        """Rank 0 finished: wait for the others to leave (they follow rank 0's stop, each within its bounded
        teardown), then stop watching; a rank still there after ``TEARDOWN_TIMEOUT_S`` and a margin is killed
        with a warning (rank 0's result stands)."""
        deadline = time.monotonic() + self.STRAGGLE_S
        while any(p.exitcode is None for p in self.procs.values()) and self.error is None:
            if time.monotonic() > deadline:
                self._stop_stragglers()
                break
            time.sleep(self.POLL_S)
        self._done.set()
        if self.error is not None:
            raise TPError(self.error)

    def wait_result(self) -> Any:
        """Every rank is a child: wait for all of them; rank 0's result, or TPError. Once rank 0 has delivered
        its result and exited, the others get ``TEARDOWN_TIMEOUT_S`` (and a margin) to leave, then are killed
        with a warning: the result stands."""
        straggle_deadline = None
        while self.error is None and not all(p.exitcode == 0 for p in self.procs.values()):
            if straggle_deadline is None and self.procs[0].exitcode == 0:
                straggle_deadline = time.monotonic() + self.STRAGGLE_S
            if straggle_deadline is not None and time.monotonic() > straggle_deadline:
                self._drain()
                if self.has_result:
                    self._stop_stragglers()
                    break
            time.sleep(self.POLL_S)
        self._done.set()
        self.join()
        if self.error is not None:
            raise TPError(self.error)
        self._drain()
        if not self.has_result:
            with contextlib.suppress(Exception):
                self.result, self.has_result = self.shared.results.get(timeout=5.0), True
        return self.result


_PEER_FAILURE = ("connection reset", "connection closed", "timed out", "timeout", "broken pipe", "socket",
                 "nccl error", "remote process exited")


def _is_peer_failure(message: str) -> bool:
    """Errors a rank gets because another rank failed (a collective that timed out or lost its peer)."""
    text = message.lower()
    return any(k in text for k in _PEER_FAILURE)


def _blame(stalled: list[int], counters) -> str:
    """The ranks to name for a stall: those behind the others (they stopped before a collective the rest
    entered); all stalled ranks when they are level."""
    counts = {r: counters[r] for r in stalled}
    low = min(counts.values())
    behind = [r for r, c in counts.items() if c == low]
    if len(behind) < len(stalled):
        return "rank " + ", ".join(map(str, behind)) + " (behind the others):"
    return "ranks " + ", ".join(map(str, stalled)) + ":"
