"""Timing of the attention kernels on CUDA: GQA flash-decoding (SmolLM2 shapes), MLA decode (Ling shapes) and
the fused RoPE + cache write, against the plain-PyTorch paths.

Each figure is CUDA-graph replay time per call (graph node gaps included, as in the decode step), the median
of ``reps`` replays of one graph that calls the op once per cache copy. The copies are disjoint row ranges of
one buffer sized to hold several L2s of context, so every call reads its rows from HBM as a layer would. The
cache length S is the capture-time maximum (the largest context) for every context, as in the engine.
GB/s counts the cache bytes of the valid context (K and V, or the 576-wide latent rows) only.

Run: ``python -m benchmarks.ops.bench_attention`` (prints a table, then one JSON line).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from benchmarks.ops.timing import cold_copies, graph_time_us

L2_FLUSH_BYTES = 256 << 20  # several H200 L2s (60 MB) of cache rows per graph
MAX_COPIES = 512


def _time_graph(fns: list[Callable[[], object]], reps: int) -> float:
    """Median µs per call of one CUDA graph that calls each of ``fns`` once."""
    return graph_time_us(fns, reps)


def _num_copies(bytes_read: int) -> int:
    return cold_copies(bytes_read, L2_FLUSH_BYTES, 1, MAX_COPIES)


def _cache_views(row_shape: tuple[int, ...], ctx: int, max_len: int, copies: int, dtype: torch.dtype
                 ) -> list[torch.Tensor]:
    """``copies`` views [max_len, *row_shape] of one buffer whose first ``ctx`` rows are disjoint."""
    buf = torch.randn(copies * ctx + max_len, *row_shape, device="cuda", dtype=dtype)
    return [buf[i * ctx : i * ctx + max_len] for i in range(copies)]


def _row(kernel: str, t: int, ctx: int, max_len: int, bytes_read: int, us: float, **extra) -> dict:
    return dict(kernel=kernel, T=t, ctx=ctx, S=max_len, us=round(us, 2), GBps=round(bytes_read / us / 1e3, 1),
                bytes=bytes_read, **extra)


def bench_gqa(ctx: int, t: int, max_len: int, reps: int, naive: bool, splits: int | None = None,
              num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
              dtype: torch.dtype = torch.bfloat16, **config) -> list[dict]:
    """One GQA row; ``config`` (block_n, num_warps, num_stages) goes to the op."""
    from baton.ops.attention import naive as attn_naive
    from baton.ops.attention import triton as attn_triton

    bytes_read = ctx * num_kv_heads * head_dim * 2 * torch.finfo(dtype).bits // 8
    copies = _num_copies(bytes_read)
    ks = _cache_views((num_kv_heads, head_dim), ctx, max_len, copies, dtype)
    vs = _cache_views((num_kv_heads, head_dim), ctx, max_len, copies, dtype)
    q = torch.randn(t, num_heads, head_dim, device="cuda", dtype=dtype)  # [T, H, D]
    pos = torch.arange(ctx - t, ctx, device="cuda")
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    fns = [lambda k=k, v=v: attn_triton.attention(q, k, v, pos, scale, out=out, num_splits=splits, **config)
           for k, v in zip(ks, vs, strict=True)]
    used = splits or attn_triton.default_num_splits(t, num_heads, num_kv_heads, head_dim, max_len)
    rows = [_row("gqa", t, ctx, max_len, bytes_read, _time_graph(fns, reps), splits=used, **config)]
    if naive:
        ref = [lambda k=k, v=v: attn_naive.attention(q, k[:ctx], v[:ctx], pos, scale)
               for k, v in zip(ks[:8], vs[:8], strict=True)]
        rows[0]["naive_us"] = round(_time_graph(ref, reps), 2)
    return rows


def bench_mla(ctx: int, t: int, max_len: int, reps: int, naive: bool, splits: int | None = None,
              num_heads: int = 32, kv_lora_rank: int = 512, rope_dim: int = 64,
              dtype: torch.dtype = torch.bfloat16, **config) -> list[dict]:
    """One MLA row; ``config`` (block_m, block_n, num_warps, num_stages) overrides the defaults."""
    from baton.ops.attention.triton import num_kv_splits
    from baton.ops.mla_decode import naive as mla_naive
    from baton.ops.mla_decode import triton as mla_triton

    width = kv_lora_rank + rope_dim
    bytes_read = ctx * width * torch.finfo(dtype).bits // 8
    copies = _num_copies(bytes_read)
    lats = _cache_views((width,), ctx, max_len, copies, dtype)
    q_lat = torch.randn(t, num_heads, kv_lora_rank, device="cuda", dtype=dtype)  # [T, H, C]
    q_rope = torch.randn(t, num_heads, rope_dim, device="cuda", dtype=dtype)  # [T, H, R]
    pos = torch.arange(ctx - t, ctx, device="cuda")
    scale = 192**-0.5
    out = torch.empty_like(q_lat)
    fns = [lambda lat=lat: mla_triton.mla_decode(q_lat, q_rope, lat, pos, kv_lora_rank, scale, out=out,
                                                 num_splits=splits, **config) for lat in lats]
    cfg = {**mla_triton.mla_default_config(t * num_heads, kv_lora_rank), **config}
    used = splits or num_kv_splits(max_len, -(-t * num_heads // cfg["block_m"]))
    rows = [_row("mla", t, ctx, max_len, bytes_read, _time_graph(fns, reps), splits=used, **cfg)]
    if naive:
        ref = [lambda lat=lat: mla_naive.mla_decode(q_lat, q_rope, lat[:ctx], pos, kv_lora_rank, scale)
               for lat in lats[:8]]
        rows[0]["naive_us"] = round(_time_graph(ref, reps), 2)
    return rows


def bench_rope(t: int, reps: int, mla: bool, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """rope_and_cache_write at SmolLM2 (H=9, Hkv=3, D=64, rotate-half) or Ling MLA (H=32, rope 64 inside
    q [T, 32, 192], latent [c 512 | k_rope 64], interleaved) shapes, Triton vs the PyTorch fallback."""
    from baton.ops.attention import _rope_and_cache_write_torch
    from baton.ops.attention.rope_cache import rope_and_cache_write

    max_len = 4096
    pos = torch.arange(100, 100 + t, device="cuda")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float64) / 64)).float()
    if mla:
        q = torch.randn(t, 32, 192, device="cuda", dtype=dtype)[..., 128:]  # [T, H, 64] view
        kv = torch.randn(t, 576, device="cuda", dtype=dtype)
        latent = torch.zeros(max_len, 576, device="cuda", dtype=dtype)
        args = (q, kv[:, 512:], kv[:, :512], pos, inv_freq, latent[:, 512:], latent[:, :512], True)
    else:
        q = torch.randn(t, 9, 64, device="cuda", dtype=dtype)
        k, v = torch.randn(t, 3, 64, device="cuda", dtype=dtype), torch.randn(t, 3, 64, device="cuda", dtype=dtype)
        kc = torch.zeros(max_len, 3, 64, device="cuda", dtype=dtype)  # [S, Hkv, D]
        vc = torch.zeros_like(kc)
        args = (q, k, v, pos, inv_freq, kc, vc, False)
    us = _time_graph([lambda: rope_and_cache_write(*args)] * 16, reps)
    torch_us = _time_graph([lambda: _rope_and_cache_write_torch(*args)] * 16, reps)
    return [dict(kernel="rope_mla" if mla else "rope_gqa", T=t, us=round(us, 2), torch_us=round(torch_us, 2))]


def bench_attention(contexts: tuple[int, ...] = (512, 8192, 32768), tokens: tuple[int, ...] = (1, 6, 16),
                    reps: int = 20, naive: bool = True, sweep: bool = True) -> list[dict]:
    """All the rows: GQA and MLA at every (context, T) with the default split policy, then (``sweep``) other
    split counts and MLA row tiles at the longest context, then the RoPE + cache write kernel."""
    assert torch.cuda.is_available(), "bench_attention needs CUDA"
    import triton

    max_len = max(contexts)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | S={max_len}")
    rows: list[dict] = []
    for t in tokens:
        for ctx in contexts:
            rows += bench_gqa(ctx, t, max_len, reps, naive)
            rows += bench_mla(ctx, t, max_len, reps, naive)
            for row in rows[-2:]:
                print(row)
    if sweep:
        for t in tokens:
            for splits in (16, 32, 64, 128):
                rows += bench_gqa(max_len, t, max_len, reps, False, splits=splits)
                rows += bench_mla(max_len, t, max_len, reps, False, splits=splits)
                for row in rows[-2:]:
                    print("sweep", row)
            if t > 1:
                rows += bench_mla(max_len, t, max_len, reps, False, block_m=16)
                print("sweep", rows[-1])
    for t in tokens:
        for mla in (False, True):
            rows += bench_rope(t, reps, mla)
            print(rows[-1])
    print(json.dumps(dict(bench="attention", device=torch.cuda.get_device_name(), rows=rows)))
    return rows


if __name__ == "__main__":
    bench_attention()
