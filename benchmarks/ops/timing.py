"""How the op benchmarks time a kernel on CUDA: one helper for every bench in benchmarks/ops.

- ``graph_time_us``: the calls (one op each, usually over rotating input copies) are captured in order into one
  CUDA graph and the replays timed with CUDA events, so the figure per call includes the graph-node gap a captured
  decode step pays. Before capture the first ``warmup`` calls run eagerly on a side stream (compilation,
  autotuning and allocations happen outside the capture), and ``warm_replays`` untimed replays follow it.
  ``stat="median"``: each replay timed alone, the median over ``replays`` divided by the number of calls;
  ``stat="mean"``: the replays back to back between one pair of events, the total over replays x calls.
- ``eager_time_us``: the calls launched eagerly (launch overhead included, as an eager step pays it), ``repeats``
  times; the median of the repeats or the mean over all of them.
- ``cold_copies``: how many copies of an input to rotate through so that one replay touches more bytes than the
  L2 holds, and every call reads its input from HBM as layer after layer does in the model.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import torch

L2_BYTES = 60 << 20  # the H200's L2 as the linear and fp8 benches size their rotations
MiB = 1 << 20


def l2_bytes(default: int = 50 * MiB) -> int:
    """The current GPU's L2 size (``default`` where torch does not report it)."""
    return getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", default)


def cold_copies(nbytes: int, cold_bytes: int = 4 * L2_BYTES, min_copies: int = 2, max_copies: int | None = None
                ) -> int:
    """Copies of an input of ``nbytes`` (per call) whose rotation touches at least ``cold_bytes``, within
    [``min_copies``, ``max_copies``]."""
    n = max(min_copies, math.ceil(cold_bytes / max(1, nbytes)))
    return n if max_copies is None else max(min_copies, min(max_copies, n))


def _elapsed_us(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return start.elapsed_time(end) * 1e3


def graph_time_us(calls: Sequence[Callable[[], object]], replays: int = 20, *, warmup: int | None = None,
                  warm_replays: int = 1, stat: str = "median") -> float:
    """µs per call of one CUDA graph that runs ``calls`` in order (see the module docstring). ``warmup``: how
    many of the calls run eagerly before the capture (None: all of them)."""
    if stat not in ("median", "mean"):
        raise ValueError(f"stat must be 'median' or 'mean', not {stat!r}")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:warmup]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    for _ in range(warm_replays):
        graph.replay()
    torch.cuda.synchronize()
    if stat == "mean":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = _elapsed_us(start, end) / (replays * len(calls))
    else:
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(_elapsed_us(start, end) / len(calls))
        us = statistics.median(times)
    del graph
    return us


def eager_time_us(calls: Sequence[Callable[[], object]], repeats: int = 5, *, warmup: bool = False,
                  stat: str = "median") -> float:
    """µs per call of ``calls`` launched eagerly, ``repeats`` times (after one untimed pass when ``warmup``):
    ``stat="median"``: each repeat timed alone, the median; ``"mean"``: all repeats between one pair of events."""
    if stat not in ("median", "mean"):
        raise ValueError(f"stat must be 'median' or 'mean', not {stat!r}")
    if warmup:
        for fn in calls:
            fn()
    torch.cuda.synchronize()
    if stat == "mean":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            for fn in calls:
                fn()
        end.record()
        torch.cuda.synchronize()
        return _elapsed_us(start, end) / (repeats * len(calls))
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in calls:
            fn()
        end.record()
        end.synchronize()
        times.append(_elapsed_us(start, end) / len(calls))
    return statistics.median(times)
