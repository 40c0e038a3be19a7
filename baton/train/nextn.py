"""NEXTN head training for a target without an MTP layer (``baton train nextn``).

The head has the Ling MTP layer's structure (``enorm``, ``hnorm``, ``eh_proj``, one decoder layer of the
target's own kind, ``final_layernorm``; baton/models/nextn.py) and shares the target's embedding and lm_head,
which stay frozen and are not written into the checkpoint (``save_nextn_head``).

Example at row t (the NEXTN convention of baton/speculative/nextn.py): input (target final-normed hidden h_t,
embedding of token t+1) at position t, label token t+2. Drafting then feeds the head's own hidden state back:
chain step s (1-based) of row t sits at position t+s-1 with input (g^{s-1}_t, embed(token t+s)) and predicts
token t+s+1, where g^0_t = h_t. Plain teacher forcing (s = 1 only) never shows the head its own hidden
states, so ``--unroll-steps S`` trains all S chain steps as they run at inference:

- step 1 is causal self-attention over the rows (the draft KV cache after ``begin`` / ``extend``);
- step s >= 2 of row t attends to the step-1 rows 0..t (the committed context) and to its own chain's
  steps 2..s (the rows the chain wrote at positions t+1..t+s-1), nothing else: exactly the keys the drafter's
  cache holds when it drafts from anchor position t+1;
- the label tokens are the recorded ones (teacher forcing the tokens: what matters at inference is the
  continuation after accepted drafts, which equal the target's tokens), the loss is CE on response labels,
  weighted ``step_decay ** (s-1)`` per step.

The decoder layer runs in a training forward written here from the layer's own weights (custom masks,
autograd; the serving layer writes a position-indexed cache). Llama-bodied heads only: Ling checkpoints carry
their own MTP layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.config import ConfigError, ModelConfig
from baton.models.checkpoint import init_dummy_weights
from baton.models.llama import LlamaDecoderLayer
from baton.models.nextn import NextNLayer
from baton.models.nextn_checkpoint import build_nextn_head, nextn_body_config, save_nextn_head
from baton.ops.linear import naive
from baton.train.common import FrozenHead, Sample, Stats, masked_attention
from baton.train.online import Features

log = logging.getLogger(__name__)


@dataclass
class NextNOptions:
    unroll_steps: int = 3  # chain steps trained per row (1 = plain teacher forcing)
    step_decay: float = 0.8  # loss weight of step s is step_decay ** (s - 1)
    init: str = "target"  # "target": body = the target's last decoder layer, final norm = the target's; "random"
    init_seed: int = 0


# ---- building ----


def build_trainable_head(target: nn.Module, target_cfg: ModelConfig, nopts: NextNOptions,
                         device: torch.device) -> tuple[NextNLayer, ModelConfig]:
    """A fp32 head for ``target_cfg`` on ``device``: random init, optionally (``init="target"``) with the body
    copied from the target's last decoder layer (same class and config, so the same parameter names) and the
    final norm from the target's final norm."""
    body_cfg = nextn_body_config(target_cfg)
    head = build_nextn_head(body_cfg, device=device, dtype=torch.float32)
    if not isinstance(head.body, LlamaDecoderLayer):
        raise ConfigError("baton train nextn trains Llama-bodied heads (targets without an MTP layer); Ling "
                          "checkpoints carry their own MTP layer")
    init_dummy_weights(head, nopts.init_seed)
    with torch.no_grad():
        head.eh_proj.weight.mul_(0.5)  # [enorm(e); hnorm(h)] has twice the fan-in of a residual stream row
        if nopts.init == "target":
            last = target.decoder_layers()[-1]
            head.body.load_state_dict({k: v.float() for k, v in last.state_dict().items()})
            head.final_layernorm.weight.copy_(target.model.norm.weight.float())  # the target's logit scale
        elif nopts.init != "random":
            raise ConfigError(f"--init {nopts.init}: choose target or random")
    return head, body_cfg


# ---- the training forward ----


