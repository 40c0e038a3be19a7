"""Reference MoE ops: the group-limited sigmoid router (DeepSeek-V3 / Ling "noaux_tc") and the routed
experts with fused gate/up weights, in plain PyTorch. An expert id of -1 is no expert (``drop_inactive_rows``: the
rows past a verify's active prefix): it reads no weights and adds nothing.

A fused shared expert (``baton.layers.moe.Experts``: the shared expert stacked as expert ``shared_id``) is one more
column ``(shared_id, 1.0)`` of every row (``append_shared_expert``); the experts take ``shared_limit`` as the SwiGLU
clamp of its pairs and ``swiglu_limit`` for the others."""

from __future__ import annotations

import torch

from baton.ops.linear.naive import swiglu
from baton.ops.quant.fp8 import ACT_GROUP, quantize_act_e4m3, scale_act_f16


def grouped_topk(scores: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, n_group: int,
                 topk_group: int, renormalize: bool, scaling_factor: float, shared_id: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E]: sigmoid router outputs (fp32). Selection uses ``scores + expert_bias``; weights use the
    unbiased scores. Returns (topk_ids [T, k] int64, topk_weights [T, k] fp32); with ``shared_id`` k + 1 columns,
    the last ``(shared_id, 1.0)`` (``append_shared_expert``)."""
    if shared_id is not None:
        ids, weights = grouped_topk(scores, expert_bias, top_k, n_group, topk_group, renormalize, scaling_factor)
        return append_shared_expert(ids, weights, shared_id)
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


def append_shared_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, shared_id: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] routes -> [T, k + 1]: every row (active or not: the shared expert runs on every row) gets the fused
    shared expert ``shared_id`` with weight 1.0 (not scaled by routed_scaling_factor)."""
    num_tokens = topk_ids.shape[0]
    ids = torch.full((num_tokens, 1), shared_id, dtype=topk_ids.dtype, device=topk_ids.device)
    weights = torch.ones(num_tokens, 1, dtype=topk_weights.dtype, device=topk_weights.device)
    return torch.cat([topk_ids, ids], 1), torch.cat([topk_weights, weights], 1)


def _limit_of(e: int, swiglu_limit: float, shared_limit: float, shared_id: int | None) -> float:
    return shared_limit if shared_id is not None and e == shared_id else swiglu_limit


def _pair_swiglu(gate_up: torch.Tensor, ids: torch.Tensor, swiglu_limit: float, shared_limit: float,
                 shared_id: int | None) -> torch.Tensor:
    """SwiGLU of rows whose experts are ``ids`` [P]: the clamp ``shared_limit`` on the rows of expert
    ``shared_id``, ``swiglu_limit`` on the others."""
    h = swiglu(gate_up, swiglu_limit)
    if shared_id is None or shared_limit == swiglu_limit:
        return h
    return torch.where((ids == shared_id)[:, None], swiglu(gate_up, shared_limit), h)


