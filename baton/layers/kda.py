"""Kimi Delta Attention (KDA) as used in Ling-3.0: q/k/v projections through a short causal conv + SiLU,
L2-normalised q and k, a per-channel lower-bounded forget gate, the delta rule on an fp32 state, and a
gated RMSNorm on the output.

Prefill runs the chunked form; decode, draft and extend run the recurrence and update the persistent
state; verify runs the recurrence from the persistent state and stages each position's state instead.

Kernels of one non-prefill forward on CUDA, between the projections (``in_proj``, with KDA LoRA ``f_b_proj`` /
``g_b_proj``, and ``o_proj``, unchanged): ONE ``kda_recurrent_fused_kernel``, which runs the short conv + SiLU of
q|k|v with its window update or per-position staging, the L2 norms, gate, beta, the delta rule with its state
update or staging, and the output gated RMSNorm (in the epilogue of each head's last V-block). Before: three,
``short_conv_update_kernel``, the recurrence and, at every default ``block_v`` (BV < V), a separate
``gated_rms_norm_kernel``; over Ling-3.0-flash's 35 KDA layers 105 -> 35 launches a step (a NEXTN step's one
verify forward, or a plain decode step).

Under tensor parallelism heads are split (``num_attention_heads / tp`` per rank): q/k/v/f/g/b rows, the conv
channels, A_log and dt_bias are this rank's heads' (column-parallel), the recurrent and conv states hold only
those heads, o_norm is shared, and o_proj is row-parallel. With KDA LoRA the small f_a/g_a projections are
replicated and f_b/g_b are column-parallel.

Under ``--quantization fp8`` every projection (in_proj, f_b/g_b, o_proj) is fp8 with 128 x 128 block scales.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.cache.state import KDAState
from baton.config import LingConfig
from baton.layers.context import ForwardContext
from baton.layers.linear import ColumnParallelLinear, FusedLinear, RowParallelLinear, local_shard, shard_count
from baton.layers.norm import GatedRMSNorm, RMSNorm
from baton.ops.kda import kda_chunk, kda_gate, kda_recurrent_fused
from baton.ops.short_conv import short_conv, short_conv_update
from baton.types import ForwardMode


class FusedShortConv(nn.Module):
    """The q, k and v depthwise conv weights stacked: ``weight [3P, 1, W]`` (checkpoint: ``{q,k,v}_conv1d``)."""

    def __init__(self, dim: int, width: int, device=None, dtype=None) -> None:
        """``dim``: this rank's channels per projection."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3 * dim, 1, width, device=device, dtype=dtype))
        shard = local_shard(0)
        self.hf_row_splits = {"weight": [(f"{n}_conv1d.weight", dim, shard) for n in ("q", "k", "v")]}


