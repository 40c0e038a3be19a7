"""Reference argmaxes in plain PyTorch: over the rows of a logits tensor, and the greedy DSpark Markov chain."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] -> [M] int64: the index of each row's maximum, the lowest one among ties."""
    return x.argmax(-1)


def markov_greedy(base_logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The greedy Markov chain of a DSpark block: token_k = argmax(U_k + W2 W1[prev_k]), prev_0 = the anchor, prev_k
    = token_{k-1}. base_logits [gamma, V] (U), anchor [1] int64, w1 [V, r] (embedding), w2 [V, r] (the rank -> V
    linear's weight) -> tokens [gamma] int64. The bias is rounded to the weights' dtype before the add, as
    ``MarkovHead.bias`` (a linear in the model dtype) does."""
    prev = anchor.reshape(1)
    tokens = []
    for k in range(base_logits.shape[0]):
        bias = F.linear(w1[prev], w2).float()  # [1, V]
        tok = (base_logits[k : k + 1].float() + bias).argmax(-1)
        tokens.append(tok)
        prev = tok
    return torch.cat(tokens)