def drop_inactive_rows(topk_ids: torch.Tensor, topk_weights: torch.Tensor, active_rows: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``>= active_rows`` (one int on the device, 0-d or [1]; never read on the host) get id -1, weight 0."""
    routed = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None] < active_rows.reshape(())
    return topk_ids.masked_fill(~routed, -1), topk_weights.masked_fill(~routed, 0.0)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, swiglu_limit: float = 0.0, *, shared_limit: float = 0.0,
                  shared_id: int | None = None) -> torch.Tensor:
    """x [T, d]; w13 [E, 2I, d] (gate rows then up rows); w2 [E, d, I]. Returns sum_k w_k * expert_k(x) [T, d],
    accumulated in fp32 (ids -1 skipped); expert ``shared_id`` clamped at ``shared_limit``."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    token_idx = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    weights = topk_weights.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        if e < 0:  # no expert
            continue
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        toks = token_idx[sel]
        h = swiglu(x[toks] @ w13[e].t(), _limit_of(e, swiglu_limit, shared_limit, shared_id))
        y = (h @ w2[e].t()).float() * weights[sel, None]
        out.index_add_(0, toks, y)
    return out


def fused_experts_dense_gather(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                               topk_weights: torch.Tensor, swiglu_limit: float = 0.0, *, shared_limit: float = 0.0,
                               shared_id: int | None = None) -> torch.Tensor:
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
        h = _pair_swiglu(gate_up, ids, swiglu_limit, shared_limit, shared_id)  # [T, I]
        y = torch.bmm(w2.index_select(0, ids), h[:, :, None])[:, :, 0]  # [T, d]
        out += torch.where(routed, y.float() * topk_weights[:, j : j + 1].float(), 0.0)
    return out


# --------------------------------------------------------------------------------------------------------------------
# fp8 experts on tensor cores: w8a8 (fp8 activations, ``moe_experts(..., act_fp8=True)``) and the fp16 MMA (fp16
# activations, w8a16 numerics to fp16's 11 bits): the same per-group arithmetic, two activation scalings
# --------------------------------------------------------------------------------------------------------------------

_ACT_SCALING = {"e4m3": quantize_act_e4m3, "f16": scale_act_f16}


def _w8a8_matvec(q: torch.Tensor, qs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, row_block: torch.Tensor,
                 group: int = ACT_GROUP) -> torch.Tensor:
    """sum over K groups g of ``(ws[n, g] * qs[p, g]) * sum_{k in g} w[p, n, k] q[p, k]`` in fp32.
    q [P, K] fp8, qs [P, G]; w [P, N, K] fp8, ws [P, NB, G] (scale_inv blocks), row_block [N]: each row's block."""
    num_k = q.shape[-1]
    pad = (-num_k) % group
    qf, wf = q.float(), w.float()
    if pad:
        qf, wf = torch.nn.functional.pad(qf, (0, pad)), torch.nn.functional.pad(wf, (0, pad))
    n_groups = qf.shape[-1] // group
    part = torch.einsum("pgk,pngk->png", qf.reshape(qf.shape[0], n_groups, group),
                        wf.reshape(*wf.shape[:2], n_groups, group))  # [P, N, G]
    scale = ws[:, row_block, :] * qs[:, None, :]  # [P, N, G]
    return (part * scale).sum(-1)


def _w8a8_pairs(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                swiglu_limit: float, act: str = "e4m3", ids: torch.Tensor | None = None, shared_limit: float = 0.0,
                shared_id: int | None = None) -> torch.Tensor:
    """One expert per row: x [P, d]; w13 [P, 2I, d] fp8 + scale [P, 2*ceil(I/128), ceil(d/128)] (gate blocks, then
    up blocks); w2 [P, d, I] fp8 + scale. Returns expert(x) [P, d] fp32 with both activations scaled per (row, 128
    group) by ``act``: "e4m3" (``quantize_act_e4m3``) or "f16" (``scale_act_f16``). ``ids`` [P]: the rows' experts,
    those of ``shared_id`` clamped at ``shared_limit``."""
    scaling = _ACT_SCALING[act]
    inter = w13.shape[1] // 2
    dev = x.device
    gate_blocks = (inter + ACT_GROUP - 1) // ACT_GROUP
    rows = torch.arange(inter, device=dev) // ACT_GROUP
    row_block13 = torch.cat([rows, rows + gate_blocks])
    q, qs = scaling(x)
    gate_up = _w8a8_matvec(q, qs, w13, w13_scale, row_block13)  # [P, 2I]
    if ids is None:
        h = swiglu(gate_up, swiglu_limit)  # [P, I] fp32
    else:
        h = _pair_swiglu(gate_up, ids, swiglu_limit, shared_limit, shared_id)
    qa, qas = scaling(h)
    return _w8a8_matvec(qa, qas, w2, w2_scale, torch.arange(w2.shape[1], device=dev) // ACT_GROUP)


def fused_experts_w8a8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                       w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       swiglu_limit: float = 0.0, *, capturing: bool = False, act: str = "e4m3",
                       shared_limit: float = 0.0, shared_id: int | None = None) -> torch.Tensor:
    """The w8a8 routed experts: x and each pair's SwiGLU output quantised to e4m3 per (row, 128-K group) with
    power-of-two scales (``quantize_act_e4m3``), fp8 x fp8 products summed per group in fp32 and scaled by
    weight block scale x activation group scale. Returns sum_k w_k * expert_k(x) [T, d] fp32 (ids -1 skipped).
    ``capturing``: no host sync (one gather per top-k slot, as ``fused_experts_dense_gather``; an id of -1 gathers
    expert 0 and adds exactly zero). ``act="f16"``: the same with fp16 activations (``fused_experts_fp8_f16``).
    Expert ``shared_id``'s pairs are clamped at ``shared_limit``."""
    num_tokens, hidden = x.shape
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if capturing:
        for j in range(topk_ids.shape[1]):
            routed = topk_ids[:, j : j + 1] >= 0
            ids = topk_ids[:, j].long().clamp_min(0)
            y = _w8a8_pairs(x, w13[ids], w13_scale[ids], w2[ids], w2_scale[ids], swiglu_limit, act, ids,
                            shared_limit, shared_id)
            out += torch.where(routed, y * topk_weights[:, j : j + 1].float(), 0.0)
        return out
    flat_ids = topk_ids.reshape(-1)
    token_idx = torch.arange(num_tokens, device=x.device).repeat_interleave(topk_ids.shape[1])
    weights = topk_weights.reshape(-1).float()
    for e in torch.unique(flat_ids).tolist():
        if e < 0:
            continue
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        toks = token_idx[sel]
        n = toks.numel()
        y = _w8a8_pairs(x[toks], w13[e].expand(n, -1, -1), w13_scale[e].expand(n, -1, -1), w2[e].expand(n, -1, -1),
                        w2_scale[e].expand(n, -1, -1), _limit_of(e, swiglu_limit, shared_limit, shared_id), act)
        out.index_add_(0, toks, y * weights[sel, None])
    return out


def fused_experts_fp8_f16(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                          w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          swiglu_limit: float = 0.0, *, capturing: bool = False, shared_limit: float = 0.0,
                          shared_id: int | None = None) -> torch.Tensor:
    """The fp8 experts' fp16-MMA form (w8a16 numerics; the Triton kernels' ``act="f16"``): x and each pair's SwiGLU
    output scaled per (row, 128-K group) by a power of two into fp16's range and rounded to fp16
    (``scale_act_f16``: exact for bf16 x, 11 bits for the fp32 SwiGLU output), products of the e4m3 weights (exact
    in fp16) summed per group in fp32 and scaled by weight block scale x the group's power of two."""
    return fused_experts_w8a8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit,
                              capturing=capturing, act="f16", shared_limit=shared_limit, shared_id=shared_id)
