"""Ling's MoE block: sigmoid router with an expert_bias used only for selection, group-limited top-k,
renormalised weights times routed_scaling_factor, fused routed experts and an unscaled shared expert,
each with its own post-SiLU SwiGLU clamp.

Shared experts fusion (SGLang's name; the default where ``LingConfig.shared_experts_fused``): the shared expert
has a routed expert's shape and format in Ling-3.0, so it is stacked as one more expert, id ``E`` (=
num_experts), of ``experts.w13 [E+1, 2I, d]`` / ``experts.w2 [E+1, d, I]`` (and their fp8 scales), and the router
appends ``(E, 1.0)`` to every row's top-k: the routed kernels compute it as a pair of weight 1 (not scaled by
routed_scaling_factor), with its own SwiGLU clamp (``shared_limit``). That saves the separate shared MLP's two
GEMM launches per MoE layer in every decode step; the checkpoint keeps its own names for it
(``mlp.shared_experts.{gate,up,down}_proj``, ``baton.models.checkpoint``). ``--disable-shared-experts-fusion``:
the separate MLP, its output added in the routed kernels' epilogue (``shared_out``).

Under tensor parallelism the router is replicated (every rank picks the same experts) and every expert, routed
and shared, is split along its intermediate dimension: w13 holds this rank's gate rows then up rows, w2 the
matching columns. Each rank adds its routed and shared partials (and, on rank 0, the residual) and the block
ends with one all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from baton import dist
from baton.config import ConfigError, LingConfig
from baton.layers.linear import local_shard, shard_count
from baton.layers.mlp import MLP
from baton.layers.norm import RMSNorm
from baton.ops.linear import linear
from baton.ops.moe import moe_experts, select_experts
from baton.ops.quant import FP8_DTYPE
from baton.ops.quant.fp8 import BLOCK as FP8_BLOCK


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, use_bias: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        if use_bias:
            self.expert_bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None


class Experts(nn.Module):
    """All routed experts stacked: ``w13 [E, 2I, d]`` (gate rows, then up rows) and ``w2 [E, d, I]``; ``I`` is this
    rank's part of ``inter`` (each checkpoint gate/up tensor split along rows, down along columns).

    ``fused_shared``: one more expert at index ``shared_id`` = E (``w13 [E+1, 2I, d]``, ...), the MoE's shared
    expert (the module docstring); the checkpoint loader fills it from the shared expert's own tensors.

    fp8: the weights are float8_e4m3fn with 128 x 128 block ``weight_scale_inv`` per checkpoint tensor, stacked as
    ``w13_scale [E, 2 * ceil(I/128), ceil(d/128)]`` (gate blocks, then up blocks) and ``w2_scale [E, ceil(d/128),
    ceil(I/128)]``; under tensor parallelism each rank's I must be a multiple of 128 so blocks do not straddle."""

    def __init__(self, num_experts: int, hidden_size: int, inter: int, device=None, dtype=None,
                 fp8: bool = False, fused_shared: bool = False) -> None:
        super().__init__()
        full_inter = inter
        inter = shard_count(inter, "moe_intermediate_size")
        self.fp8 = fp8
        self.act_fp8 = False  # fp8: w8a8 (activations quantised per token and 128 channels; models/build.py sets it)
        self.shared_id = num_experts if fused_shared else None  # the fused shared expert's index, the last one
        num_experts += int(fused_shared)
        wdtype = FP8_DTYPE if fp8 else dtype
        grad = not fp8  # fp8 tensors cannot require grad
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, device=device, dtype=wdtype), grad)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, device=device, dtype=wdtype), grad)
        self.w13_scale = self.w2_scale = None
        if fp8:
            if inter != full_inter and inter % FP8_BLOCK:
                raise ConfigError(f"fp8 experts under tensor parallelism need moe_intermediate_size / tp ({inter}) "
                                  f"to be a multiple of {FP8_BLOCK}")
            nb_i, nb_d = -(-inter // FP8_BLOCK), -(-hidden_size // FP8_BLOCK)
            f32 = dict(device=device, dtype=torch.float32)
            self.w13_scale = nn.Parameter(torch.empty(num_experts, 2 * nb_i, nb_d, **f32), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(num_experts, nb_d, nb_i, **f32), requires_grad=False)
        if local_shard(0) is not None:  # dims of the per-expert checkpoint tensors: gate/up [I, d], down [d, I]
            self.tp_shards = {"w13": local_shard(0), "w2": local_shard(1), "w13_scale": local_shard(0),
                              "w2_scale": local_shard(1)}


class SparseMoE(nn.Module):
    def __init__(self, layer_id: int, cfg: LingConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.renormalize, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.expert_limit = cfg.expert_swiglu_limit(layer_id)
        self.shared_limit = cfg.shared_swiglu_limit(layer_id)
        kw = dict(device=device, dtype=dtype)
        fused = cfg.shared_experts_fused
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.moe_router_enable_expert_bias, **kw)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, **kw,
                               fp8=cfg.fp8_experts, fused_shared=fused)
        self.shared_experts = None  # the separate shared MLP (unfused); fused: experts.shared_id
        if cfg.num_shared_experts and not fused:
            inter = cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts
            self.shared_experts = MLP(cfg.hidden_size, inter, self.shared_limit, **kw, fp8=cfg.fp8_dense)

    @property
    def shared_id(self) -> int | None:
        """The fused shared expert's id in ``experts`` (routed by every row with weight 1), None when unfused."""
        return self.experts.shared_id

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> router logits [T, E] fp32. The GEMV runs in the gate weight's dtype: the model dtype by
        default (bf16 on GPU, through the decode-shape linear kernel: 2.3 us at one row on the H200 against 6.4 for
        cuBLAS, benchmarks/results/decode-gemm-2026-12-01), fp32 after ``use_fp32_router``
        (``--enable-fp32-router``)."""
        w = self.gate.weight
        if w.dtype == torch.float32:
            return x.float() @ w.t()
        return linear(x, w).float()

    def use_fp32_router(self) -> None:
        self.gate.weight.data = self.gate.weight.data.float()

    def route(self, x: torch.Tensor, active_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (topk_ids [T, k], topk_weights [T, k] fp32); rows >= ``active_rows`` (a device value)
        get id -1 and weight 0: no expert. Fused shared expert: k + 1 columns, the last ``(shared_id, 1.0)`` on
        every row (the rows past ``active_rows`` too)."""
        return select_experts(self.router_logits(x), self.gate.expert_bias, self.top_k, self.n_group,
                              self.topk_group, self.renormalize, self.scaling, active_rows=active_rows,
                              shared_id=self.shared_id)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None,
                active_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[residual +] routed(norm(x)) + shared(norm(x))``, the combine accumulated in fp32. Rows >=
        ``active_rows`` (ForwardContext.active_rows) take no routed experts: ``[residual +] shared``. Fused, the
        shared expert is one more pair of each row, summed in fp32 with the routed ones (no rounding of its output
        to x's dtype before the residual, as the separate MLP's has): the one numerical difference."""
        h = x if norm is None else norm(x)
        topk_ids, topk_weights = self.route(h, active_rows)
        if dist.tp_size() > 1:
            return self._forward_tp(x, h, topk_ids, topk_weights, residual)
        shared = self.shared_experts(h) if self.shared_experts is not None else None
        y = self._experts(h, topk_ids, topk_weights, residual, shared)
        return y.to(x.dtype)

    def _experts(self, h, topk_ids, topk_weights, residual, shared) -> torch.Tensor:
        e = self.experts
        return moe_experts(h, e.w13, e.w2, topk_ids, topk_weights, self.expert_limit, residual=residual,
                           shared_out=shared, w13_scale=e.w13_scale, w2_scale=e.w2_scale, act_fp8=e.act_fp8,
                           shared_limit=self.shared_limit, shared_id=e.shared_id)

    def _forward_tp(self, x, h, topk_ids, topk_weights, residual) -> torch.Tensor:
        """This rank's routed + shared partials (+ the residual on rank 0), summed over ranks once (fused: the
        shared partial is this rank's pair of the shared expert's intermediate block)."""
        shared = self.shared_experts(h, reduce=False) if self.shared_experts is not None else None
        y = self._experts(h, topk_ids, topk_weights, residual if dist.tp_rank() == 0 else None, shared)
        return dist.all_reduce(y.to(x.dtype))
