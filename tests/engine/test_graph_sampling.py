"""Sampled requests on the step program, run uncaptured on CPU (the same step bodies the GPU captures): the
tensor-parameter logits processing equals the reference, the graph-safe sampler draws from the given
distribution, a seed repeats a request exactly, and the sampled verify of NEXTN and DSpark (argmax drafts, the
rejection rule with a one-hot q) leaves the output distribution that of plain sampling."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from baton.config import ServerArgs, SpecConfig
from baton.engine.engine import Engine
from baton.ops.sampling import logits_to_probs, logits_to_probs_t, sample_from_probs
from tests.speculative.test_spec_core import PROMPT, run


def _t(x, dtype=torch.float32):
    return torch.tensor([x], dtype=dtype)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0),
                                                           (0.9, -1, 0.8, 0.0), (1.3, 20, 0.9, 0.05),
                                                           (0.5, -1, 1.0, 0.2)])
def test_tensor_parameters_equal_the_reference(temperature, top_k, top_p, min_p):
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(0)) * 3
    want = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    got = logits_to_probs_t(logits, _t(temperature), _t(top_k, torch.long), _t(top_p), _t(min_p))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_graph_safe_sampler_draws_from_the_distribution():
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0]]).repeat(20000, 1)
    tokens = sample_from_probs(probs, torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert freq[4] == 0  # a zero-probability token is never drawn
    assert (freq - probs[0]).abs().sum() < 0.03


def _graph_engine(path: str, **spec) -> Engine:
    return Engine(ServerArgs(model_path=path, device="cpu", dtype="float32", context_length=256,
                             spec=SpecConfig(**{"adaptive": False, **spec})))


@pytest.fixture(scope="module")
def dspark_path(ling_path, ckpt_root):
    from baton.config import load_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft

    draft = str(ckpt_root / "sampling_dspark")
    write_random_dspark_draft(load_model_config(ling_path), draft, seed=3, block_size=4, markov_rank=16)
    return draft


@pytest.mark.parametrize("spec", [{}, {"algorithm": "NEXTN", "num_steps": 3}, "dspark"])
def test_a_seed_repeats_a_sampled_request_on_the_graph_program(ling_path, dspark_path, spec):
    if spec == "dspark":
        spec = {"algorithm": "DSPARK", "draft_model_path": dspark_path, "num_draft_tokens": 5}
    engine = _graph_engine(ling_path, **spec)
    a, verify = run(engine, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    b, _ = run(engine, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    c, _ = run(engine, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=12)
    assert a == b and len(a) == 24
    assert a != c
    assert (verify > 0) == bool(spec)
    assert engine.program._sampled is not None  # the sampled bodies ran


SEEDS = 400
DIST_SP = dict(temperature=1.0, top_k=2, max_new_tokens=3)  # top-k 2: 8 outcomes of three tokens


def _distribution(engine) -> Counter:
    return Counter(tuple(run(engine, PROMPT[:6], seed=s, **DIST_SP)[0]) for s in range(SEEDS))


@pytest.fixture(scope="module")
def plain_distribution(ling_path) -> Counter:
    return _distribution(_graph_engine(ling_path))


@pytest.mark.parametrize("algorithm", ["NEXTN", "DSPARK"])
def test_sampled_spec_on_the_graph_program_keeps_the_plain_distribution(ling_path, dspark_path, plain_distribution,
                                                                        algorithm):
    """The first three sampled tokens over many seeds: the verify (rejection against argmax drafts) must give the
    distribution plain sampling gives (total variation under 0.12; a verify that accepts every draft the target
    allows fails this)."""
    spec = ({"algorithm": "NEXTN", "num_steps": 2} if algorithm == "NEXTN"
            else {"algorithm": "DSPARK", "draft_model_path": dspark_path, "num_draft_tokens": 3})
    p, q = plain_distribution, _distribution(_graph_engine(ling_path, **spec))
    tv = 0.5 * sum(abs(p[x] - q[x]) for x in set(p) | set(q)) / SEEDS
    assert len(p) >= 4 and tv < 0.12, (tv, p, q)
