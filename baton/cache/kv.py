"""Preallocated attention caches for one sequence: the GQA KV cache (Llama) and the MLA latent cache (Ling).

Both are written at absolute positions taken from a device tensor; a rejected speculative suffix needs no
rollback because only positions below the committed length are ever read as context, and the next
forward overwrites the rest.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.k = torch.zeros(max_len, num_kv_heads, head_dim, dtype=dtype, device=device)  # [S, Hkv, D]
        self.v = torch.zeros(max_len, num_kv_heads, head_dim, dtype=dtype, device=device)  # [S, Hkv, D]

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(0, positions, k.to(self.k.dtype))
        self.v.index_copy_(0, positions, v.to(self.v.dtype))

    def view(self, kv_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_len is None:
            return self.k, self.v
        return self.k[:kv_len], self.v[:kv_len]

    def reset(self) -> None:
        """Nothing to clear: positions at or past the committed length are never read before written."""

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class MLACache:
    """Per token ``[RMSNorm(c_kv) (kv_lora_rank) | RoPE(k_rope) (rope_dim)]``: 576 values for Ling."""

    def __init__(self, max_len: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.latent = torch.zeros(max_len, kv_lora_rank + rope_dim, dtype=dtype, device=device)  # [S, 576]

    def write(self, positions: torch.Tensor, latent: torch.Tensor) -> None:
        self.latent.index_copy_(0, positions, latent.to(self.latent.dtype))

    def view(self, kv_len: int | None) -> torch.Tensor:
        return self.latent if kv_len is None else self.latent[:kv_len]

    def reset(self) -> None:
        """As for KVCache: stale positions are never read."""

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes
