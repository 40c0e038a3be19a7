"""The vocabulary-parallel argmax and the greedy Markov chain (baton/ops/argmax/triton.py) against the PyTorch
reference. Without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from baton.models.dspark import MarkovHead  # noqa: E402
from baton.ops.argmax import naive  # noqa: E402
from baton.speculative.dspark import markov_propose  # noqa: E402
from baton.types import SamplingParams  # noqa: E402
from tests.ops.triton_support import load_triton_module  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
am = load_triton_module("baton.ops.argmax.triton")


@pytest.mark.parametrize("m,v", [(1, 5000), (3, 2048), (4, 49152), (9, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch(m, v, dtype):
    gen = torch.Generator().manual_seed(m * 7 + v)
    x = torch.randn(m, v, generator=gen).to(DEV, dtype)
    assert torch.equal(am.argmax_rows(x).cpu(), naive.argmax_rows(x).cpu())


def test_ties_go_to_the_lowest_index_across_and_within_slices():
    v = 3 * am.BLOCK_V + 17
    x = torch.zeros(3, v)
    x[0, [5, am.BLOCK_V + 3, 2 * am.BLOCK_V]] = 2.0  # the max in three slices: the first wins
    x[1, [v - 1, v - 2]] = 1.0  # both in the ragged last slice
    x[2] = float("-inf")  # no finite value: index 0, as torch
    got = am.argmax_rows(x.to(DEV)).cpu()
    assert got.tolist() == [5, v - 2, 0] == naive.argmax_rows(x).tolist()


def test_argmax_of_a_row_view_with_a_stride():
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)).to(DEV)
    view = x[1:3, :2500]  # rows of stride 3000
    assert torch.equal(am.argmax_rows(view).cpu(), view.cpu().argmax(-1))


def _head(v: int, r: int, dtype, seed: int):
    head = MarkovHead(v, r, device=DEV, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.w1.weight.copy_(torch.randn(v, r, generator=gen))
        head.w2.weight.copy_(torch.randn(v, r, generator=gen) * 0.5)
    return head


@pytest.mark.parametrize("gamma,v,r", [(1, 1500, 16), (8, 4096, 16), (5, 3000, 4)])
def test_markov_greedy_matches_the_reference_and_the_eager_proposal(gamma, v, r):
    head = _head(v, r, torch.float32, seed=gamma)
    gen = torch.Generator().manual_seed(10 + gamma)
    base = torch.randn(gamma, v, generator=gen).to(DEV)
    anchor = torch.tensor([7], device=DEV)
    with torch.no_grad():
        got = am.markov_greedy(base, anchor, head.w1.weight, head.w2.weight)
        ref = naive.markov_greedy(base, anchor, head.w1.weight, head.w2.weight)
        eager = markov_propose(base, anchor, head, SamplingParams(temperature=0.0), None).tokens
    assert torch.equal(got.cpu(), ref.cpu())
    assert torch.equal(ref.cpu(), eager.cpu())  # the reference is the eager path's greedy chain


def test_markov_greedy_bf16_rounds_the_bias_like_the_linear():
    head = _head(2048, 16, torch.bfloat16, seed=3)
    base = torch.randn(6, 2048, generator=torch.Generator().manual_seed(4)).to(DEV)
    anchor = torch.tensor([11], device=DEV)
    with torch.no_grad():
        got = am.markov_greedy(base, anchor, head.w1.weight, head.w2.weight)
        ref = naive.markov_greedy(base, anchor, head.w1.weight, head.w2.weight)
    assert torch.equal(got.cpu(), ref.cpu())


def test_markov_greedy_refuses_mismatched_heads():
    base = torch.randn(2, 100, device=DEV)
    with pytest.raises(ValueError, match="power of two"):
        am.markov_greedy(base, torch.tensor([0], device=DEV), torch.randn(100, 6, device=DEV),
                         torch.randn(100, 6, device=DEV))


def test_dispatcher_takes_the_reference_on_cpu_tensors():
    from baton.ops import argmax as ops

    x = torch.randn(2, 300)
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
