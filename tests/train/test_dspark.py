"""DSpark / DFlash training: the packed-block mask, the loss weights, the packed forward against the serving
block forward, and training end to end (loss down, greedy output unchanged, accept length up, STS file)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from baton.cli import main as baton_main
from baton.config import ConfigError, ServerArgs
from baton.speculative.dspark import DSparkDrafter, load_sts_temperatures
from baton.train.common import FrozenHead, Sample
from baton.train.dspark import (
    DSparkOptions,
    block_mask,
    block_outputs,
    build_trainable_draft,
    copy_target_layers,
    dspark_loss,
    make_blocks,
    position_weights,
    sample_anchors,
    slot_weights,
)
from baton.train.evaluate import holdout_prompts, measure_accept_length
from baton.train.online import TargetFeatures
from baton.train.runner import load_frozen_target
from baton.types import Request, SamplingParams
from tests.speculative.conftest import make_engine
from tests.train.conftest import train_cli

CPU = torch.device("cpu")


def test_block_mask_hand_example():
    # context positions 0..4, two blocks of gamma = 2 anchored at 2 and 5
    m = block_mask(torch.tensor([2, 5]), gamma=2, ctx_len=5)
    expected = torch.tensor([
        # ctx 0 1 2 3 4 | b0 b0 b1 b1
        [1, 1, 0, 0, 0, 1, 1, 0, 0],  # block 0, slot 0 (the anchor at 2): context strictly before 2
        [1, 1, 0, 0, 0, 1, 1, 0, 0],  # block 0, slot 1: the same, its own block bidirectionally
        [1, 1, 1, 1, 1, 0, 0, 1, 1],  # block 1 (anchor 5): context 0..4, not block 0
        [1, 1, 1, 1, 1, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, expected)


def test_blocks_and_anchors():
    ids = torch.arange(10, 20)  # T = 10, prompt 4
    b = make_blocks(ids, 4, torch.tensor([4, 8]), gamma=3, mask_token_id=99)
    assert b.input_ids.tolist() == [14, 99, 99, 18, 99, 99]
    assert b.positions.tolist() == [4, 5, 6, 8, 9, 10]
    assert b.prev_ids.tolist()[:3] == [14, 15, 16] and b.labels.tolist()[:3] == [15, 16, 17]
    assert b.valid.tolist() == [[True, True, True], [True, False, False]] and b.ctx_len == 8
    gen = torch.Generator().manual_seed(0)
    sample = Sample(list(range(30)), prompt_len=12)
    a = sample_anchors(sample, 5, gen)
    assert a.shape == (5,) and torch.equal(a, a.sort().values) and int(a.min()) >= 12 and int(a.max()) <= 28
    assert sample_anchors(sample, 100, gen).tolist() == list(range(12, 29))  # every response position
    assert sample_anchors(Sample([1, 2, 3], 3), 4, gen).numel() == 0


def test_loss_weights_and_terms():
    w = position_weights(4, 4.0)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))
    valid = torch.tensor([[True, True, False, True], [True, True, True, True]])
    sw = slot_weights(valid, 4.0)  # a later slot counts only while every earlier one is valid
    torch.testing.assert_close(sw, torch.stack([w * torch.tensor([1.0, 1.0, 0.0, 0.0]), w]))
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    target = torch.tensor([[1.0, 1.0, -1.0], [0.0, 1.0, 0.0]])
    labels = torch.tensor([0, 2])
    conf = torch.tensor([0.3, -0.2])
    weights = torch.tensor([1.0, 0.5])
    parts = dspark_loss(logits, target, labels, conf, weights)
    p, q = logits.softmax(-1), target.softmax(-1)
    ce = -logits.log_softmax(-1)[[0, 1], labels]
    tv = (p - q).abs().sum(-1)
    c_star = 1 - 0.5 * tv
    bce = -(c_star * F.logsigmoid(conf) + (1 - c_star) * F.logsigmoid(-conf))
    torch.testing.assert_close(parts.total, (weights * (0.1 * ce + 0.9 * tv + 1.0 * bce)).sum())
    assert float(tv[1]) == 0.0 and float(parts.c_star[1]) == 1.0  # identical distributions: certain acceptance
    for alphas, term in (((1, 0, 0), ce), ((0, 1, 0), tv), ((0, 0, 1), bce)):
        torch.testing.assert_close(dspark_loss(logits, target, labels, conf, weights, alphas).total,
                                   (weights * term).sum())
    no_conf = dspark_loss(logits, target, labels, None, weights)  # DFlash: no confidence term
    torch.testing.assert_close(no_conf.total, (weights * (0.1 * ce + 0.9 * tv)).sum())
    assert DSparkOptions(markov_rank=0).loss_alphas() == (1.0, 0.0, 0.0)
    assert DSparkOptions().loss_alphas() == (0.1, 0.9, 1.0)


def test_packed_forward_matches_serving_blocks(target_path):
    target = load_frozen_target(ServerArgs(model_path=target_path, device="cpu"))
    model, cfg = build_trainable_draft(target.config, DSparkOptions(block_size=4, num_layers=2, markov_rank=8), CPU)
    with torch.no_grad():
        model.markov_head.w2.weight.normal_(0, 0.3)
        model.confidence_head.weight.normal_(0, 0.3)
    frozen = FrozenHead(target.model, CPU)
    ids = torch.tensor([5, 17, 42, 8, 3, 60, 11, 29, 33, 7, 9, 23, 70, 2])
    feats = TargetFeatures(target.model, CPU, cfg.target_layer_ids)(ids.tolist())
    anchors = torch.tensor([4, 7, 11])
    with torch.no_grad():
        out = block_outputs(model, frozen, ids, 4, feats, anchors)
        for b, a in enumerate(anchors.tolist()):
            caches = model.make_caches(32, torch.float32, CPU)
            model.write_context(feats.taps[:a], torch.arange(a), caches)
            block = torch.tensor([int(ids[a])] + [cfg.mask_token_id] * 3)
            h = model(frozen.embed(block), torch.arange(a, a + 4), caches, a)  # the drafter's block forward
            prev = ids[torch.arange(a, a + 4).clamp(max=13)]
            emb = model.markov_head.w1(prev)
            rows = slice(4 * b, 4 * b + 4)
            torch.testing.assert_close(out.logits[rows], frozen.logits(h) + model.markov_head.bias(emb),
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out.conf_logits[rows], model.confidence_logits(h, emb), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out.target_logits[rows][:2], frozen.logits(feats.hidden[a : a + 2]))
        # served at gamma 2 < B 4 the drafter still runs the whole trained block: its 2 slots are the training ones
        drafter = DSparkDrafter(target.model, model, 2, 32, torch.float32, CPU, use_heads=True)
        for b, a in enumerate(anchors.tolist()):
            drafter.reset()
            model.write_context(feats.taps[:a], torch.arange(a), drafter.caches)
            h = drafter.block_hidden(ids[a], torch.tensor([a]), a)
            emb = model.markov_head.w1(ids[a : a + 2])
            torch.testing.assert_close(out.logits[4 * b : 4 * b + 2], frozen.logits(h) + model.markov_head.bias(emb),
                                       rtol=1e-4, atol=1e-4)


def test_target_init_copies_the_targets_last_layers(target_path):
    target = load_frozen_target(ServerArgs(model_path=target_path, device="cpu"))
    opts = dict(block_size=4, num_layers=2, markov_rank=8)
    model, _ = build_trainable_draft(target.config, DSparkOptions(init="target", **opts), CPU, target.model)
    plain, _ = build_trainable_draft(target.config, DSparkOptions(**opts), CPU, target.model)
    src = list(target.model.model.layers)[-2:]
    x = torch.randn(3, target.config.hidden_size)
    for layer, theirs in zip(model.layers, src, strict=True):
        attn = layer.self_attn
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        torch.testing.assert_close(qkv, theirs.self_attn.qkv_proj.weight.float())
        torch.testing.assert_close(attn.o_proj.weight, theirs.self_attn.o_proj.weight.float())
        torch.testing.assert_close(layer.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight)
        with torch.no_grad():  # the MLP computes what the target's does
            torch.testing.assert_close(layer.mlp(x), theirs.mlp(x.to(theirs.mlp.down_proj.weight.dtype)).float())
        assert torch.all(attn.q_norm.weight == 1) and torch.all(attn.k_norm.weight == 1)
    torch.testing.assert_close(model.fc.weight, plain.fc.weight)  # the fusion keeps its (seeded) initialisation
    assert not torch.equal(model.layers[0].mlp.down_proj.weight, plain.layers[0].mlp.down_proj.weight)


def test_target_init_refuses_a_target_of_another_layer_structure(ling_path):
    target = load_frozen_target(ServerArgs(model_path=ling_path, device="cpu"))
    model, _ = build_trainable_draft(target.config, DSparkOptions(block_size=4, num_layers=1, markov_rank=8), CPU)
    with pytest.raises(ConfigError, match=r"draft tensor layers\.0\..* has no counterpart .*--init random"):
        copy_target_layers(model, target.model)
    with pytest.raises(ConfigError, match="choose target or random"):
        build_trainable_draft(target.config, DSparkOptions(block_size=4, num_layers=1, init="copy"), CPU)


def test_bf16_features_feed_an_fp32_draft(target_path):
    """A bf16 target (GPU training, `baton train calibrate`) hands bf16 taps to the fp32 draft: the packed
    forward takes them (the H200 calibrate run of 2026-11-29 failed here with a dtype mismatch)."""
    target = load_frozen_target(ServerArgs(model_path=target_path, device="cpu"))
    model, cfg = build_trainable_draft(target.config, DSparkOptions(block_size=4, num_layers=1, markov_rank=8), CPU)
    frozen = FrozenHead(target.model, CPU)
    ids = torch.tensor([5, 17, 42, 8, 3, 60, 11, 29, 33, 7, 9, 23, 70, 2])
    feats = TargetFeatures(target.model, CPU, cfg.target_layer_ids)(ids.tolist())
    half = type(feats)(feats.hidden.bfloat16(), feats.taps.bfloat16())
    anchors = torch.tensor([4, 7, 11])
    with torch.no_grad():
        want = block_outputs(model, frozen, ids, 4, feats, anchors)
        got = block_outputs(model, frozen, ids, 4, half, anchors)
    assert got.logits.dtype == torch.float32
    torch.testing.assert_close(got.logits, want.logits, rtol=0.05, atol=0.05)


def test_target_rows_cover_each_position_once(target_path):
    """Overlapping blocks share target positions: with host anchors the lm_head runs once per position of the
    blocks' span (``TargetRows``), and the gathered logits equal the lm_head over each slot's own row."""
    from baton.train.dspark import TargetRows, block_hidden_states

    target = load_frozen_target(ServerArgs(model_path=target_path, device="cpu"))
    model, cfg = build_trainable_draft(target.config, DSparkOptions(block_size=4, num_layers=1, markov_rank=8), CPU)
    frozen = FrozenHead(target.model, CPU)
    ids = torch.tensor([5, 17, 42, 8, 3, 60, 11, 29, 33, 7, 9, 23, 70, 2])
    feats = TargetFeatures(target.model, CPU, cfg.target_layer_ids)(ids.tolist())
    with torch.no_grad():
        _, blocks, rows = block_hidden_states(model, frozen, ids, 4, feats, torch.tensor([4, 5, 6, 7, 8, 11]))
        assert isinstance(rows, TargetRows) and rows.hidden.shape[0] == 14 - 4  # positions 4..13, not 24 rows
        per_slot = frozen.logits(feats.hidden[blocks.positions.clamp(max=13)])
        torch.testing.assert_close(rows.logits(frozen), per_slot)
        _, _, sparse = block_hidden_states(model, frozen, ids, 4, feats, torch.tensor([4, 12]))  # span 4..13 > 8
        assert isinstance(sparse, torch.Tensor) and sparse.shape[0] == 8


@pytest.mark.parametrize("markov_rank", [8, 0])  # DSpark, and DFlash (no heads)
def test_batched_loss_equals_the_per_sequence_sum(target_path, markov_rank):
    """``--batched-loss``: one vocabulary pass over the batch gives the per-sequence losses' sum, their gradients and
    their statistics."""
    from baton.train.common import finish_stats, merge_stats
    from baton.train.dspark import DSparkTask

    target = load_frozen_target(ServerArgs(model_path=target_path, device="cpu"))
    opts = DSparkOptions(block_size=4, num_layers=1, markov_rank=markov_rank, num_anchors=5)
    model, cfg = build_trainable_draft(target.config, opts, CPU, target.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # heads off zero, so every term has a gradient
    frozen = FrozenHead(target.model, CPU)
    features = TargetFeatures(target.model, CPU, cfg.target_layer_ids)
    seqs = [([5, 17, 42, 8, 3, 60, 11, 29, 33, 7, 9, 23, 70, 2], 4), ([7, 7, 9, 44, 18, 66, 12, 99, 31], 3),
            ([23, 54, 2, 90, 71, 12, 81, 3, 3, 40, 9, 57], 6)]
    items = [(Sample(ids, p), features(ids)) for ids, p in seqs]
    gen = torch.Generator().manual_seed(0)
    per_seq = DSparkTask(model, cfg, frozen, opts, CPU)
    plans = [per_seq.plan(sample, gen) for sample, _ in items]
    assert not hasattr(per_seq, "batch_loss")  # opt-in only
    want_loss, want_stats = 0.0, {}
    model.zero_grad()
    for (sample, feats), plan in zip(items, plans, strict=True):
        loss, stats = per_seq.loss(sample, feats, plan)
        loss.backward()
        want_loss, want_stats = want_loss + loss.detach(), merge_stats(want_stats, stats)
    want_grads = [p.grad.clone() for p in model.parameters()]
    batched = DSparkTask(model, cfg, frozen, dataclasses.replace(opts, batched_loss=True), CPU)
    model.zero_grad()
    got_loss, got_stats = batched.batch_loss(items, plans)
    got_loss.backward()
    torch.testing.assert_close(got_loss.detach(), want_loss, rtol=1e-5, atol=1e-6)
    assert finish_stats(got_stats) == pytest.approx(finish_stats(want_stats), rel=1e-5)
    for p, w in zip(model.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)


def _greedy(engine, prompts, n=32):
    sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    return [[t for o in engine.generate(Request(p, sp)) for t in o.token_ids] for p in prompts]


@pytest.mark.timeout(150)
def test_dspark_training_end_to_end(tmp_path, target_path, greedy_data):
    train, hold = greedy_data
    out = str(tmp_path / "dspark")
    assert baton_main(["train", "dspark", "--model-path", target_path, "--target-device", "cpu", "--device", "cpu",
                       "--train-data", train, "--output", out, "--steps", "60", "--batch-size", "6", "--lr", "3e-3",
                       "--block-size", "4", "--num-layers", "1", "--markov-rank", "16", "--num-anchors", "24",
                       "--holdout-data", train, "--eval-prompts", "6", "--eval-max-new-tokens", "32",
                       "--eval-every", "60", "--save-dtype", "float32"]) == 0  # fp32: the engine below reads
    metrics = json.load(open(os.path.join(out, "metrics.json")))  # the very weights the last evaluation used
    first, last = metrics["steps"][:3], metrics["steps"][-5:]
    for key, ratio in (("loss", 0.8), ("loss_tv", 0.7)):  # the CE / BCE parts have floors (soft targets)
        assert sum(r[key] for r in last) / 5 < ratio * sum(r[key] for r in first) / 3, key
    evals = metrics["evals"]
    assert evals[-1]["accept_length"] > evals[0]["accept_length"] + 0.7
    prompts = holdout_prompts(train)
    engine = make_engine(target_path, algorithm="DSPARK", draft_model_path=out)
    assert engine.drafter.gamma == 4
    r = measure_accept_length(engine, prompts, 32)
    assert r.outputs == _greedy(make_engine(target_path), prompts)  # greedy output == plain decoding
    assert r.accept_length == pytest.approx(evals[-1]["accept_length"]) and r.accept_length > 2.0

    sts = str(tmp_path / "sts.json")
    assert baton_main(["train", "calibrate", "--model-path", target_path, "--target-device", "cpu", "--device",
                       "cpu", "--draft", out, "--holdout-data", hold, "--output", sts, "--num-anchors", "16"]) == 0
    data = json.load(open(sts))
    assert len(data["temperatures"]) == 4 and len(data["ece_before"]) == 4 and len(data["ece_after"]) == 4
    assert all(a <= b + 1e-12 for a, b in zip(data["ece_after"][:1], data["ece_before"][:1], strict=True))
    assert load_sts_temperatures(sts, 4).shape == (4,)
    assert os.path.isfile(sts.replace(".json", "_reliability.png"))


@pytest.mark.timeout(120)
def test_batched_loss_cli_trains(tmp_path, target_path, greedy_data):
    train, _ = greedy_data
    out = str(tmp_path / "dspark")
    assert train_cli("dspark", target_path, train, out, "--steps", "3", "--batch-size", "3", "--block-size", "4",
                     "--num-layers", "1", "--markov-rank", "8", "--num-anchors", "6", "--batched-loss") == 0
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    assert metrics["dspark_options"]["batched_loss"] is True
    assert len(metrics["steps"]) == 3 and all(math.isfinite(r["loss"]) for r in metrics["steps"])


@pytest.mark.timeout(120)
def test_profile_steps_writes_the_step_profile(tmp_path, target_path, greedy_data):
    """``--profile-steps 2``: steps 11 and 12 under torch.profiler; wall and kernel time per step and the top
    operators land in profile.json / profile.txt and metrics.json. A run of fewer steps profiles nothing."""
    from baton.train.common import PROFILE_START

    train, _ = greedy_data
    args = ("--batch-size", "2", "--block-size", "4", "--num-layers", "1", "--markov-rank", "4", "--num-anchors", "4",
            "--profile-steps", "2")
    out = str(tmp_path / "profiled")
    assert train_cli("dspark", target_path, train, out, "--steps", str(PROFILE_START + 2), *args) == 0
    prof = json.load(open(os.path.join(out, "profile.json")))
    assert prof["steps"] == 2 and prof["first_step"] == PROFILE_START + 1 and prof["wall_ms_per_step"] > 0
    assert prof["device_kernel_ms_per_step"] == 0 and prof["top_device_ms_per_step"] == []  # CPU: no GPU kernels
    assert prof["top_host_ms_per_step"] and all(ms >= 0 for _, ms in prof["top_host_ms_per_step"])
    assert "wall" in open(os.path.join(out, "profile.txt")).readline()
    assert json.load(open(os.path.join(out, "metrics.json")))["profile"] == prof
    short = str(tmp_path / "short")
    assert train_cli("dspark", target_path, train, short, "--steps", "3", *args) == 0
    assert not os.path.exists(os.path.join(short, "profile.json"))
    assert json.load(open(os.path.join(short, "metrics.json")))["profile"] is None


def test_to_device_copies_host_tensors():
    from baton.train.common import to_device

    x = torch.arange(10)
    assert torch.equal(to_device(x, torch.device("cpu")), x)


@pytest.mark.gpu
def test_to_device_async_copy_on_cuda(monkeypatch):
    """The pinned, non-blocking copy lands the same values (read after the stream's queue), and
    BATON_TRAIN_ASYNC_H2D=0 takes the plain copy."""
    from baton.train.common import to_device

    dev = torch.device("cuda")
    x = torch.arange(1000, dtype=torch.long)
    for flag in ("1", "0"):
        monkeypatch.setenv("BATON_TRAIN_ASYNC_H2D", flag)
        y = to_device(x, dev)
        assert y.device.type == "cuda" and torch.equal(y.cpu(), x)


@pytest.mark.timeout(300)
def test_grow_layers_keeps_the_function_and_fp8_storage_loads(tmp_path, target_path, greedy_data):
    """--grow-layers 2 from a 1-layer draft: the new layer starts with zero output projections, so with lr 0 the
    grown draft drafts exactly what the original does (same accept length, same greedy output as plain decoding).
    --save-dtype fp8 writes the matrices in e4m3 with block scales; the serving loader dequantises them."""
    from safetensors.torch import load_file

    from baton.config import load_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft

    train, _ = greedy_data
    start = str(tmp_path / "start")
    write_random_dspark_draft(load_model_config(target_path), start, seed=3, block_size=4, markov_rank=8)
    grown = str(tmp_path / "grown")
    assert train_cli("dspark", target_path, train, grown, "--steps", "1", "--batch-size", "2", "--lr", "0",
                     "--save-dtype", "float32", "--init-from", start, "--grow-layers", "2") == 0
    cfg = json.load(open(os.path.join(grown, "config.json")))
    assert cfg["num_hidden_layers"] == 2
    w = load_file(os.path.join(grown, "model.safetensors"))
    assert float(w["layers.1.self_attn.o_proj.weight"].abs().max()) == 0.0
    assert float(w["layers.1.mlp.down_proj.weight"].abs().max()) == 0.0
    assert float(w["layers.1.self_attn.q_proj.weight"].abs().max()) > 0.0
    torch.testing.assert_close(w["layers.0.mlp.down_proj.weight"],
                               load_file(os.path.join(start, "model.safetensors"))["layers.0.mlp.down_proj.weight"])
    prompts = holdout_prompts(train)[:3]
    plain = _greedy(make_engine(target_path), prompts, 16)
    a = measure_accept_length(make_engine(target_path, algorithm="DSPARK", draft_model_path=start), prompts, 16)
    b = measure_accept_length(make_engine(target_path, algorithm="DSPARK", draft_model_path=grown), prompts, 16)
    assert a.outputs == b.outputs == plain
    assert b.accept_length == pytest.approx(a.accept_length)

    q8 = str(tmp_path / "fp8")
    assert train_cli("dspark", target_path, train, q8, "--steps", "1", "--batch-size", "2", "--lr", "0",
                     "--save-dtype", "fp8", "--init-from", start) == 0
    t = load_file(os.path.join(q8, "model.safetensors"))
    assert t["layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert "layers.0.mlp.down_proj.weight_scale_inv" in t
    assert os.path.getsize(os.path.join(q8, "model.safetensors")) < 0.7 * os.path.getsize(
        os.path.join(start, "model.safetensors")) / 2  # under 70% of a bf16 file (the start is fp32)
    c = measure_accept_length(make_engine(target_path, algorithm="DSPARK", draft_model_path=q8), prompts, 16)
    assert c.outputs == plain  # the gate holds whatever the draft's rounding


def test_grow_layers_needs_init_from_and_more_layers(tmp_path, target_path, greedy_data, capsys):
    from baton.config import load_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft

    train, _ = greedy_data
    start = str(tmp_path / "start")
    write_random_dspark_draft(load_model_config(target_path), start, block_size=4, markov_rank=8, num_layers=2)
    out = str(tmp_path / "o")
    assert train_cli("dspark", target_path, train, out, "--steps", "1", "--grow-layers", "2") == 2
    assert "--grow-layers needs --init-from" in capsys.readouterr().err
    assert train_cli("dspark", target_path, train, out, "--steps", "1", "--grow-layers", "2", "--init-from", start) == 2
    assert "has 2 layer(s)" in capsys.readouterr().err
