"""DSpark and DFlash block drafters (batch 1, plain PyTorch): the draft backbone with KV injection, the
Markov head, the confidence head with STS, and the batch-1 prefix rule over a step-time (SPS) table.

Slot convention: DeepSpec / DSpark ("sample_from_anchor", dspark-dflash.md §0, convention 2). The block
input is ``[anchor, MASK x (gamma-1)]`` at positions ``anchor_pos .. anchor_pos+gamma-1``; slot k (0-based)
predicts the token at ``anchor_pos+k+1``, so gamma query slots give gamma drafts and the verify window is
gamma+1 (``spec.num_draft_tokens``). DFlash here is the same backbone without the Markov and confidence
heads (DeepSpec's own DFlash baseline); z-lab "b16" checkpoints (convention 1) are not interchangeable.

Backbone (§1): the tapped target features (outputs of decoder layers ``target_layer_ids``) are fused by
``fc`` + ``hidden_norm`` into H_ctx. In every draft layer the keys/values are [k/v_proj(H_ctx) of the
context ; k/v_proj of the block]; the context part is computed once per committed token and kept in a
per-layer KVCache at absolute positions, so context tokens never run through the layers. Block queries see
every context position strictly before ``anchor_pos`` and all block slots (bidirectional); block K/V are not
persisted. Embeddings and logits come from the target (``target.embed``, ``target.compute_logits``).

SPS table (``--speculative-dspark-sps-table-path``), JSON::

    {"verify_tokens": [1, 2, 3, 4, 5], "step_time_ms": [9.8, 9.9, 10.0, 10.4, 12.5]}

``verify_tokens`` strictly increasing, ``step_time_ms`` > 0 (the target verify step at that many tokens);
SPS(n) = 1000 / step_time_ms at the largest listed count <= n (the smallest entry below the first).

STS file (``--speculative-dspark-confidence-sts-path``), JSON: ``{"temperatures": [T_1, ..., T_B]}``
(other keys, e.g. ECE figures, are ignored), one per slot of the block size B the draft was calibrated at.
Serving at gamma <= B (a draft trained at block size B may run with fewer query slots) uses the first gamma;
fewer than gamma entries is an error. The draft forward itself always runs the whole trained block of B slots
(the slots attend to their block bidirectionally, so a gamma-slot block would not be the block the draft was
trained on) and keeps the first gamma: on the shipped SmolLM2 drafter (B 16) at gamma 8 that raised the GSM8K
accept length from 3.19 to 3.37 (CPU, 8 questions, 128 tokens).

Tensor parallelism: the draft (backbone, Markov and confidence heads) is small and every rank holds it whole
(built at size 1, so its layers never reduce); its inputs are replicated (the target's embedding and tapped
residual stream are all-reduced), so every rank computes the same block. Only the target's lm_head is
vocab-parallel: the base logits U are gathered once a round (``compute_logits``, [gamma, V]) and the Markov
chain, greedy or sampled, runs on the full rows on every rank; that one gather beats a cross-shard argmax per
slot, which the chain's slot-to-slot dependency would make gamma collectives in a row. A greedy DFlash block
needs no full rows (``greedy_tokens``: one gather of each rank's (max, argmax)). The prefix length is decided
on the device (``prefix_len_device``, no host sync) and rank 0's is broadcast, so every rank accepts alike.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from baton import dist
from baton.config import ConfigError, SpecConfig
from baton.models.base import CausalLM
from baton.models.dspark import DSparkDraftModel, MarkovHead
from baton.models.dspark_checkpoint import (
    DSparkDraftConfig,
    build_target_layer_ids,
    load_dspark_weights,
    markov_rank_from_tensors,
    read_dspark_config,
)
from baton.models.nextn_checkpoint import check_vocab
from baton.ops.argmax import markov_greedy
from baton.speculative.base import Drafter, pick_tokens
from baton.types import SamplingParams

if TYPE_CHECKING:
    from baton.engine.engine import Engine

log = logging.getLogger(__name__)

BLOCK_ALGORITHMS = ("DSPARK", "DFLASH")


# ---- Markov chain, confidence, prefix rule ----


@dataclass
class MarkovProposal:
    tokens: torch.Tensor  # [B] int64, left to right
    probs: torch.Tensor | None  # [B, V] the distributions the tokens were drawn from; None for greedy
    logits: torch.Tensor  # [B, V] fp32 corrected logits U_k + W2(W1[prev_k])
    prev_emb: torch.Tensor  # [B, r] W1[prev_k]: prev = anchor for slot 0, then the token chosen at k-1


def markov_propose(base_logits: torch.Tensor, anchor: torch.Tensor, head: MarkovHead, sampling: SamplingParams,
                   generator: torch.Generator | None) -> MarkovProposal:
    """Sequential over slots: logits_k = U_k + W2(W1[prev]), token_k = argmax or a sample (``pick_tokens``)."""
    prev = anchor.reshape(1)
    tokens, probs, logits, embs = [], [], [], []
    for k in range(base_logits.shape[0]):
        emb = head.w1(prev)  # [1, r]
        logits_k = base_logits[k : k + 1].float() + head.bias(emb)  # [1, V]
        tok, p = pick_tokens(logits_k, sampling, generator)
        tokens.append(tok)
        probs.append(p)
        logits.append(logits_k)
        embs.append(emb)
        prev = tok
    q = None if probs[0] is None else torch.cat(probs)
    return MarkovProposal(torch.cat(tokens), q, torch.cat(logits), torch.cat(embs))


def survival(conf_logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    """c_k = sigmoid(z_k / T_k) (STS; T = 1 without a file), a_k = prod_{i<=k} c_i. [B] -> [B] fp32."""
    z = conf_logits.float()
    if temperatures is not None:
        z = z / temperatures.to(z.device)
    return torch.sigmoid(z).cumprod(0)


@dataclass
class SpsTable:
    """Profiled target verify step time by token count; SPS(n) = 1000 / step_time_ms (floor lookup)."""

    verify_tokens: list[int]
    step_time_ms: list[float]

    def __post_init__(self) -> None:
        n, t = self.verify_tokens, self.step_time_ms
        if not n or len(n) != len(t):
            raise ConfigError("SPS table: verify_tokens and step_time_ms must be non-empty and of equal length")
        if any(b <= a for a, b in zip(n, n[1:], strict=False)) or n[0] < 1:
            raise ConfigError(f"SPS table: verify_tokens must be strictly increasing and >= 1, got {n}")
        if any(x <= 0 for x in t):
            raise ConfigError(f"SPS table: step_time_ms must be > 0, got {t}")

    @classmethod
    def load(cls, path: str) -> SpsTable:
        data = _read_json(path, "--speculative-dspark-sps-table-path")
        try:
            return cls([int(x) for x in data["verify_tokens"]], [float(x) for x in data["step_time_ms"]])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: an SPS table is {{\"verify_tokens\": [...], \"step_time_ms\": [...]}} "
                              f"({e})") from e

    def sps(self, num_tokens: int) -> float:
        i = max(bisect.bisect_right(self.verify_tokens, num_tokens) - 1, 0)
        return 1000.0 / self.step_time_ms[i]


def load_sts_temperatures(path: str, gamma: int) -> torch.Tensor:
    """The first ``gamma`` STS temperatures of ``path`` (a file calibrated at block size B >= gamma has B)."""
    data = _read_json(path, "--speculative-dspark-confidence-sts-path")
    temps = data.get("temperatures") if isinstance(data, dict) else None
    if not isinstance(temps, list) or len(temps) < gamma:
        n = len(temps) if isinstance(temps, list) else None
        raise ConfigError(f"{path}: STS needs \"temperatures\" with at least gamma = {gamma} entries (one per "
                          f"draft slot), found {n}")
    temps = temps[:gamma]
    if any(float(t) <= 0 for t in temps):
        raise ConfigError(f"{path}: STS temperatures must be > 0")
    return torch.tensor([float(t) for t in temps], dtype=torch.float32)  # [gamma]


def prefix_len(survivals: Sequence[float], table: SpsTable | None) -> int:
    """How many drafts to verify at batch 1 (§4.4, Algorithm 1 with R = 1): admit draft j (1-based) while
    ``(1 + sum_{i<=j} a_i) * SPS(1+j) > (1 + sum_{i<j} a_i) * SPS(j)``; stop at the first j that fails.

    The early stop is what keeps it lossless: a_{j+1} depends on the realised token x_j (through W1[x_j]),
    so looking past a failing j would let x_j decide whether x_j itself is verified (selection bias, paper
    App. A). Stopping at the first failure makes each admission depend only on a_1..a_j, i.e. on x_<j.
    Without a table every draft is verified."""
    if table is None:
        return len(survivals)
    tau = 1.0  # 1 + sum_{i<j} a_i: expected committed tokens with j-1 drafts
    for j, a in enumerate(survivals, start=1):
        if (tau + a) * table.sps(1 + j) <= tau * table.sps(j):
            return j - 1
        tau += a
    return len(survivals)


def prefix_len_device(survivals: torch.Tensor, sps: torch.Tensor) -> torch.Tensor:
    """``prefix_len`` on the device, with no host value: survivals a [gamma], sps [gamma + 1] = SPS(1..gamma+1)
    -> the number of drafts to verify, a [] int64 tensor. Draft j is admitted while
    ``(tau_j + a_j) * SPS(1+j) > tau_j * SPS(j)`` with ``tau_j = 1 + sum_{i<j} a_i``, up to the first failure."""
    a = survivals.to(sps.dtype)
    tau = 1.0 + torch.cumsum(a, 0) - a  # 1 + sum_{i<j} a_i
    admit = (tau + a) * sps[1:] > tau * sps[:-1]
    return admit.long().cumprod(0).sum()


def _read_json(path: str, flag: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read ({e})") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} {path}: not valid JSON ({e})") from e


# ---- the drafter ----


class DSparkDrafter(Drafter):
    """One block forward per round; DSpark adds the Markov chain and (with an SPS table) the prefix rule."""

    def __init__(self, target: CausalLM, model: DSparkDraftModel, gamma: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, use_heads: bool, sps_table: SpsTable | None = None,
                 sts_temperatures: torch.Tensor | None = None) -> None:
        cfg = model.config
        self.target, self.model, self.gamma = target, model, gamma
        self.num_draft_tokens = gamma + 1
        self.use_heads = use_heads
        self.sps_table = sps_table
        self.sts_temperatures = None if sts_temperatures is None else sts_temperatures.to(device)
        self.mask_token_id = cfg.mask_token_id
        # The engine captures in layer order; fc expects the checkpoint's order (which may differ).
        self.capture_layer_ids = tuple(sorted(set(cfg.target_layer_ids)))
        self._feature_order = [self.capture_layer_ids.index(i) for i in cfg.target_layer_ids]
        # The block always has the trained size B, also when serving gamma < B drafts: the slots attend to their
        # block bidirectionally, so a shorter block would give the first gamma slots other inputs than training
        # did (a [anchor, MASK x (B-1)] block). The last B - gamma slots are computed and dropped.
        self.block_rows = max(gamma, cfg.block_size)
        self._block_arange = torch.arange(self.block_rows, device=device)
        self.caches = model.make_caches(max_len + self.block_rows, dtype, device)
        self.device = device
        # SPS(1) .. SPS(gamma + 1) for the device prefix rule (None: verify the whole block)
        self.sps_values = None if sps_table is None else torch.tensor(
            [sps_table.sps(n) for n in range(1, gamma + 2)], dtype=torch.float64, device=device)
        self.variable_prefix = self.sps_values is not None and use_heads  # the prefix rule sets relay.num_drafts
        self.feature_dim = len(cfg.target_layer_ids) * cfg.hidden_size  # relay buffer for the verify features
        self._mask_ids = torch.full((self.block_rows - 1,), self.mask_token_id, dtype=torch.long, device=device)

    supports_prefix_cache = True
    deferred_inputs = ("features",)  # a context row's K/V is a function of its position's features alone

    def prefix_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """The context K/V of every draft layer: row i from the target's features at position i."""
        return [(t, 0) for c in self.caches for t in (c.k, c.v)]

    def begin_from(self, start, prompt_ids, target_hidden, captured, first_token, prev_hidden) -> None:
        """Positions start .. N-1 into the draft KV (those below came from the prefix cache)."""
        num = prompt_ids.shape[0] - start
        if num <= 0:
            return
        features = self.features([c[:num] for c in captured])
        self.model.write_context(features, torch.arange(start, start + num, device=self.device), self.caches)

    def reset(self) -> None:
        pass  # begin() writes the prompt's context K/V; the positions past it are written before they are read

    def features(self, captured: list[torch.Tensor]) -> torch.Tensor:
        """Captured target layer outputs (layer order) -> [T, n*H] in the checkpoint's order for ``fc``."""
        return torch.cat([captured[i] for i in self._feature_order], dim=-1)

    def begin(self, prompt_ids, target_hidden, captured, first_token) -> None:
        """Prompt positions 0..N-1 go into the draft KV; the first token is the anchor at N."""
        num = prompt_ids.shape[0]
        features = self.features([c[:num] for c in captured])  # [N, n*H]
        self.model.write_context(features, torch.arange(num, device=self.device), self.caches)

    # ---- the step bodies (engine/step.py) ----

    def block_hidden(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, ctx_len: int | None) -> torch.Tensor:
        """The backbone over the trained block [anchor, MASK x (B-1)] at ``anchor_pos`` [1] (a device value) -> the
        first gamma slots' hidden states [gamma, H]. ``ctx_len`` (= the anchor position, where the host knows it)
        slices the draft cache; None: the whole cache, bounded by the positions."""
        ids = torch.cat([anchor.reshape(1), self._mask_ids])  # [B]
        return self.model(self.target.embed(ids), anchor_pos + self._block_arange, self.caches, ctx_len)[: self.gamma]

    def draft(self, relay, arange) -> None:
        """The backbone over the trained block [anchor, MASK x (B-1)] (see __init__), the first gamma slots' drafts
        (DSpark: the Markov chain, greedy; DFlash: the argmax of each slot), and with an SPS table the prefix the
        verify may accept (``relay.num_drafts``, decided on the device). At a step depth d < gamma
        (``arange.shape[0] - 1``) only the first d slots go on to logits, the chain and the rule: the chain runs left
        to right and the rule stops at its first failure, so their first d results are those of the whole block."""
        d = arange.shape[0] - 1
        h = self.block_hidden(relay.anchor, relay.pos, relay.kv_len(0))[:d]
        if not self.use_heads:
            relay.draft_tokens[:d].copy_(self.target.greedy_tokens(h, draft=True))
            return
        base_logits = self.target.compute_logits(h, draft=True)  # [d, V] (gathered under TP: one collective)
        head = self.model.markov_head  # the greedy chain in 2 kernels a slot on CUDA (ops/argmax)
        tokens = markov_greedy(base_logits, relay.anchor, head.w1.weight, head.w2.weight)
        relay.draft_tokens[:d].copy_(tokens)
        if self.sps_values is not None:
            prev_emb = head.w1(torch.cat([relay.anchor, tokens[:-1]]))  # W1[prev_k]: the anchor, then slot k-1's
            temps = None if self.sts_temperatures is None else self.sts_temperatures[:d]
            a = survival(self.model.confidence_logits(h, prev_emb), temps)
            num = prefix_len_device(a, self.sps_values[: d + 1])
            relay.num_drafts.copy_(dist.broadcast(num.reshape(1)))  # rank 0's: every rank accepts the same prefix

    def extend(self, relay, arange) -> None:
        """Context K/V of every verify row at extend_pos + i; rows past the accept count land at positions the
        next block overwrites before any query reads them as context."""
        n = arange.shape[0]
        self.extend_rows(relay, None, None, relay.verify_features[:n], relay.extend_pos + arange, relay.num_accepted)

    def extend_rows(self, relay, next_tokens, hidden, features, positions, last) -> None:
        """Context K/V of ``features`` at ``positions`` (the block needs no seed: ``last`` is unused)."""
        self.model.write_context(features, positions, self.caches)


