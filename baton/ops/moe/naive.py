"""Reference MoE ops: the group-limited sigmoid router (DeepSeek-V3 / Ling "noaux_tc") and the routed
experts with fused gate/up weights, in plain PyTorch. An expert id of -1 is no expert (``drop_inactive_rows``: the
rows past a verify's active prefix): it reads no weights and adds nothing."""

from __future__ import annotations

import torch

from baton.ops.linear.naive import swiglu


def grouped_topk(scores: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, n_group: int,
                 topk_group: int, renormalize: bool, scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E]: sigmoid router outputs (fp32). Selection uses ``scores + expert_bias``; weights use the
    unbiased scores. Returns (topk_ids [T, k] int64, topk_weights [T, k] fp32)."""
    num_tokens, num_experts = scores.shape
    choice = scores if expert_bias is None else scores + expert_bias.float()[None]
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
        keep = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize and top_k > 1:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, topk_weights * scaling_factor


def drop_inactive_rows(topk_ids: torch.Tensor, topk_weights: torch.Tensor, active_rows: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``>= active_rows`` (one int on the device, 0-d or [1]; never read on the host) get id -1, weight 0."""
    routed = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None] < active_rows.reshape(())
    return topk_ids.masked_fill(~routed, -1), topk_weights.masked_fill(~routed, 0.0)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, swiglu_limit: float = 0.0) -> torch.Tensor:
    """x [T, d]; w13 [E, 2I, d] (gate rows then up rows); w2 [E, d, I]. Returns sum_k w_k * expert_k(x) [T, d],
    accumulated in fp32 (ids -1 skipped)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    token_idx = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    weights = topk_weights.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        if e < 0:  # no expert
            continue
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        toks = token_idx[sel]
        h = swiglu(x[toks] @ w13[e].t(), swiglu_limit)
        y = (h @ w2[e].t()).float() * weights[sel, None]
        out.index_add_(0, toks, y)
    return out


def fused_experts_dense_gather(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                               topk_weights: torch.Tensor, swiglu_limit: float = 0.0) -> torch.Tensor:
    """``fused_experts`` without a host sync (safe in CUDA graphs): for each of the k slots, gather every token's
    expert weights with ``index_select`` and run a batched matmul. Reads T*k expert matrices (duplicates included)
    and holds T of them at a time ([T, 2I, d] + [T, d, I]); meant for small T. Returns [T, d] fp32. Its shapes are
    fixed, so an id of -1 gathers expert 0 in its place (the one path here that reads weights for no expert) and the
    product is dropped: it adds exactly zero."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(topk_ids.shape[1]):
        routed = topk_ids[:, j : j + 1] >= 0  # [T, 1]
        ids = topk_ids[:, j].clamp_min(0)
        gate_up = torch.bmm(w13.index_select(0, ids), x[:, :, None])[:, :, 0]  # [T, 2I]
        h = swiglu(gate_up, swiglu_limit)  # [T, I]
        y = torch.bmm(w2.index_select(0, ids), h[:, :, None])[:, :, 0]  # [T, d]
        out += torch.where(routed, y.float() * topk_weights[:, j : j + 1].float(), 0.0)
    return out
