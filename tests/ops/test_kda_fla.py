"""fla-core's chunk_kda (the CUDA prefill path; BATON_FLA=0 turns it off) against baton's PyTorch chunked form."""

from __future__ import annotations

import pytest
import torch

from baton.ops import kda
from baton.ops.kda import naive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("t", [1, 63, 64, 200, 1000])
def test_fla_chunk_matches_reference(t, monkeypatch):
    # not importorskip: on a CUDA machine a broken fla-core (once: no einops) is a 15x slower prefill, so it fails
    assert kda._fla_chunk() is not None, "fla-core's chunk_kda does not import (see the warning logged above)"
    monkeypatch.setenv("BATON_FLA", "1")
    gen = torch.Generator(device="cuda").manual_seed(t)
    h, d = 4, 128
    q, k, v = (torch.randn(t, h, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    f = torch.randn(t, h, d, device="cuda", generator=gen)
    A_log = torch.randn(h, device="cuda", generator=gen) * 0.5
    dt_bias = torch.randn(h * d, device="cuda", generator=gen) * 0.1
    g = naive.kda_gate(f, A_log, dt_bias, -5.0)  # [T, H, K] fp32, log-space decay with the lower bound
    beta = torch.sigmoid(torch.randn(t, h, device="cuda", generator=gen))
    s0 = torch.randn(h, d, d, device="cuda", generator=gen) * 0.1
    want_o, want_s = naive.kda_chunk(q, k, v, g, beta, s0)
    got_o, got_s = kda.kda_chunk(q, k, v, g, beta, s0, bounded_gate=True)
    assert got_o.shape == want_o.shape and got_s.shape == want_s.shape
    assert _rel(got_o, want_o) < 2e-2
    assert _rel(got_s, want_s) < 2e-2
    assert torch.equal(s0, s0.clone())  # the incoming state is not modified


def test_flag_off_takes_the_reference(monkeypatch):
    monkeypatch.setenv("BATON_FLA", "0")
    q = k = v = torch.randn(5, 2, 16, device="cuda")
    g = -torch.rand(5, 2, 16, device="cuda")
    beta = torch.rand(5, 2, device="cuda")
    o, s = kda.kda_chunk(q, k, v, g, beta, None)
    o2, s2 = naive.kda_chunk(q, k, v, g, beta, None)
    assert torch.equal(o, o2) and torch.equal(s, s2)
