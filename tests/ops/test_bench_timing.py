"""The op benchmarks' timing helper (benchmarks/ops/timing.py): the rotation sizes each bench had before it shared
the helper, and (on CUDA) graph and eager timing of a known amount of work."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.ops import timing

MB = 1 << 20


@pytest.mark.parametrize("nbytes", [1, 4096, 5 * MB, 60 * MB, 300 * MB, 2 << 30])
def test_cold_copies_keep_each_benchs_rotation(nbytes):
    assert timing.cold_copies(nbytes, 4 * timing.L2_BYTES, 2, 512) == max(2, min(512, math.ceil(240 * MB / nbytes)))
    assert timing.cold_copies(nbytes) == max(2, -(-4 * (60 << 20) // nbytes))  # the fp8 bench's
    assert timing.cold_copies(nbytes, 256 * MB, 1, 512) == max(1, min(512, math.ceil(256 * MB / nbytes)))
    assert timing.cold_copies(nbytes, 150 * MB, 64) == max(64, math.ceil(150 * MB / nbytes))  # kda's, 50 MB L2


def test_unknown_stat_is_refused():
    with pytest.raises(ValueError, match="stat"):
        timing.graph_time_us([], stat="min")
    with pytest.raises(ValueError, match="stat"):
        timing.eager_time_us([], stat="min")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stat", ["median", "mean"])
def test_gpu_timing_scales_with_the_work(stat):
    """Ten matmuls per call take longer than one; the graph's calls all ran (the output counts them)."""
    a = torch.randn(2048, 2048, device="cuda")
    count = torch.zeros((), device="cuda")

    def one():
        count.add_(1)
        return a @ a

    def ten():
        for _ in range(10):
            a @ a

    small = timing.graph_time_us([one] * 4, 10, stat=stat)
    large = timing.graph_time_us([ten] * 4, 10, stat=stat)
    assert 0 < small < large
    assert count.item() == 4 + 4 * (1 + 10)  # warm-up calls, one warm replay, ten timed replays
    assert 0 < timing.eager_time_us([one] * 4, 3, stat=stat) < timing.eager_time_us([ten] * 4, 3, stat=stat)