# ---- building from a SpecConfig ----


def resolve_dspark_spec(spec: SpecConfig) -> SpecConfig:
    """Fill ``spec.num_draft_tokens`` (= gamma + 1) from the draft checkpoint's block size when unset. The
    engine sizes its verify staging from it, so it must run before the engine reads the value."""
    if spec.algorithm in BLOCK_ALGORITHMS and spec.num_draft_tokens is None:
        spec.num_draft_tokens = read_dspark_config(spec.draft_model_path).block_size + 1
    return spec


def _check_target_fit(cfg: DSparkDraftConfig, target: CausalLM, path: str) -> None:
    tcfg = target.config
    check_vocab(path, cfg.vocab_size, target)
    if cfg.hidden_size != tcfg.hidden_size:
        raise ConfigError(f"{path}: draft hidden_size {cfg.hidden_size} != target {tcfg.hidden_size}")
    if not 0 <= cfg.mask_token_id < tcfg.vocab_size:
        raise ConfigError(f"{path}: mask token id {cfg.mask_token_id} is outside the target vocabulary")
    num_layers = tcfg.num_hidden_layers
    for i in cfg.target_layer_ids:
        if not 0 <= i < num_layers - 1:
            raise ConfigError(f"{path}: target layer id {i} must lie in [0, {num_layers - 2}] (the target has "
                              f"{num_layers} layers and its last layer is never tapped)")


