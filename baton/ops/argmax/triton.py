"""Vocabulary-parallel argmax on CUDA, in two kernels: each program takes the maximum of one slice of a row (and its
first index), then one program per row reduces the slices' pairs. torch's argmax over a [1, 49152] row runs as
one block, on one SM (docs/performance.md has its time); here every SM takes a slice.

The partial kernel can add the DSpark Markov bias W2 W1[prev] (rank r) to its slice on the fly, reading ``prev``
from device memory: the greedy chain of a block is then 2 kernels a slot, with no host sync, inside a CUDA
graph (``markov_greedy``). Ties go to the lowest index, as torch's argmax; rows must hold no NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024  # a program's slice: 4 KB of fp32 logits (+ 32 KB of a rank-16 bf16 W2)
NUM_WARPS = 4


@triton.jit
def _partial_kernel(x_ptr, stride_xm, prev_ptr, w1_ptr, w2_ptr, val_ptr, idx_ptr, V, P,
                    HAS_BIAS: tl.constexpr, R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (p, m): max and first argmax of row m's slice p -> val[m, p], idx[m, p]."""
    p = tl.program_id(0)
    m = tl.program_id(1)
    offs = p * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    x = tl.load(x_ptr + m * stride_xm + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_BIAS:
        prev = tl.load(prev_ptr).to(tl.int64)
        r = tl.arange(0, R)
        e = tl.load(w1_ptr + prev * R + r).to(tl.float32)  # W1[prev] [R]
        w = tl.load(w2_ptr + offs[:, None].to(tl.int64) * R + r[None, :], mask=mask[:, None], other=0.0)
        bias = tl.sum(w.to(tl.float32) * e[None, :], axis=1)
        bias = bias.to(w2_ptr.dtype.element_ty).to(tl.float32)  # the linear's output dtype, as the reference
        x = tl.where(mask, x + bias, float("-inf"))
    best = tl.max(x, axis=0)
    first = tl.min(tl.where((x == best) & mask, offs, V), axis=0)
    tl.store(val_ptr + m * P + p, best)
    tl.store(idx_ptr + m * P + p, first)


@triton.jit
def _reduce_kernel(val_ptr, idx_ptr, out_ptr, P, V, BLOCK_P: tl.constexpr):
    """Program m: the pair with the largest value (lowest index among ties) of row m's P slices -> out[m]."""
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < P
    v = tl.load(val_ptr + m * P + offs, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + m * P + offs, mask=mask, other=V)
    best = tl.max(v, axis=0)
    tok = tl.min(tl.where((v == best) & mask, i, V), axis=0)
    tok = tl.minimum(tok, V - 1)  # only a NaN row matches no slice: keep the id in range
    tl.store(out_ptr + m, tok.to(tl.int64))


def _workspace(m: int, v: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    p = triton.cdiv(v, BLOCK_V)
    return (torch.empty(m, p, device=device, dtype=torch.float32),
            torch.empty(m, p, device=device, dtype=torch.int32), p)


def _launch(x: torch.Tensor, out: torch.Tensor, prev: torch.Tensor | None, w1: torch.Tensor | None,
            w2: torch.Tensor | None, vals: torch.Tensor, idxs: torch.Tensor, p: int) -> None:
    m, v = x.shape
    has_bias = w2 is not None
    r = w2.shape[1] if has_bias else 1
    dummy = x  # an unused pointer argument when there is no bias
    _partial_kernel[(p, m)](x, x.stride(0), prev if has_bias else dummy, w1 if has_bias else dummy,
                            w2 if has_bias else dummy, vals, idxs, v, p, HAS_BIAS=has_bias, R=r,
                            BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    _reduce_kernel[(m,)](vals, idxs, out, p, v, BLOCK_P=max(triton.next_power_of_2(p), 16), num_warps=1)


def supports(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] > 0 and x.stride(1) == 1 and x.dtype in (torch.float32, torch.bfloat16,
                                                                                 torch.float16)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] (contiguous rows) -> [M] int64."""
    m, v = x.shape
    out = torch.empty(m, device=x.device, dtype=torch.int64)
    vals, idxs, p = _workspace(m, v, x.device)
    _launch(x, out, None, None, None, vals, idxs, p)
    return out


def markov_greedy(base_logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """naive.markov_greedy in 2 kernels a slot: slot k's partial kernel reads prev from device memory (the anchor,
    then token k-1 as the reduce kernel of slot k-1 wrote it)."""
    gamma, v = base_logits.shape
    if w1.shape != w2.shape or w1.shape[0] < v or w1.shape[1] & (w1.shape[1] - 1):
        raise ValueError(f"markov_greedy: W1 {tuple(w1.shape)} and W2 {tuple(w2.shape)} must be [V >= {v}, r], "
                         "r a power of two")
    tokens = torch.empty(gamma, device=base_logits.device, dtype=torch.int64)
    vals, idxs, p = _workspace(1, v, base_logits.device)
    w1, w2 = w1.contiguous(), w2.contiguous()
    prev = anchor.reshape(1)
    for k in range(gamma):
        _launch(base_logits[k : k + 1], tokens[k : k + 1], prev, w1, w2, vals, idxs, p)
        prev = tokens[k : k + 1]
    return tokens
