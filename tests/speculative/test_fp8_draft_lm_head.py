"""``--enable-fp8-draft-lm-head``: the drafters take their logits from an fp8 copy of the lm_head while the verify
keeps the model's, so greedy speculative output still equals plain decoding (CPU, fp32, every drafter)."""

from __future__ import annotations

import pytest
import torch

from baton.config import ServerArgs, SpecConfig, load_model_config
from baton.engine.engine import Engine
from baton.ops.fp8_linear import naive
from tests.speculative.test_spec_core import run


def _engine(path: str, **spec) -> Engine:
    return Engine(ServerArgs(model_path=path, device="cpu", context_length=512, enable_fp8_draft_lm_head=True,
                             spec=SpecConfig(**{"adaptive": False, **spec})))


@pytest.fixture(scope="module")
def random_dspark_llama(ckpt_root, llama_path):
    from baton.models.dspark_checkpoint import write_random_dspark_draft

    out = str(ckpt_root / "random_dspark_llama_fp8_head")
    write_random_dspark_draft(load_model_config(llama_path), out, seed=11, block_size=8, markov_rank=16)
    return out


def test_draft_logits_come_from_the_fp8_copy(ling_path):
    engine = _engine(ling_path, algorithm="NEXTN", num_steps=3)
    model = engine.model
    q, s = model.draft_lm_head_fp8
    assert q.dtype == torch.float8_e4m3fn and q.shape == model.lm_head_weight.shape
    assert model.draft_lm_head_bytes() == q.nbytes + s.nbytes < model.lm_head_weight.nbytes
    h = torch.randn(2, model.lm_head_weight.shape[1])
    torch.testing.assert_close(model.compute_logits(h, draft=True), naive.fp8_linear(h, q, s))
    assert not torch.equal(model.compute_logits(h, draft=True), model.compute_logits(h))  # the verify's: unchanged
    assert torch.equal(model.greedy_tokens(h, draft=True), model.compute_logits(h, draft=True).argmax(-1))


@pytest.mark.parametrize("steps", [1, 3])
def test_nextn_greedy_equals_plain(plain, ling_path, steps):
    tokens, verify = run(_engine(ling_path, algorithm="NEXTN", num_steps=steps))
    assert tokens == plain["ling"] and verify > 0


def test_llama_nextn_and_dspark_greedy_equal_plain(plain, llama_path, llama_nextn_path, random_dspark_llama):
    assert run(_engine(llama_path, algorithm="EAGLE", num_steps=3, draft_model_path=llama_nextn_path))[0] \
        == plain["llama"]
    assert run(_engine(llama_path, algorithm="DSPARK", draft_model_path=random_dspark_llama,
                       num_draft_tokens=5))[0] == plain["llama"]


def test_without_speculation_nothing_is_made(llama_path):
    engine = Engine(ServerArgs(model_path=llama_path, device="cpu", context_length=512,
                               enable_fp8_draft_lm_head=True))
    assert engine.model.draft_lm_head_fp8 is None


def test_the_flag_parses():
    from baton.cli import build_parser, server_args_from

    ns = build_parser().parse_args(["generate", "hi", "--enable-fp8-draft-lm-head", "--speculative-algorithm", "none"])
    assert server_args_from(ns).enable_fp8_draft_lm_head is True


def test_sampled_requests_run(ling_path):
    """A sampled request drafts from the fp8 logits' distribution (q) and verifies against the target's: it runs
    and is reproducible with a seed."""
    engine = _engine(ling_path, algorithm="NEXTN", num_steps=3)
    a = run(engine, max_new_tokens=20, temperature=0.8, seed=7)[0]
    b = run(engine, max_new_tokens=20, temperature=0.8, seed=7)[0]
    assert a == b and len(a) == 20
