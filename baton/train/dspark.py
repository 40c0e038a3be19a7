"""DSpark and DFlash draft training (``baton train dspark``), dspark-dflash.md §3 and §4.2-4.5.

Slot convention (DeepSpec, §0 convention 2, as baton/speculative/dspark.py serves it): a block is
``[anchor token, MASK x (gamma-1)]`` at positions ``a .. a+gamma-1`` and slot k (0-based) predicts the token
at ``a+k+1``. Per sequence:

- anchors: up to ``num_anchors`` distinct positions drawn at random (re-drawn every time the sequence is
  seen) among the response positions ``a >= prompt_len`` whose first label ``a+1`` exists (at inference the
  first anchor is the first generated token, at position prompt_len);
- all blocks of a sequence go through one packed forward. Keys are ``[context (the tapped target features
  of positions 0..max(a)-1, fused by fc + hidden_norm) | block_0 | ... | block_{n-1}]``; a block query sees
  the context strictly before its own anchor and its own block bidirectionally; other blocks are invisible
  (§1.3 / §3; ``block_mask``). This is what the drafter computes for one block from its KV cache;
- logits: U = target lm_head(h) (frozen, shared). DSpark adds the Markov bias with the teacher-forced previous
  token (the anchor for slot 0, then the recorded token a+k): corrected = U + W2(W1[x_{a+k}]), and the
  confidence logit w . [h_k ; W1[x_{a+k}]] + b;
- target distribution at the same future position: the target lm_head over the target's final hidden state
  at label-1 = a+k (from the online features);
- loss (§4.5): ``0.1 * CE(corrected, x_{a+k+1}) + 0.9 * ||softmax(corrected) - softmax(target)||_1 + 1.0 *
  BCE(confidence logit, c*)`` with ``c* = 1 - 0.5 ||p_d - p_t||_1`` detached and clamped to [0, 1]; every
  slot weighted by ``exp(-k / loss_decay_gamma)`` (k 0-based, default 4.0), a slot counting only while all
  earlier slots of its block are valid; normalised by the batch's total weight. DFlash (``markov_rank 0``:
  no Markov and no confidence head) defaults to DeepSpec's CE-only baseline.

The backbone runs in a training forward written here from ``DSparkDraftModel``'s own submodules (the serving
forward reads a KV cache and sees one block); checkpoints are written with ``dspark_ckpt.save_dspark_draft``
and load with ``--speculative-algorithm DSPARK|DFLASH --speculative-draft-model-path``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from baton.config import ConfigError, ModelConfig
from baton.models.checkpoint import init_dummy_weights
from baton.models.dspark import DSparkDraftModel
from baton.models.dspark_checkpoint import DSparkDraftConfig, draft_config_for, save_dspark_draft
from baton.ops.linear import naive
from baton.train.common import FrozenHead, Sample, Stats, masked_attention, to_device
from baton.train.online import Features

log = logging.getLogger(__name__)

DSPARK_ALPHAS = (0.1, 0.9, 1.0)  # CE, TV (L1), confidence BCE: DeepSpec ce/l1/confidence_head alphas
DFLASH_ALPHAS = (1.0, 0.0, 0.0)  # DeepSpec's DFlash baseline: CE only


@dataclass
class DSparkOptions:
    block_size: int = 7  # gamma: query slots = drafts per round
    num_layers: int = 2  # draft depth
    markov_rank: int = 256  # 0: DFlash (no Markov / confidence heads)
    num_anchors: int = 512  # blocks per sequence (at most the response positions)
    loss_decay_gamma: float = 4.0  # slot weight exp(-k0 / loss_decay_gamma)
    alphas: tuple[float, float, float] | None = None  # (CE, TV, confidence); None: DSpark or DFlash defaults
    mask_token_id: int | None = None  # None: the last vocabulary id
    target_layer_ids: list[int] | None = None  # None: build_target_layer_ids(target layers, num_layers)
    qk_norm: bool = True
    init: str = "random"  # "target": draft layer i starts as the target's decoder layer L - n + i (see below)
    init_seed: int = 0
    batched_loss: bool = False  # one vocabulary pass (lm_head, softmax, loss) over the whole batch's rows

    @property
    def with_heads(self) -> bool:
        return self.markov_rank > 0

    def loss_alphas(self) -> tuple[float, float, float]:
        if self.alphas is not None:
            return self.alphas
        return DSPARK_ALPHAS if self.with_heads else DFLASH_ALPHAS


# ---- building ----


def build_trainable_draft(target_cfg: ModelConfig, dopts: DSparkOptions, device: torch.device,
                          target: torch.nn.Module | None = None) -> tuple[DSparkDraftModel, DSparkDraftConfig]:
    """A fp32 draft on ``device``: backbone weights ~ N(0, 1/fan_in), norms 1 (the final norm a copy of the
    ``target``'s when given: the logit scale of the shared lm_head), the Markov bias W2 and the confidence
    head at zero (the chain starts as plain DFlash, every confidence at 0.5). ``dopts.init == "target"``: each
    draft layer starts as a copy of one of the target's last layers (``copy_target_layers``); fc and the q/k
    norms keep their initialisation."""
    cfg = draft_config_for(target_cfg, dopts.block_size, dopts.num_layers, dopts.markov_rank,
                           dopts.mask_token_id, dopts.target_layer_ids, dopts.qk_norm)
    for i in cfg.target_layer_ids:
        if not 0 <= i < target_cfg.num_hidden_layers - 1:
            raise ConfigError(f"target layer id {i} must lie in [0, {target_cfg.num_hidden_layers - 2}]")
    model = DSparkDraftModel(cfg, with_heads=dopts.with_heads, device=device, dtype=torch.float32)
    init_dummy_weights(model, dopts.init_seed)
    if dopts.init == "target":
        if target is None:
            raise ConfigError("DSpark init 'target' needs the target model")
        copy_target_layers(model, target)
    elif dopts.init != "random":
        raise ConfigError(f"--init {dopts.init}: choose target or random")
    with torch.no_grad():
        if target is not None:
            model.norm.weight.copy_(target.model.norm.weight.float())
        if model.markov_head is not None:
            gen = torch.Generator(device=device).manual_seed(dopts.init_seed)
            model.markov_head.w1.weight.normal_(0.0, 1.0, generator=gen)  # an embedding table
            model.markov_head.w2.weight.zero_()
            model.confidence_head.weight.zero_()
            model.confidence_head.bias.zero_()
    return model, cfg


def grow_draft(target_cfg: ModelConfig, dopts: DSparkOptions, num_layers: int, path: str, device: torch.device,
               target: torch.nn.Module | None = None) -> tuple[DSparkDraftModel, DSparkDraftConfig]:
    """A ``num_layers``-layer fp32 draft that computes exactly what the checkpoint at ``path`` (``dopts``: its
    architecture, fewer layers) computes: its weights, then new layers appended whose output projections
    (``o_proj``, ``down_proj``) are zero, so each adds nothing to the residual stream until training moves them.
    The new layers' other weights keep ``build_trainable_draft``'s initialisation."""
    import dataclasses

    from baton.models.dspark_checkpoint import load_dspark_weights

    small, _ = build_trainable_draft(target_cfg, dataclasses.replace(dopts, init="random"), device, target)
    load_dspark_weights(small, path, ignore_heads=False)
    model, cfg = build_trainable_draft(target_cfg, dataclasses.replace(dopts, num_layers=num_layers, init="random"),
                                       device, target)
    result = model.load_state_dict(small.state_dict(), strict=False)
    new = {f"layers.{i}." for i in range(dopts.num_layers, num_layers)}
    if result.unexpected_keys or any(not k.startswith(tuple(new)) for k in result.missing_keys):
        raise ConfigError(f"--grow-layers: the checkpoint {path} does not fit a {num_layers}-layer draft "
                          f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})")
    with torch.no_grad():
        for layer in model.layers[dopts.num_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    log.info("--grow-layers: %d layer(s) from %s, %d new with zero output projections", dopts.num_layers, path,
             num_layers - dopts.num_layers)
    return model, cfg


def copy_target_layers(model: DSparkDraftModel, target: torch.nn.Module) -> None:
    """Draft layer i <- the target's decoder layer L - n + i (n draft layers): its norms, MLP and attention
    projections, the fused ``qkv_proj`` split into q / k / v. Every draft tensor must find a target tensor of its
    shape; a target of another layer structure (e.g. Ling's MLA / KDA layers) is refused, naming the tensor."""
    layers = list(target.model.layers)
    n = len(model.layers)
    for i, layer in enumerate(model.layers):
        src = layers[len(layers) - n + i]
        theirs = {k: v for k, v in src.state_dict().items()}
        qkv = theirs.pop("self_attn.qkv_proj.weight", None)
        if qkv is not None:
            sizes = [layer.self_attn.q_proj.weight.shape[0], layer.self_attn.k_proj.weight.shape[0],
                     layer.self_attn.v_proj.weight.shape[0]]
            if sum(sizes) == qkv.shape[0]:
                for name, part in zip(("q_proj", "k_proj", "v_proj"), qkv.split(sizes), strict=True):
                    theirs[f"self_attn.{name}.weight"] = part
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    continue  # the target has no q/k norm: these stay 1
                w = theirs.get(name)
                if w is None or tuple(w.shape) != tuple(p.shape):
                    got = "missing" if w is None else f"shape {tuple(w.shape)}"
                    raise ConfigError(f"DSpark init 'target': draft tensor layers.{i}.{name} {tuple(p.shape)} has no "
                                      f"counterpart in target layer {len(layers) - n + i} ({got}); use --init random")
                p.copy_(w.float())


# ---- anchors, masks, weights ----


def sample_anchors(sample: Sample, num_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted anchor positions [n]: response positions a >= max(prompt_len, 1) with a+1 < T."""
    lo, hi = max(sample.prompt_len, 1), sample.num_tokens - 1  # a in [lo, hi)
    if hi <= lo:
        return torch.zeros(0, dtype=torch.long)
    candidates = torch.arange(lo, hi)
    if num_anchors < candidates.numel():
        candidates = candidates[torch.randperm(candidates.numel(), generator=gen)[:num_anchors]]
    return candidates.sort().values


def block_mask(anchors: torch.Tensor, gamma: int, ctx_len: int) -> torch.Tensor:
    """Visibility [n*gamma, ctx_len + n*gamma] of the packed blocks (True = visible): the query of block b sees
    context key j iff j < anchors[b], and block keys iff they belong to block b."""
    n = anchors.shape[0]
    block_of = torch.arange(n, device=anchors.device).repeat_interleave(gamma)  # [n*gamma]
    ctx = torch.arange(ctx_len, device=anchors.device)[None, :] < anchors[block_of][:, None]
    own = block_of[:, None] == block_of[None, :]
    return torch.cat([ctx, own], dim=1)


def position_weights(gamma: int, loss_decay_gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[gamma]: exp(-k0 / loss_decay_gamma), k0 = 0 .. gamma-1 (DeepSpec; the paper's exp(-(k-1)/gamma))."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / loss_decay_gamma)


def slot_weights(valid: torch.Tensor, loss_decay_gamma: float) -> torch.Tensor:
    """valid [n, gamma] bool -> weights [n, gamma] fp32: the position decay where the slot and every earlier
    slot of its block are valid (cumulative product), 0 elsewhere."""
    prefix = valid.float().cumprod(dim=1)
    return prefix * position_weights(valid.shape[1], loss_decay_gamma, valid.device)[None, :]


# ---- forward ----


@dataclass
class BlockBatch:
    """The packed blocks of one sequence (n anchors, gamma slots each, flattened slot-major per block)."""

    anchors: torch.Tensor  # [n]
    positions: torch.Tensor  # [n*gamma] a+k
    input_ids: torch.Tensor  # [n*gamma] anchor then MASK
    prev_ids: torch.Tensor  # [n*gamma] teacher-forced previous token x_{a+k}
    labels: torch.Tensor  # [n*gamma] x_{a+k+1} (clamped where invalid)
    valid: torch.Tensor  # [n, gamma] bool: label inside the sequence and a response token
    ctx_len: int  # context keys: positions 0 .. ctx_len-1 (= max anchor)


def make_blocks(ids: torch.Tensor, prompt_len: int, anchors: torch.Tensor, gamma: int,
                mask_token_id: int, ctx_len: int | None = None) -> BlockBatch:
    """The packed blocks at ``anchors`` (on ``ids``' device). ``ctx_len``: max(anchors) when the caller knows it
    on the host (reading it from a device tensor would sync the stream)."""
    t, n = ids.shape[0], anchors.shape[0]
    k = torch.arange(gamma, device=ids.device)
    pos = (anchors[:, None] + k[None, :])  # [n, gamma]
    label_pos = pos + 1
    valid = (label_pos < t) & (label_pos >= prompt_len)
    inputs = torch.full((n, gamma), mask_token_id, dtype=torch.long, device=ids.device)
    inputs[:, 0] = ids[anchors]
    prev = ids[pos.clamp(max=t - 1)]
    labels = ids[label_pos.clamp(max=t - 1)]
    if ctx_len is None:
        ctx_len = int(anchors.max()) if n else 0
    return BlockBatch(anchors, pos.reshape(-1), inputs.reshape(-1), prev.reshape(-1), labels.reshape(-1), valid,
                      ctx_len)


def packed_forward(model: DSparkDraftModel, taps: torch.Tensor, block_embeds: torch.Tensor,
                   block_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The backbone over packed blocks: taps [S, n_taps*d] (context features of positions 0..S-1), block_embeds
    [N, d] at ``block_positions`` [N], ``mask`` [N, S + N] -> final-normed slot hidden states [N, d]."""
    s = taps.shape[0]
    ctx_positions = torch.arange(s, device=taps.device)
    h_ctx = model.hidden_norm(model.fc(taps.to(model.fc.weight.dtype)))  # [S, d] H_ctx (bf16 taps, fp32 draft)
    x = block_embeds
    n = x.shape[0]
    for layer in model.layers:
        attn = layer.self_attn
        k_ctx, v_ctx = attn.project_kv(h_ctx, ctx_positions)  # [S, Hkv, D]
        xn = layer.input_layernorm(x)
        q = attn.q_proj(xn).view(n, attn.num_heads, attn.head_dim)
        if attn.q_norm is not None:
            q = attn.q_norm(q)
        q = attn.rope(block_positions, q)
        k_blk, v_blk = attn.project_kv(xn, block_positions)  # [N, Hkv, D]
        o = masked_attention(q, torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk]), mask, attn.scale)
        h = x + attn.o_proj(o.reshape(n, attn.num_heads * attn.head_dim))
        mlp = layer.mlp
        act = naive.linear_swiglu(layer.post_attention_layernorm(h), mlp.gate_up_proj.weight, None, 1e-6,
                                  mlp.swiglu_limit)
        x = h + naive.linear(act, mlp.down_proj.weight)
    return model.norm(x)


@dataclass
class BlockOutputs:
    logits: torch.Tensor  # [N, V] fp32: Markov-corrected draft logits (= U for DFlash)
    target_logits: torch.Tensor  # [N, V] fp32, no grad: the target at position a+k
    conf_logits: torch.Tensor | None  # [N] fp32 raw confidence logits (DSpark)
    blocks: BlockBatch


@dataclass
class TargetRows:
    """The target's final hidden states a sequence's slots score against, without the duplicates: the slots of
    overlapping blocks share positions (256 anchors of 16 slots cover at most the response and 15 more), so
    ``hidden`` [S, d] holds each position of the blocks' span once and ``index`` [N] picks a slot's row."""

    hidden: torch.Tensor
    index: torch.Tensor

    def logits(self, frozen: FrozenHead) -> torch.Tensor:
        """[N, V] fp32 target logits: the lm_head over the S distinct positions, gathered per slot."""
        return frozen.logits(self.hidden).index_select(0, self.index)


def block_outputs(model: DSparkDraftModel, frozen: FrozenHead, ids: torch.Tensor, prompt_len: int,
                  feats: Features, anchors: torch.Tensor) -> BlockOutputs:
    """Teacher-forced draft outputs for the blocks at ``anchors`` of the sequence ``ids`` [T]."""
    h, blocks, target = block_hidden_states(model, frozen, ids, prompt_len, feats, anchors)
    logits, conf, target_logits = head_outputs(model, frozen, h, blocks.prev_ids, [target])
    return BlockOutputs(logits, target_logits, conf, blocks)


def block_hidden_states(model: DSparkDraftModel, frozen: FrozenHead, ids: torch.Tensor, prompt_len: int,
                        feats: Features, anchors: torch.Tensor
                        ) -> tuple[torch.Tensor, BlockBatch, torch.Tensor | TargetRows]:
    """The sequence's part of ``block_outputs``: slot hidden states h [N, d], the blocks, and the target's final
    hidden states at the slots' positions (the TV target, read from the online features): ``TargetRows`` when the
    anchors are on the host and their span is shorter than the N slots, else one row per slot [N, d]."""
    gamma = model.config.block_size
    ctx_len = span = None
    if anchors.device.type == "cpu":  # the plan's anchors: the context length known without a device read
        ctx_len = int(anchors.max()) if anchors.numel() else 0
        if anchors.numel():  # positions a+k of every block, clamped to the sequence, lie in [lo, hi]
            span = (int(anchors.min()), min(ctx_len + gamma - 1, ids.shape[0] - 1))
        anchors = to_device(anchors, ids.device)
    blocks = make_blocks(ids, prompt_len, anchors, gamma, model.config.mask_token_id, ctx_len)
    mask = block_mask(blocks.anchors, gamma, blocks.ctx_len)
    h = packed_forward(model, feats.taps[: blocks.ctx_len], frozen.embed(blocks.input_ids), blocks.positions, mask)
    target_pos = blocks.positions.clamp(max=ids.shape[0] - 1)
    if span is not None and span[1] - span[0] + 1 < target_pos.numel():
        return h, blocks, TargetRows(feats.hidden[span[0] : span[1] + 1], target_pos - span[0])
    return h, blocks, feats.hidden[target_pos]


def head_outputs(model: DSparkDraftModel, frozen: FrozenHead, h: torch.Tensor, prev_ids: torch.Tensor,
                 targets: Sequence[torch.Tensor | TargetRows]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The vocabulary-sized part of ``block_outputs``, row by row (so rows of several sequences may go together;
    ``targets``: each sequence's part of ``block_hidden_states``, in row order): (draft logits [N, V] with the
    Markov bias, confidence logits [N] or None, target logits [N, V] without grad)."""
    logits = frozen.logits(h)  # [N, V] U_k
    conf = None
    if model.markov_head is not None:
        prev_emb = model.markov_head.w1(prev_ids)  # [N, r]
        logits = logits + model.markov_head.bias(prev_emb).float()
        with _fp32(h.device):
            head = model.confidence_head
            conf = F.linear(torch.cat([h.float(), prev_emb.float()], dim=-1), head.weight.float(),
                            head.bias.float())[:, 0]
    with torch.no_grad():
        parts = [t.logits(frozen) if isinstance(t, TargetRows) else frozen.logits(t) for t in targets]
        target_logits = parts[0] if len(parts) == 1 else torch.cat(parts)
    return logits, conf, target_logits


def cat_blocks(parts: Sequence[BlockBatch]) -> BlockBatch:
    """Several sequences' blocks as one row list (their rows in order; ``ctx_len`` the largest)."""
    return BlockBatch(*(torch.cat([getattr(b, f) for b in parts]) for f in
                        ("anchors", "positions", "input_ids", "prev_ids", "labels", "valid")),
                      max(b.ctx_len for b in parts))


def _fp32(device: torch.device):
    return torch.autocast(device.type, enabled=False) if device.type == "cuda" else contextlib.nullcontext()


# ---- loss ----


@dataclass
class LossParts:
    total: torch.Tensor  # scalar: sum over slots of w * (a_ce*ce + a_tv*tv + a_conf*bce)
    ce: torch.Tensor  # [N] per slot
    tv: torch.Tensor  # [N] ||p_d - p_t||_1
    bce: torch.Tensor | None  # [N]
    c_star: torch.Tensor  # [N] 1 - 0.5 ||p_d - p_t||_1, detached, in [0, 1]


def dspark_loss(logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                conf_logits: torch.Tensor | None, weights: torch.Tensor,
                alphas: tuple[float, float, float] = DSPARK_ALPHAS) -> LossParts:
    """logits, target_logits [N, V]; labels [N]; conf_logits [N] or None; weights [N] (0 = not trained) ->
    the weighted loss sum and its per-slot parts (§4.5)."""
    a_ce, a_tv, a_conf = alphas
    logits = logits.float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    tv = (torch.softmax(logits, -1) - torch.softmax(target_logits.float(), -1)).abs().sum(-1)
    c_star = (1.0 - 0.5 * tv).detach().clamp(0.0, 1.0)
    per_slot = a_ce * ce + a_tv * tv
    bce = None
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        per_slot = per_slot + a_conf * bce
    return LossParts((weights * per_slot).sum(), ce, tv, bce, c_star)


# ---- the task ----


@dataclass
class DSparkPlan:
    anchors: torch.Tensor  # [n]
    weights: torch.Tensor  # [n, gamma]
    weight_sum: float = field(init=False)

    def __post_init__(self) -> None:
        self.weight_sum = float(self.weights.sum())


class DSparkTask:
    """``common.Task`` for a DSpark / DFlash draft."""

    def __init__(self, model: DSparkDraftModel, cfg: DSparkDraftConfig, frozen: FrozenHead, dopts: DSparkOptions,
                 device: torch.device) -> None:
        self.module, self.cfg, self.frozen, self.dopts, self.device = model, cfg, frozen, dopts, device
        self.alphas = dopts.loss_alphas()
        if dopts.batched_loss:  # common._train_step then calls batch_loss once instead of loss per sequence
            self.batch_loss = self._batch_loss

    def plan(self, sample: Sample, gen: torch.Generator) -> DSparkPlan:
        anchors = sample_anchors(sample, self.dopts.num_anchors, gen)
        gamma = self.cfg.block_size
        label_pos = anchors[:, None] + torch.arange(gamma)[None, :] + 1
        valid = (label_pos < sample.num_tokens) & (label_pos >= sample.prompt_len)
        return DSparkPlan(anchors, slot_weights(valid, self.dopts.loss_decay_gamma))

    def loss(self, sample: Sample, feats: Features, plan: DSparkPlan) -> tuple[torch.Tensor, Stats]:
        return self._batch_loss([(sample, feats)], [plan])

    def _batch_loss(self, items: Sequence[tuple[Sample, Features]], plans: Sequence[DSparkPlan]
                    ) -> tuple[torch.Tensor, Stats]:
        """``loss`` summed over ``items``: their backbone passes one by one (each sequence has its own packed mask)
        and the vocabulary-sized work (lm_head, Markov bias, target logits, softmaxes, loss) once over all their
        rows. For a batch (``--batched-loss``): fewer, larger kernels, at the memory of [rows of the batch, V] fp32
        tensors."""
        hs, blocks, targets = [], [], []
        for (sample, feats), plan in zip(items, plans, strict=True):
            ids = to_device(torch.tensor(sample.ids, dtype=torch.long), self.device)
            h, b, t = block_hidden_states(self.module, self.frozen, ids, sample.prompt_len, feats, plan.anchors)
            hs.append(h)
            blocks.append(b)
            targets.append(t)
        batch = blocks[0] if len(blocks) == 1 else cat_blocks(blocks)
        logits, conf, target_logits = head_outputs(self.module, self.frozen, torch.cat(hs), batch.prev_ids, targets)
        out = BlockOutputs(logits, target_logits, conf, batch)
        w_host = torch.cat([plan.weights.reshape(-1) for plan in plans])  # [N]
        w = to_device(w_host, self.device)
        parts = dspark_loss(out.logits, out.target_logits, batch.labels, out.conf_logits, w, self.alphas)
        with torch.no_grad():
            stats = _stats(parts, out, w, w_host)
        return parts.total, stats

    def save(self, path: str) -> None:
        save_dspark_draft(self.module, self.cfg, path)


def _stats(parts: LossParts, out: BlockOutputs, w: torch.Tensor, w_host: torch.Tensor) -> Stats:
    """The logged statistics; sums stay on the device (``common.finish_stats`` reads them once per step),
    counts come from the host copy of the weights ``w_host``."""
    wsum = float(w_host.sum())
    on = w > 0
    n_on = float((w_host > 0).sum())
    correct = (out.logits.argmax(-1) == out.blocks.labels) & on
    gamma = out.blocks.valid.shape[1]
    first = float((w_host.view(-1, gamma)[:, 0] > 0).sum())
    stats: Stats = {"loss_ce": ((w * parts.ce).sum(), wsum), "loss_tv": ((w * parts.tv).sum(), wsum),
                    "acc": (correct.sum(), n_on),
                    "acc_k0": (correct.view(-1, gamma)[:, 0].sum(), first),
                    "accept_est": ((parts.c_star * on).sum(), n_on)}
    if parts.bce is not None:
        stats["loss_conf"] = ((w * parts.bce).sum(), wsum)
    return stats


__all__ = ["DFLASH_ALPHAS", "DSPARK_ALPHAS", "BlockOutputs", "DSparkOptions", "DSparkTask", "block_hidden_states",
           "block_mask", "block_outputs", "build_trainable_draft", "cat_blocks", "copy_target_layers", "dspark_loss",
           "grow_draft",
           "head_outputs", "make_blocks", "packed_forward", "position_weights", "sample_anchors", "slot_weights"]
