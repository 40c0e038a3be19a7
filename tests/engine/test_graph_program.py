"""The CUDA-graph program (relay on the device, positions from tensors, full-cache attention with a position
mask, device-indexed commit and extend, one-step-late host reads) run eagerly on CPU: it must produce exactly
the eager path's greedy tokens. The captured version is checked on the GPU (tests/engine/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest

from baton.engine.graphs import CudaGraphs
from tests.spec.conftest import make_engine
from tests.spec.test_spec_core import run


@pytest.mark.parametrize("spec", [{}, {"algorithm": "NEXTN", "num_steps": 1}, {"algorithm": "NEXTN", "num_steps": 4}])
def test_graph_program_equals_eager_ling(ling_path, spec):
    engine = make_engine(ling_path, **spec)
    want, want_verify = run(engine, max_new_tokens=33)
    engine.graphs = CudaGraphs(engine, capture=False)
    got, got_verify = run(engine, max_new_tokens=33)
    assert got == want
    if spec:
        assert got_verify == want_verify


def test_graph_program_equals_eager_llama(llama_path, llama_nextn_path):
    engine = make_engine(llama_path, algorithm="NEXTN", num_steps=3, draft_model_path=llama_nextn_path)
    want, _ = run(engine, max_new_tokens=29)
    engine.graphs = CudaGraphs(engine, capture=False)
    got, _ = run(engine, max_new_tokens=29)
    assert got == want


def test_graph_program_stops_on_max_tokens_and_discards_the_extra_step(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=3)
    engine.graphs = CudaGraphs(engine, capture=False)
    for n in (1, 2, 5, 9):
        tokens, _ = run(engine, max_new_tokens=n)
        assert len(tokens) == n


def test_graph_program_simulated_accept(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=5, simulate_accept_len=3.25)
    engine.graphs = CudaGraphs(engine, capture=False)
    tokens, verify = run(engine, max_new_tokens=400)
    assert abs(len(tokens) / verify - 3.25) < 0.15
    assert abs(engine.spec_stats.avg_accept_length - 3.25) < 0.15


def test_graph_program_simulated_accept_dspark(ling_path, ckpt_root):
    """A DSpark drafter has no num_steps: the simulated counts come from its gamma (num_draft_tokens - 1). The
    census of a DSpark step on dummy weights failed on this (H200, 2026-11-30)."""
    from baton.config import load_model_config
    from baton.spec.dspark_ckpt import write_random_dspark_draft

    draft = str(ckpt_root / "graph_sim_dspark")
    write_random_dspark_draft(load_model_config(ling_path), draft, seed=3, block_size=8, num_layers=1,
                              markov_rank=16, with_heads=True)
    engine = make_engine(ling_path, algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=9,
                         simulate_accept_len=2.9)
    engine.graphs = CudaGraphs(engine, capture=False)
    tokens, verify = run(engine, max_new_tokens=400)
    assert abs(len(tokens) / verify - 2.9) < 0.15
    assert abs(engine.spec_stats.avg_accept_length - 2.9) < 0.15


@pytest.mark.parametrize("algorithm", ["DSPARK", "DFLASH"])
def test_graph_program_equals_eager_dspark(ling_path, ckpt_root, algorithm):
    from baton.config import load_model_config
    from baton.spec.dspark_ckpt import write_random_dspark_draft

    draft = str(ckpt_root / f"graph_{algorithm.lower()}")
    write_random_dspark_draft(load_model_config(ling_path), draft, seed=3, block_size=4, num_layers=1,
                              markov_rank=16, with_heads=True)
    engine = make_engine(ling_path, algorithm=algorithm, draft_model_path=draft, num_draft_tokens=5)
    want, want_verify = run(engine, max_new_tokens=31)
    engine.graphs = CudaGraphs(engine, capture=False)
    got, got_verify = run(engine, max_new_tokens=31)
    assert got == want
    assert got_verify == want_verify
