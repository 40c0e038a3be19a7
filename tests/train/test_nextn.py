"""NEXTN head training: the unrolled training forward is the serving chain, and a few dozen steps on the
target's own greedy sequences overfit them and lift the accept length in the Engine."""

from __future__ import annotations

import json
import os

import pytest
import torch

from baton.cli import main as baton_main
from baton.config import ServerArgs
from baton.layers.context import ModelRunner
from baton.train.common import FrozenHead
from baton.train.evaluate import holdout_prompts, measure_accept_length
from baton.train.nextn import NextNOptions, build_trainable_head, chain_mask, step_rows, unrolled_forward
from baton.train.online import TargetFeatures
from baton.train.runner import load_frozen_target
from baton.types import ForwardMode, Request, SamplingParams
from tests.speculative.conftest import make_engine

CPU = torch.device("cpu")


def test_chain_rows_and_mask():
    assert step_rows(6, 3) == [4, 3, 2]  # step s: rows t = 0 .. T-2-s
    m = chain_mask(2, [4, 3])
    expected = torch.tensor([  # step-1 keys (t' <= t) | step-2 keys (same row only)
        [1, 0, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, expected)
    assert torch.equal(chain_mask(1, [4]), torch.ones(4, 4).tril().bool())
    assert chain_mask(3, [4, 3, 2]).shape == (2, 9) and chain_mask(3, [4, 3, 2])[1].tolist() == [
        True, True, False, False, False, True, False, False, True]


def test_unrolled_forward_is_the_serving_chain(target_path):
    target = load_frozen_target(ServerArgs(model_path=target_path, device="cpu"))
    head, _ = build_trainable_head(target.model, target.config, NextNOptions(init="random"), CPU)
    frozen = FrozenHead(target.model, CPU)
    ids = torch.tensor([5, 17, 42, 8, 3, 60, 11, 29, 33, 7, 9, 23])
    hidden = TargetFeatures(target.model, CPU)(ids.tolist()).hidden
    with torch.no_grad():
        outs = unrolled_forward(head, frozen, ids, hidden, 3)
        runner = ModelRunner(head.make_cache(32, torch.float32, CPU), CPU)
        p = 6  # the anchor position: committed context rows 0 .. p-1
        g = head(frozen.embed(ids[1 : p + 1]), hidden[:p], runner.context(ForwardMode.PREFILL, 0, p))
        torch.testing.assert_close(g, outs[0][:p], rtol=1e-5, atol=1e-5)  # step 1 = teacher-forced rows
        for s in (2, 3):  # chain step s from row p-1 sits at position p+s-2 with the head's own hidden state
            g = head(frozen.embed(ids[p + s - 1 : p + s]), g[-1:], runner.context(ForwardMode.DRAFT, p + s - 2, 1))
            torch.testing.assert_close(g[0], outs[s - 1][p - 1], rtol=1e-5, atol=1e-5)


def test_batch_loss_equals_the_per_sample_sum(target_path):
    """The padded one-forward batch gives the per-sample losses' sum, statistics and gradients."""
    from baton.train.common import Sample, finish_stats, merge_stats
    from baton.train.nextn import NextNTask

    target = load_frozen_target(ServerArgs(model_path=target_path, device="cpu"))
    head, body_cfg = build_trainable_head(target.model, target.config, NextNOptions(init="random"), CPU)
    frozen = FrozenHead(target.model, CPU)
    task = NextNTask(head, body_cfg, frozen, NextNOptions(unroll_steps=3), CPU)
    provider = TargetFeatures(target.model, CPU)
    samples = [Sample([5, 17, 42, 8, 3, 60, 11, 29, 33, 7, 9, 23], 4), Sample([7, 7, 9, 40, 2], 2),
               Sample([60, 11, 29, 33, 5, 81, 3, 3, 40], 6), Sample([4, 4, 12], 1)]
    items = [(smp, provider(smp.ids)) for smp in samples]
    gen = torch.Generator().manual_seed(0)
    plans = [task.plan(smp, gen) for smp in samples]

    head.zero_grad()
    want, want_stats = torch.zeros(()), {}
    for (smp, feats), plan in zip(items, plans, strict=True):
        loss, st = task.loss(smp, feats, plan)
        want = want + loss
        merge_stats(want_stats, st)
    want.backward()
    want_grads = [p.grad.clone() for p in head.parameters()]

    head.zero_grad()
    got, got_stats = task.batch_loss(items, plans)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert finish_stats(got_stats) == pytest.approx(finish_stats(want_stats), rel=1e-5)
    for g, w in zip((p.grad for p in head.parameters()), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-5)  # fp32 sums in another order


def _accept(target_path: str, draft: str, prompts) -> tuple[float, list[list[int]]]:
    engine = make_engine(target_path, algorithm="NEXTN", draft_model_path=draft, num_steps=3)
    r = measure_accept_length(engine, prompts, 32)
    return r.accept_length, r.outputs


@pytest.mark.timeout(120)
def test_nextn_training_overfits_and_accepts_more(tmp_path, target_path, greedy_data):
    train, _ = greedy_data
    out = str(tmp_path / "nextn")
    assert baton_main(["train", "nextn", "--model-path", target_path, "--target-device", "cpu", "--device", "cpu",
                       "--train-data", train, "--output", out, "--steps", "40", "--batch-size", "6", "--lr", "3e-3",
                       "--init", "random", "--unroll-steps", "2", "--holdout-data", train, "--eval-prompts", "6",
                       "--eval-max-new-tokens", "32", "--eval-every", "40"]) == 0
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    losses = [r["loss"] for r in metrics["steps"]]
    assert sum(losses[-5:]) / 5 < 0.25 * sum(losses[:3]) / 3  # overfits the small repeated set
    evals = metrics["evals"]
    assert [e["step"] for e in evals] == [0, 40]
    assert evals[-1]["accept_length"] > evals[0]["accept_length"] + 0.5  # trained vs the random init
    assert os.path.getsize(os.path.join(out, "train_curves.png")) > 1000
    # the written checkpoint loads into the Engine, greedy output unchanged (the invariant), accepts more
    prompts = holdout_prompts(train)
    accept, outputs = _accept(target_path, out, prompts)
    plain = make_engine(target_path)
    sp = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    assert outputs == [[t for o in plain.generate(Request(p, sp)) for t in o.token_ids] for p in prompts]
    assert accept == pytest.approx(evals[-1]["accept_length"])
    assert accept > 2.0
