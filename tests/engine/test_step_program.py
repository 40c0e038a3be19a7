"""The step program on CPU (uncaptured: the bodies the GPU captures): it stops exactly at max tokens and drops the
step in flight, simulated acceptance averages what it is told, slicing the cache where the host knows ``pos`` is
the same program as attending to the whole cache with a position mask, and the verify honours ``num_drafts``.
The captured version is checked against it on the GPU (tests/engine/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from baton.speculative.verify import greedy_verify_tokens, rejection_verify
from tests.speculative.conftest import make_engine
from tests.speculative.test_spec_core import run


def test_step_program_runs_uncaptured_on_the_cpu(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=2)
    assert not engine.program.capture and engine.program.relay.slice_cache


@pytest.mark.parametrize("spec", [{}, {"algorithm": "NEXTN", "num_steps": 1}, {"algorithm": "NEXTN", "num_steps": 4}])
def test_sliced_cache_equals_the_whole_cache_with_a_mask(ling_path, spec):
    """On CUDA (captured or not) attention covers the whole preallocated cache with a position mask; on the CPU it
    slices the rows below pos: the same tokens and accept counts."""
    engine = make_engine(ling_path, **spec)
    want, want_verify = run(engine, max_new_tokens=33)
    engine.program.relay.slice_cache = False
    got, got_verify = run(engine, max_new_tokens=33)
    assert got == want and got_verify == want_verify


def test_sliced_cache_equals_the_whole_cache_llama_dspark(llama_path, ckpt_root):
    from baton.config import load_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft

    draft = str(ckpt_root / "step_dspark_llama")
    write_random_dspark_draft(load_model_config(llama_path), draft, seed=5, block_size=4, num_layers=1,
                              markov_rank=16, with_heads=True)
    engine = make_engine(llama_path, algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=5)
    want, want_verify = run(engine, max_new_tokens=29)
    engine.program.relay.slice_cache = False
    got, got_verify = run(engine, max_new_tokens=29)
    assert got == want and got_verify == want_verify


def test_step_program_stops_on_max_tokens_and_discards_the_extra_step(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=3)
    for n in (1, 2, 5, 9):
        tokens, _ = run(engine, max_new_tokens=n)
        assert len(tokens) == n


def test_step_program_simulated_accept(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=5, simulate_accept_len=3.25)
    tokens, verify = run(engine, max_new_tokens=400)
    assert abs(len(tokens) / verify - 3.25) < 0.15
    assert abs(engine.spec_stats.avg_accept_length - 3.25) < 0.15


def test_step_program_simulated_accept_dspark(ling_path, ckpt_root):
    """A DSpark drafter has no num_steps: the simulated counts come from its gamma (num_draft_tokens - 1). The
    census of a DSpark step on dummy weights failed on this (H200, 2026-11-30)."""
    from baton.config import load_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft

    draft = str(ckpt_root / "graph_sim_dspark")
    write_random_dspark_draft(load_model_config(ling_path), draft, seed=3, block_size=8, num_layers=1,
                              markov_rank=16, with_heads=True)
    engine = make_engine(ling_path, algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=9,
                         simulate_accept_len=2.9)
    tokens, verify = run(engine, max_new_tokens=400)
    assert abs(len(tokens) / verify - 2.9) < 0.15
    assert abs(engine.spec_stats.avg_accept_length - 2.9) < 0.15


@pytest.mark.parametrize("limit", [0, 1, 2, 4])
def test_greedy_verify_limit_is_a_shorter_draft(limit):
    """Accepting at most ``limit`` of k drafts is verifying the first ``limit`` only: same count, same bonus."""
    drafts = torch.tensor([4, 7, 1, 9])
    for predict in (torch.tensor([4, 7, 1, 9, 3]), torch.tensor([4, 7, 2, 9, 3]), torch.tensor([5, 7, 1, 9, 3])):
        got = greedy_verify_tokens(drafts, predict, torch.tensor([limit]))
        want = greedy_verify_tokens(drafts[:limit], predict[: limit + 1])
        assert int(got.num_accepted) == int(want.num_accepted)
        assert int(got.bonus) == int(want.bonus)


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_rejection_verify_limit_is_a_shorter_draft(limit):
    """With a limit the sampled rule draws exactly what verifying the prefix alone draws (same uniforms)."""
    vocab, k = 6, 3
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        drafts = torch.randint(0, vocab, (k,), generator=g)
        p = torch.softmax(torch.randn(k + 1, vocab, generator=g), -1)
        seed = 100 + trial
        got = rejection_verify(drafts, None, p, torch.Generator().manual_seed(seed), torch.tensor([limit]))
        # the reference draws k uniforms too (the rule draws one per draft slot), then verifies the prefix
        ref_gen = torch.Generator().manual_seed(seed)
        u = torch.rand(k, generator=ref_gen)
        a = 0
        while a < limit and u[a] < p[a, drafts[a]]:
            a += 1
        assert int(got.num_accepted) == a
        if a == limit:  # stopped by the limit: the next token is a draw from p itself, never the unverified draft's
            assert p[a, int(got.bonus)] > 0
        else:
            assert int(got.bonus) != int(drafts[a]) or p[a, drafts[a]] == 1
