"""Data-parallel draft training (``baton train nextn|dspark --dp-size N``).

N processes, one per GPU (``cuda:0`` .. ``cuda:N-1``; on a machine without CUDA, N CPU processes over gloo,
which is what the tests run), each with its own frozen target and a replica of the draft. An optimiser step
takes the same global batch of ``--batch-size`` sequences a single process would: rank r trains sequences r,
r + N, r + 2N, ... of it. Before the backward pass the batch's total loss weight is summed over the ranks, so
each rank's losses are divided by the global normaliser. After it the gradients are summed, and every rank then
takes the identical clipped AdamW step. Anchors (DSpark) are drawn per sequence from (seed, step, index in the
global batch) (``plan_generator``), so the plans do not depend on N. A run with ``--dp-size 2`` thus follows
the one-process run up to floating-point summation order (tests/train/test_dp.py checks it).

The step times are max-reduced, so ``--time-budget`` takes the same decisions on every rank. Rank 0 alone
evaluates, logs, writes the checkpoint, metrics.json and the curves; the other ranks only train.

Why: a step of the embedded SmolLM2's DSpark drafter (16 sequences, 256 anchors) took 0.26 s on one H200. That
is mostly the per-sequence backbone forward and backward, not the vocabulary-sized loss (``--batched-loss``
measured 0.255 against 0.259 s). Two GPUs each taking half of the batch are the remaining 2x.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def plan_generator(seed: int, step: int, index: int) -> torch.Generator:
    """The CPU generator of sequence ``index`` of the global batch at ``step``: a function of the three alone."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


@dataclass
class DataParallel:
    """This process's place in a data-parallel run (the process group is initialised by ``launch``)."""

    rank: int
    world: int
    device: torch.device  # where collective tensors live (cuda:rank under NCCL, cpu under gloo)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, batch: Sequence[Any]) -> list[Any]:
        """This rank's sequences of a global batch: every ``world``-th, from ``rank``."""
        return list(batch[self.rank :: self.world])

    def global_index(self, local: int) -> int:
        return self.rank + local * self.world

    def sum(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def max(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters on every rank (the replicas start identical whatever their initialisation)."""
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p.data, src=0)

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over the ranks, in one flat buffer. A parameter no rank gave a gradient
        keeps ``grad = None`` (as in one process, so AdamW skips it); one that some rank did not touch counts as
        zero there."""
        params = [p for p in params if p.requires_grad]
        if not params:
            return
        ref = params[0]
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=ref.dtype, device=ref.device)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [flags])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        had = flat[-len(params):].tolist()
        offset = 0
        for p, h in zip(params, had, strict=True):
            n = p.numel()
            if h > 0:
                p.grad = flat[offset : offset + n].view_as(p).clone()
            else:
                p.grad = None
            offset += n

    def gather_stats(self, stats: dict[str, tuple[Any, float]]) -> list[dict[str, tuple[float, float]]]:
        """Every rank's (sum, count) statistics of its share of the batch, as host floats (``common.merge_stats``
        adds them up)."""
        local = {k: (float(s), float(n)) for k, (s, n) in stats.items()}
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, local)
        return gathered


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_dp_devices(world: int, requested: str | None) -> str:
    """"cuda" or "cpu" for a ``world``-rank run: CUDA when available (and not asked for the CPU), which then
    needs ``world`` GPUs. Raises ValueError with what to do otherwise."""
    if world < 1:
        raise ValueError(f"--dp-size {world}: at least 1")
    wants_cpu = requested is not None and requested.startswith("cpu")
    if wants_cpu or not torch.cuda.is_available():
        return "cpu"
    have = torch.cuda.device_count()
    if have < world:
        raise ValueError(f"--dp-size {world} needs {world} GPUs, {have} visible (CUDA_VISIBLE_DEVICES)")
    return "cuda"


def _worker(rank: int, world: int, port: int, kind: str, fn: Callable[[DataParallel], Any],
            log_level: str) -> None:
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format=f"%(levelname)s %(name)s [rank {rank}]: %(message)s")
    if kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the host's cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device if kind == "cuda" else None)
    done = False
    try:
        fn(DataParallel(rank, world, device))
        dist.barrier()  # every rank at the end (rank 0 saves after the others' last step) before any tears down
        done = True
    finally:
        dist.destroy_process_group()
    if done:
        # Leave without the interpreter's finalisation: Gloo's worker threads may still hold tensors whose release
        # then needs the GIL of a dying interpreter, and the process aborts (SIGABRT, "terminate called without an
        # active exception"), after the run's work is all written.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def launch(world: int, kind: str, fn: Callable[[DataParallel], Any], log_level: str = "info") -> None:
    """Run ``fn(dp)`` in ``world`` spawned processes (``kind`` "cuda": one GPU each, NCCL; "cpu": gloo). ``fn``
    must be picklable (a module-level function or a functools.partial of one). A rank's exception ends the run
    and is raised here."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port(), kind, fn, log_level), nprocs=world, join=True)


__all__ = ["DataParallel", "launch", "plan_generator", "resolve_dp_devices"]