def _resolve_heads(cfg: DSparkDraftConfig, algorithm: str, path: str) -> bool:
    """DSPARK needs the Markov and confidence heads; DFLASH ignores any the checkpoint has."""
    if algorithm != "DSPARK":
        return False
    if not cfg.has_heads:
        cfg.markov_rank = markov_rank_from_tensors(path)
    if not cfg.has_heads:
        raise ConfigError(f"{path}: --speculative-algorithm DSPARK needs a draft with the Markov and confidence "
                          "heads (dspark_markov_rank > 0, markov_head.* and confidence_head.* tensors); this "
                          "checkpoint has none: serve it with --speculative-algorithm DFLASH")
    return True


def _scheduling(spec: SpecConfig, gamma: int, use_heads: bool) -> tuple[SpsTable | None, torch.Tensor | None]:
    if not use_heads:
        if spec.dspark_sps_table_path or spec.dspark_confidence_sts_path:
            log.warning("DFLASH has no confidence head: the SPS table and STS file are ignored (verify all)")
        return None, None
    sps = SpsTable.load(spec.dspark_sps_table_path) if spec.dspark_sps_table_path else None
    sts = load_sts_temperatures(spec.dspark_confidence_sts_path, gamma) if spec.dspark_confidence_sts_path else None
    return sps, sts


