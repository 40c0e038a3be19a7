"""Tensor parallelism on two GPUs (skipped without them): the one-shot symmetric-memory all-reduce sums exactly
like NCCL, eager and in a CUDA graph, and its bench runs; the TP=2 engine with CUDA graphs (NCCL and the
one-shot kernel inside the captured steps) gives the TP=1 greedy tokens in fp32, also with DSpark / DFlash block
drafts (the gathered base logits and the Triton Markov chain inside the captured draft), simulated acceptance and
a seeded sampled request."""

from __future__ import annotations

import pytest
import torch

from baton import dist
from baton.config import ServerArgs, SpecConfig, load_model_config
from baton.engine.engine import Engine
from baton.engine.tp import run_tp
from baton.models.dspark_checkpoint import write_random_dspark_draft
from tests.dist.ranks import generate_all

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _compare_all_reduce() -> dict:
    """Every rank: one-shot vs NCCL on rank-dependent data, eager and captured; returns what it saw."""
    import torch.distributed as tdist

    fast = dist.state().fast_all_reduce
    if fast is None:
        return {"fast": False}
    worst = 0.0
    device = dist.state().device
    for dtype in (torch.bfloat16, torch.float32):
        for n in (8, 2560, 2560 * 6, 32768):
            gen = torch.Generator(device=device).manual_seed(n + dist.tp_rank())
            x = torch.randn(n, dtype=dtype, device=device, generator=gen)
            want = x.clone()
            tdist.all_reduce(want)
            assert fast.accepts(x)
            got = fast(x)
            worst = max(worst, float((got.float() - want.float()).abs().max()))
            graph, out = torch.cuda.CUDAGraph(), None
            fast(x)  # warm up outside the capture
            with torch.cuda.graph(graph):
                out = fast(x)
            graph.replay()
            torch.cuda.synchronize()
            worst = max(worst, float((out.float() - want.float()).abs().max()))
    return {"fast": True, "worst": worst}


def _bench_rows() -> list[dict]:
    from benchmarks.ops.bench_allreduce import bench_allreduce

    return bench_allreduce(sizes=(5120, 65536), iters=20)


@pytest.fixture
def one_shot(monkeypatch):
    """The one-shot all-reduce is opt-in (``BATON_TP_ALLREDUCE=auto``); the spawned ranks inherit it."""
    monkeypatch.setenv("BATON_TP_ALLREDUCE", "auto")


def test_one_shot_all_reduce_matches_nccl(one_shot):
    seen = dist.launch_ranks(_compare_all_reduce, 2, backend="nccl", rank0_in_caller=False, timeout_s=120)
    assert seen["fast"], "the one-shot all-reduce did not set up (see the log for why)"
    assert seen["worst"] < 1e-2


def test_allreduce_bench_runs(one_shot):
    rows = dist.launch_ranks(_bench_rows, 2, backend="nccl", rank0_in_caller=False, timeout_s=120)
    assert {r["impl"] for r in rows} >= {"nccl"}
    assert all(r["eager_us"] > 0 and r["graph_us"] > 0 for r in rows)


@pytest.mark.parametrize("allreduce", ["nccl", "auto"])
@pytest.mark.parametrize("spec", [{}, {"algorithm": "NEXTN", "num_steps": 3}])
def test_tp2_cuda_graphs_equal_tp1(ling_path, spec, allreduce, monkeypatch):
    monkeypatch.setenv("BATON_TP_ALLREDUCE", allreduce)
    requests = [([3, 5, 7, 11, 13, 17], dict(temperature=0.0, max_new_tokens=40, ignore_eos=True))]
    got, want = _tp2_and_tp1(ling_path, spec, requests)
    assert got == want


def _tp2_and_tp1(ling_path: str, spec: dict, requests: list) -> tuple[list, list]:
    """The requests' outputs on CUDA graphs at TP 2 and at TP 1 (fp32), the TP 1 engine freed first."""
    def args(tp: int) -> ServerArgs:
        return ServerArgs(model_path=ling_path, device="cuda", dtype="float32", context_length=512, tp_size=tp,
                          spec=SpecConfig(**{"adaptive": False, **spec}))

    engine = Engine(args(1))
    assert engine.program.capture
    want = generate_all(engine, [(i, dict(k)) for i, k in requests])
    del engine
    torch.cuda.empty_cache()
    got = run_tp(args(2), generate_all, ([(i, dict(k)) for i, k in requests],), rank0_in_caller=False,
                 timeout_s=300)
    return got, want


@pytest.mark.parametrize("allreduce", ["nccl", "auto"])
@pytest.mark.parametrize("algorithm,simulate", [("DSPARK", None), ("DFLASH", None), ("DSPARK", 4.5)])
def test_tp2_cuda_graphs_block_drafts_equal_tp1(ling_path, tmp_path, algorithm, simulate, allreduce, monkeypatch):
    monkeypatch.setenv("BATON_TP_ALLREDUCE", allreduce)
    draft = str(tmp_path / "draft")
    write_random_dspark_draft(load_model_config(ling_path), draft, seed=1, block_size=6, num_layers=2,
                              markov_rank=32, with_heads=algorithm == "DSPARK")
    spec = dict(algorithm=algorithm, draft_model_path=draft, simulate_accept_len=simulate)
    requests = [([3, 5, 7, 11, 13, 17], dict(temperature=0.0, max_new_tokens=40, ignore_eos=True)),
                ([3, 5, 7], dict(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=24, ignore_eos=True))]
    got, want = _tp2_and_tp1(ling_path, spec, requests)
    assert got == want
    assert got[0][2] > 0
