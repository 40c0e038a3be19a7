"""Latency of one all-reduce at batch-1 decode sizes (5-64 KB of bf16), NCCL against the one-shot symmetric-memory
kernel, eager and inside a CUDA graph, on ``--tp-size`` GPUs of this host.

Eager: ``iters`` back-to-back calls on the stream, timed with CUDA events (launch overhead included, as an
eager decode pays it). Graph: ``iters`` calls captured in one CUDA graph, the replay timed and divided by
``iters`` (the in-graph cost a captured decode step pays); medians of 5 (``benchmarks.ops.timing``). Both check the
sum against the expected value.

    python -m benchmarks.ops.bench_allreduce [--tp-size 2] [--sizes 5120 8192 ...] [--iters 200] [--json out.json]

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as in serving.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch

from benchmarks.ops.timing import eager_time_us, graph_time_us

DEFAULT_SIZES = (5120, 8192, 16384, 30720, 32768, 65536)  # bytes: Ling hidden row (bf16) .. 12 rows


def _impls() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    import torch.distributed as tdist

    from baton import dist

    state = dist.state()
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}

    def nccl(x: torch.Tensor) -> torch.Tensor:
        tdist.all_reduce(x, group=state.group)
        return x

    out["nccl"] = nccl
    if state.fast_all_reduce is not None:
        out["one_shot"] = state.fast_all_reduce
    return out


def _check(fn, x: torch.Tensor, world: int, name: str) -> None:
    x.fill_(1.0)
    got = fn(x)
    torch.cuda.synchronize()
    if not torch.all(got == world):
        raise RuntimeError(f"{name}: all-reduce of ones gave {got.float().unique().tolist()}, expected {world}")


def bench_allreduce(sizes: tuple[int, ...] = DEFAULT_SIZES, iters: int = 200,
                    dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Run on every rank of an initialised NCCL group (baton.dist); returns rows of µs per call."""
    from baton import dist

    world = dist.tp_size()
    rows = []
    for size in sizes:
        n = size // torch.empty((), dtype=dtype).element_size()
        for name, fn in _impls().items():
            x = torch.empty(n, dtype=dtype, device=dist.state().device)
            _check(fn, x, world, name)
            calls = [functools.partial(fn, x)] * iters
            eager = eager_time_us(calls, repeats=5)
            graph = graph_time_us(calls, replays=5, warmup=3)
            rows.append({"impl": name, "bytes": size, "tp": world, "eager_us": round(eager, 2),
                         "graph_us": round(graph, 2)})
    return rows


def _rank(sizes: tuple[int, ...], iters: int) -> list[dict]:
    return bench_allreduce(sizes, iters)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'impl':>9} {'bytes':>7} {'eager µs':>9} {'graph µs':>9}"]
    for r in rows:
        lines.append(f"{r['impl']:>9} {r['bytes']:>7} {r['eager_us']:>9.2f} {r['graph_us']:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from baton import dist

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="message sizes in bytes")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", default=None, help="write the rows here")
    ns = p.parse_args(argv)
    rows = dist.launch_ranks(_rank, ns.tp_size, (tuple(ns.sizes), ns.iters), backend="nccl", rank0_in_caller=False)
    print(f"all-reduce latency, {ns.tp_size} GPUs ({torch.cuda.get_device_name()}), bf16, torch {torch.__version__}")
    print(format_table(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"tp": ns.tp_size, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
