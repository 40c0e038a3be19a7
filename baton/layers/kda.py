"""Kimi Delta Attention (KDA) as used in Ling-3.0: q/k/v projections through a short causal conv + SiLU,
L2-normalised q and k, a per-channel lower-bounded forget gate, the delta rule on an fp32 state, and a
gated RMSNorm on the output.

Prefill runs the chunked form; decode, draft and extend run the recurrence and update the persistent
state; verify runs the recurrence from the persistent state and stages each position's state instead.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.cache.state import KDAState
from baton.config import LingConfig
from baton.layers.context import ForwardContext
from baton.layers.linear import Linear
from baton.layers.norm import GatedRMSNorm
from baton.ops.kda import kda_chunk, kda_gate, kda_recurrent
from baton.ops.short_conv import short_conv
from baton.types import ForwardMode


class ShortConvWeight(nn.Module):
    """Holds a depthwise conv weight ``[D, 1, W]`` under the checkpoint's ``*_conv1d.weight`` name."""

    def __init__(self, dim: int, width: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1, width, device=device, dtype=dtype))


class KimiDeltaAttention(nn.Module):
    def __init__(self, layer_id: int, cfg: LingConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        d, h, k = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.head_dim = h, k
        self.proj_dim = p = h * k
        self.conv_width = cfg.short_conv_kernel_size
        self.lower_bound = cfg.kda_lower_bound if cfg.kda_safe_gate else None
        self.use_lora = not cfg.no_kda_lora
        kw = dict(device=device, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj = (Linear(d, p, **kw) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConvWeight(p, self.conv_width, **kw) for _ in range(3))
        if self.use_lora:
            self.f_a_proj, self.f_b_proj = Linear(d, k, **kw), Linear(k, p, **kw)
            self.g_a_proj, self.g_b_proj = Linear(d, k, **kw), Linear(k, p, **kw)
        else:
            self.f_proj, self.g_proj = Linear(d, p, **kw), Linear(d, p, **kw)
        self.b_proj = Linear(d, h, **kw)
        self.A_log = nn.Parameter(torch.empty(h, device=device, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(p, device=device, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(k, cfg.rms_norm_eps, **kw)
        self.o_proj = Linear(p, d, **kw)

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_lora:
            return self.f_b_proj(self.f_a_proj(x)), self.g_b_proj(self.g_a_proj(x))
        return self.f_proj(x), self.g_proj(x)

    def conv_weight(self) -> torch.Tensor:
        ws = [m.weight[:, 0, :] for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        return torch.cat(ws, dim=0)  # [3P, W]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, k, p = x.shape[0], self.num_heads, self.head_dim, self.proj_dim
        state: KDAState = ctx.cache[self.layer_id]
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3P]
        qkv, windows = short_conv(qkv, self.conv_weight(), state.conv)
        q, kk, v = (z.view(t, h, k) for z in qkv.split(p, dim=-1))
        f, gate = self._gates(x)
        g = kda_gate(f.view(t, h, k), self.A_log, self.dt_bias, self.lower_bound)  # [T, H, K] fp32
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, H]
        if ctx.mode is ForwardMode.PREFILL:
            o, final = kda_chunk(q, kk, v, g, beta, state.recurrent)
        elif ctx.stages_state:
            o, _, states = kda_recurrent(q, kk, v, g, beta, state.recurrent, return_states=True)
            state.stage(states, windows)
        else:
            o, final = kda_recurrent(q, kk, v, g, beta, state.recurrent)
        if not ctx.stages_state:
            state.recurrent.copy_(final)
            state.conv.copy_(windows[-1])
        o = self.o_norm(o, gate.view(t, h, k))
        return self.o_proj(o.reshape(t, p))

    def make_cache(self, max_len: int, dtype: torch.dtype, device, max_stage: int = 8) -> KDAState:
        return KDAState(self.num_heads, self.head_dim, self.head_dim, 3 * self.proj_dim, self.conv_width,
                        max_stage, dtype, device)