def _llama_layer(layer: LlamaDecoderLayer, x: torch.Tensor, positions: torch.Tensor, past: list[torch.Tensor],
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The serving layer's math with explicit keys, over a batch of sequences: x [B, N, d] at ``positions``
    [N] (the same for every sequence) attends to the keys/values of ``past`` (pairs k, v [B, S_i, Hkv, D] from
    earlier calls, concatenated) plus its own, under ``mask`` [N, S_past + N] (shared by the batch).
    Returns (out [B, N, d], k [B, N, Hkv, D], v [B, N, Hkv, D])."""
    attn, (b, n) = layer.self_attn, x.shape[:2]
    norm = layer.input_layernorm
    qkv = naive.linear(x, attn.qkv_proj.weight, norm.weight, norm.eps)
    q, k, v = attn.qkv_proj.split(qkv)
    q = _rope(attn.rope, positions, q.reshape(b, n, attn.num_heads, attn.head_dim))
    k = _rope(attn.rope, positions, k.reshape(b, n, attn.num_kv_heads, attn.head_dim))
    v = v.reshape(b, n, attn.num_kv_heads, attn.head_dim)
    k_all = torch.cat([*past[0::2], k], dim=1) if past else k
    v_all = torch.cat([*past[1::2], v], dim=1) if past else v
    o = masked_attention(q, k_all, v_all, mask, attn.scale)  # [B, N, H, D]
    h = naive.linear(o.reshape(b, n, attn.num_heads * attn.head_dim), attn.o_proj.weight, residual=x)
    mlp, post = layer.mlp, layer.post_attention_layernorm
    act = naive.linear_swiglu(h, mlp.gate_up_proj.weight, post.weight, post.eps, mlp.swiglu_limit)
    return naive.linear(act, mlp.down_proj.weight, residual=h), k, v


def _rope(rope: nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """RoPE over [B, N, H, D] (the serving op takes [N, H, D]): the batch folded into the heads."""
    b, n, h, d = x.shape
    return rope(positions, x.transpose(0, 1).reshape(n, b * h, d)).reshape(n, b, h, d).transpose(0, 1)


def step_rows(seq_len: int, num_steps: int) -> list[int]:
    """Rows trained at each chain step: step s has rows t = 0 .. T-2-s (its label t+s+1 must exist)."""
    return [max(0, seq_len - 1 - s) for s in range(1, num_steps + 1)]


def chain_mask(step: int, rows: list[int], device: torch.device | None = None) -> torch.Tensor:
    """Visibility of step ``step`` (1-based) queries over the keys of steps 1..step, [N_step, sum N_1..N_step]:
    step-1 keys j <= t (causal over the context rows), chain keys of steps 2..step only for the same row t."""
    t = torch.arange(rows[step - 1], device=device)[:, None]  # [N_s, 1]
    parts = [torch.arange(rows[0], device=device)[None, :] <= t]
    parts += [torch.arange(rows[s - 1], device=device)[None, :] == t for s in range(2, step + 1)]
    return torch.cat(parts, dim=1)


def unrolled_forward(head: NextNLayer, frozen: FrozenHead, ids: torch.Tensor, hidden: torch.Tensor,
                     num_steps: int) -> list[torch.Tensor]:
    """ids [T], target hidden [T, d] -> the head's hidden states per chain step, g^s [N_s, d] (s = 1..S), row t
    of step s predicting token t+s+1. Batched: ids [B, T] and hidden [B, T, d] (sequences padded at the end to
    a common T) -> g^s [B, N_s, d]; a padded sequence's real rows never see its padding (every key a row sees
    lies at or before its own position), so they equal the unpadded forward's."""
    if ids.dim() == 1:
        return [g[0] for g in unrolled_forward(head, frozen, ids[None], hidden[None], num_steps)]
    rows = step_rows(ids.shape[1], num_steps)
    past: list[torch.Tensor] = []
    prev = hidden[:, : rows[0]]  # g^0 = h_t
    outs = []
    for s in range(1, num_steps + 1):
        n = rows[s - 1]
        if n == 0:
            break
        e = frozen.embed(ids[:, s : s + n])  # tokens t+s
        x = head.eh_proj(torch.cat([head.enorm(e), head.hnorm(prev[:, :n].to(e.dtype))], dim=-1))
        positions = torch.arange(s - 1, s - 1 + n, device=ids.device)  # t + s - 1
        out, k, v = _llama_layer(head.body, x, positions, past, chain_mask(s, rows[:s], ids.device))
        past += [k, v]
        prev = head.final_layernorm(out)
        outs.append(prev)
    return outs