class KimiDeltaAttention(nn.Module):
    # Decode / verify / draft / extend of at most this many rows: the short conv inside the recurrence kernel
    # (``kda_recurrent_fused`` with ``conv_weight``); more rows (or 0): the two calls (``short_conv_update``, then
    # the recurrence). Measured on the H200 over the whole fp8 Ling-3.0-flash step (benchmarks/results/
    # h200-2026-12-07-prefill-graph against h200-2026-12-02b's three launches a layer, census category KDA over
    # 35 layers): T = 1 197 us fused vs 190 (parity, 70 launches fewer); T = 6 1,126 vs 584; T = 17 2,972 vs
    # 2,224. So the verify keeps the two calls until the fused kernel's T > 1 tiles are tuned (bench_kda fused).
    fused_conv_max_tokens: int = 1

    def __init__(self, layer_id: int, cfg: LingConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        d, heads, k = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        full = heads * k  # the checkpoint's projection width
        self.num_heads = h = shard_count(heads, "num_attention_heads")  # this rank's heads
        self.head_dim = k
        self.proj_dim = p = h * k
        self.conv_width = cfg.short_conv_kernel_size
        self.lower_bound = cfg.kda_lower_bound if cfg.kda_safe_gate else None
        self.use_lora = not cfg.no_kda_lora
        kw = dict(device=device, dtype=dtype)
        fp8 = cfg.fp8_dense
        gates = [("f_a_proj", k), ("g_a_proj", k)] if self.use_lora else [("f_proj", full), ("g_proj", full)]
        # Everything that reads the normed input, in one projection.
        self.in_proj = FusedLinear(d, [("q_proj", full), ("k_proj", full), ("v_proj", full), *gates,
                                       ("b_proj", heads)], replicated=("f_a_proj", "g_a_proj"), fp8=fp8, **kw)
        if self.use_lora:
            self.f_b_proj = ColumnParallelLinear(k, full, fp8=fp8, **kw)
            self.g_b_proj = ColumnParallelLinear(k, full, fp8=fp8, **kw)
        gate_width = k if self.use_lora else p
        self._split = [3 * p, gate_width, gate_width, h]  # in_proj output: q|k|v, f, g, b
        self.conv1d = FusedShortConv(p, self.conv_width, **kw)
        self.A_log = nn.Parameter(torch.empty(h, device=device, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(p, device=device, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(k, cfg.rms_norm_eps, **kw)
        self.o_proj = RowParallelLinear(full, d, fp8=fp8, **kw)
        if local_shard(0) is not None:
            self.tp_shards = {"A_log": local_shard(0), "dt_bias": local_shard(0)}

    def forward(self, x: torch.Tensor, ctx: ForwardContext, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[residual +] o_proj(gated_norm(kda(norm(x))))``."""
        t, h, k, p = x.shape[0], self.num_heads, self.head_dim, self.proj_dim
        state: KDAState = ctx.cache[self.layer_id]
        y = self.in_proj.linear(x, None if norm is None else norm.weight, 1e-6 if norm is None else norm.eps)
        qkv, f, gate, b = y.split(self._split, dim=-1)
        if self.use_lora:
            f, gate = self.f_b_proj.linear(f), self.g_b_proj.linear(gate)
        conv_w = self.conv1d.weight[:, 0, :]  # [3P, W]
        if ctx.mode is ForwardMode.PREFILL:
            o = self._prefill(qkv, f, gate, b, conv_w, state, ctx.active_rows)
        else:
            staging = ctx.stages_state
            conv = {}
            if t <= self.fused_conv_max_tokens:  # raw q|k|v: the kernel runs the conv, updates / stages its window
                conv = dict(conv_weight=conv_w, conv_state=state.conv,
                            conv_windows=state.staged_conv if staging else None)
            else:
                qkv = short_conv_update(qkv, conv_w, state.conv, state.staged_conv if staging else None, not staging)
            q, kk, v = (z.view(t, h, k) for z in qkv.split(p, dim=-1))
            o = kda_recurrent_fused(q, kk, v, f.reshape(t, h, k), b, self.A_log, self.dt_bias, self.lower_bound,
                                    state.recurrent, None, state.staged_recurrent if staging else None,
                                    not staging, self.o_norm.weight, gate.reshape(t, h, k), self.o_norm.eps, **conv)
        return self.o_proj.project(o.reshape(t, p), residual)

    def _prefill(self, qkv, f, gate, b, conv_w, state: KDAState, active_rows: torch.Tensor | None = None):
        """The chunked (parallel) form over the whole prompt; updates the persistent state.

        ``active_rows`` (a device value, [1] or 0-d): a padded prefill (``baton.engine.prefill_graph``), whose rows
        from ``active_rows`` on are padding. They become no-ops of the recurrence (log-decay 0 and beta 0: the
        state passes through them unchanged, exactly), and the carried conv window is the one after the last real
        row, so the states after the call are those after ``active_rows`` tokens; the padding rows' outputs are
        computed and never used."""
        t, h, k, p = qkv.shape[0], self.num_heads, self.head_dim, self.proj_dim
        qkv, windows = short_conv(qkv, conv_w, state.conv)
        q, kk, v = (z.view(t, h, k) for z in qkv.split(p, dim=-1))
        g = kda_gate(f.reshape(t, h, k), self.A_log, self.dt_bias, self.lower_bound)  # [T, H, K] fp32
        beta = torch.sigmoid(b.float())  # [T, H]
        last = windows[-1]
        if active_rows is not None:
            n = active_rows.reshape(1)
            real = (torch.arange(t, device=g.device) < n).to(g.dtype)  # [T]: 1 for the prompt's rows
            g, beta = g * real[:, None, None], beta * real[:, None]
            last = windows.index_select(0, (n - 1).clamp(min=0))[0]
        o, final = kda_chunk(q, kk, v, g, beta, state.recurrent, bounded_gate=self.lower_bound is not None)
        state.recurrent.copy_(final)
        state.conv.copy_(last)
        return self.o_norm(o, gate.reshape(t, h, k))

    def make_cache(self, max_len: int, dtype: torch.dtype, device, max_stage: int = 8) -> KDAState:
        return KDAState(self.num_heads, self.head_dim, self.head_dim, 3 * self.proj_dim, self.conv_width,
                        max_stage, dtype, device)