def build_dspark_drafter(engine: Engine, spec: SpecConfig, max_len: int) -> DSparkDrafter:
    from baton.models.build import materialize

    path = spec.draft_model_path
    cfg = read_dspark_config(path)
    target = engine.model
    if cfg.target_layer_ids is None:
        cfg.target_layer_ids = build_target_layer_ids(target.config.num_hidden_layers, cfg.num_hidden_layers)
    _check_target_fit(cfg, target, path)
    use_heads = _resolve_heads(cfg, spec.algorithm, path)
    resolve_dspark_spec(spec)
    gamma = spec.num_draft_tokens - 1
    if gamma < 1:
        raise ConfigError(f"--speculative-num-draft-tokens {spec.num_draft_tokens}: DSPARK/DFLASH needs >= 2 "
                          "(gamma + 1: the anchor plus gamma drafts)")
    if gamma > cfg.block_size:
        raise ConfigError(f"--speculative-num-draft-tokens {spec.num_draft_tokens} gives gamma {gamma}, more than "
                          f"the block size {cfg.block_size} the draft {path} was trained with: use "
                          f"--speculative-num-draft-tokens <= {cfg.block_size + 1}")
    if gamma < cfg.block_size:  # supported: the first gamma of the B trained slots (block [anchor, MASK x gamma-1])
        log.info("DSpark/DFlash: gamma %d (--speculative-num-draft-tokens %d) of the draft's block size %d",
                 gamma, spec.num_draft_tokens, cfg.block_size)
    sps, sts = _scheduling(spec, gamma, use_heads)
    with dist.layout_context(0, 1):  # whole on every tensor-parallel rank (module docstring)
        model = DSparkDraftModel(cfg, with_heads=use_heads, device="meta", dtype=engine.dtype)
    materialize(model, engine.device)
    load_dspark_weights(model, path, ignore_heads=not use_heads)
    model.eval()
    return DSparkDrafter(target, model, gamma, max_len, engine.dtype, engine.device, use_heads, sps, sts)


__all__ = ["DSparkDrafter", "SpsTable", "build_dspark_drafter",
           "load_sts_temperatures", "markov_propose", "prefix_len", "prefix_len_device", "resolve_dspark_spec",
           "survival"]