# ---- the task ----


@dataclass
class NextNPlan:
    weights: list[torch.Tensor]  # per step, [N_s] fp32: step weight on response labels, 0 elsewhere
    weight_sum: float


class NextNTask:
    """``common.Task`` for the NEXTN head."""

    def __init__(self, head: NextNLayer, body_cfg: ModelConfig, frozen: FrozenHead, nopts: NextNOptions,
                 device: torch.device) -> None:
        self.module, self.body_cfg, self.frozen, self.nopts, self.device = head, body_cfg, frozen, nopts, device

    def plan(self, sample: Sample, gen: torch.Generator) -> NextNPlan:
        rows = step_rows(sample.num_tokens, self.nopts.unroll_steps)
        weights = []
        for s, n in enumerate(rows, start=1):
            label_pos = torch.arange(n) + s + 1  # t + s + 1
            w = (label_pos >= sample.prompt_len).float() * self.nopts.step_decay ** (s - 1)
            weights.append(w)
        return NextNPlan(weights, float(sum(w.sum() for w in weights)))

    def loss(self, sample: Sample, feats: Features, plan: NextNPlan) -> tuple[torch.Tensor, Stats]:
        """Weighted CE of every chain step of one sample (``batch_loss`` of a batch of one)."""
        return self.batch_loss([(sample, feats)], [plan])

    def batch_loss(self, items: list[tuple[Sample, Features]], plans: list[NextNPlan]) -> tuple[torch.Tensor, Stats]:
        """The weighted CE of every chain step, summed over a whole batch in one padded forward (sequences padded
        at the end): the same value as the per-sample sum, at a fraction of the launches. Only rows with a
        response label (weight > 0) reach the lm_head, gathered with a host-built index (no device sync); the
        statistics stay on the device."""
        dev = self.device
        width = max(sample.num_tokens for sample, _ in items)
        ids_host = torch.zeros(len(items), width, dtype=torch.long)
        hidden = items[0][1].hidden.new_zeros(len(items), width, items[0][1].hidden.shape[-1])
        for r, (sample, feats) in enumerate(items):
            ids_host[r, : sample.num_tokens] = torch.tensor(sample.ids)
            hidden[r, : sample.num_tokens] = feats.hidden
        ids = ids_host.to(dev, non_blocking=True)
        outs = unrolled_forward(self.module, self.frozen, ids, hidden, self.nopts.unroll_steps)
        total = torch.zeros((), device=dev)
        stats: Stats = {}
        for s, g in enumerate(outs, start=1):
            n_rows = g.shape[1]
            w = torch.zeros(len(items), n_rows)
            for r, plan in enumerate(plans):
                if s <= len(plan.weights):
                    w[r, : plan.weights[s - 1].shape[0]] = plan.weights[s - 1]
            w = w.reshape(-1)
            keep = (w > 0).nonzero().squeeze(1)  # host tensors: no sync
            if keep.numel() == 0:
                continue
            idx = keep.to(dev, non_blocking=True)
            logits = self.frozen.logits(g.reshape(-1, g.shape[-1]).index_select(0, idx))  # [K, V] fp32
            labels = ids[:, s + 1 : s + 1 + n_rows].reshape(-1).index_select(0, idx)
            ce = F.cross_entropy(logits, labels, reduction="none")
            total = total + (w[keep].to(dev, non_blocking=True) * ce).sum()
            n = float(keep.numel())
            stats[f"loss_s{s}"] = (ce.detach().sum(), n)
            stats[f"acc_s{s}"] = ((logits.detach().argmax(-1) == labels).sum(), n)
        return total, stats

    def save(self, path: str) -> None:
        save_nextn_head(self.module, self.body_cfg, self.frozen.vocab_size, path)


__all__ = ["NextNOptions", "NextNTask", "build_trainable_head", "chain_mask", "step_rows", "unrolled_forward"]
