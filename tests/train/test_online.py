"""Online target features: the provider equals a direct forward; the prefetching producer keeps order,
re-raises worker errors and stops early."""

from __future__ import annotations

import pytest
import torch

from baton.config import ServerArgs
from baton.layers.context import ModelRunner
from baton.train.common import Sample, batches
from baton.train.online import FeaturePrefetcher, TargetFeatures
from baton.train.runner import load_frozen_target
from baton.types import ForwardMode

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(target_path):
    return load_frozen_target(ServerArgs(model_path=target_path, device="cpu"))


def _direct(model, ids: list[int], capture: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    runner = ModelRunner(model.make_cache(len(ids) + 4, torch.float32, CPU), CPU)
    with torch.no_grad():
        ctx = runner.context(ForwardMode.PREFILL, 0, len(ids), capture)
        return model(torch.tensor(ids), ctx), ctx.captured


def test_features_equal_a_direct_forward(target):
    provider = TargetFeatures(target.model, CPU, layer_ids=[1, 0], max_len=8)  # grows its cache on demand
    for ids in ([5, 17, 42, 8, 3, 9, 9, 40, 2, 71, 33], [7, 7, 9]):
        feats = provider(ids)
        hidden, captured = _direct(target.model, ids, (0, 1))
        assert feats.hidden.shape == (len(ids), 48) and feats.taps.shape == (len(ids), 96)
        torch.testing.assert_close(feats.hidden, hidden, rtol=0, atol=0)
        torch.testing.assert_close(feats.taps, torch.cat([captured[1], captured[0]], -1), rtol=0, atol=0)
        assert not feats.hidden.requires_grad
    assert TargetFeatures(target.model, CPU)(ids).taps is None  # NEXTN needs only the final hidden states


def test_batched_features_equal_one_at_a_time(target, monkeypatch):
    """``many`` (one padded transformers forward per chunk, lengths mixed, split by MAX_BATCH_TOKENS) gives
    each sequence the features baton's own forward gives it alone, taps in the requested order."""
    pytest.importorskip("transformers")
    provider = TargetFeatures(target.model, CPU, layer_ids=[1, 0])
    seqs = [[5, 17, 42, 8, 3, 9, 9, 40, 2, 71, 33], [7, 7, 9], [60, 11, 29, 33, 5], [4, 4]]
    monkeypatch.setattr(TargetFeatures, "MAX_BATCH_TOKENS", 12)  # forces several chunks
    got = provider.many(seqs)
    assert provider._hf not in (None, False), "the batched path was not taken"
    for ids, f in zip(seqs, got, strict=True):
        want = provider(ids)
        assert f.hidden.shape == want.hidden.shape and f.taps.shape == want.taps.shape
        torch.testing.assert_close(f.hidden, want.hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f.taps, want.taps, rtol=1e-5, atol=1e-5)


def test_batched_features_fall_back_for_other_targets(ling_path):
    ling = load_frozen_target(ServerArgs(model_path=ling_path, device="cpu"))
    provider = TargetFeatures(ling.model, CPU)
    seqs = [[5, 17, 42, 8], [7, 7, 9]]
    got = provider.many(seqs)
    assert provider._hf is False
    for ids, f in zip(seqs, got, strict=True):
        torch.testing.assert_close(f.hidden, provider(ids).hidden, rtol=0, atol=0)


def test_prefetcher_keeps_order(target):
    provider = TargetFeatures(target.model, CPU, layer_ids=[1])
    samples = [Sample([3 + i, 9, 27, 4 + i, 50], 2) for i in range(7)]
    expected = [provider(s.ids).hidden for s in samples]
    got = []
    with FeaturePrefetcher(provider, batches(samples, 3, num_steps=5, seed=0), CPU, depth=1) as pf:
        for batch in pf:
            assert len(batch) in (1, 3)
            got += [(s, f) for s, f in batch]
    order = [s.ids[0] - 3 for s, _ in got]
    assert sorted(order[:7]) == list(range(7)) and len(got) == 3 + 3 + 1 + 3 + 3  # two epochs, 5 steps
    for s, f in got:
        torch.testing.assert_close(f.hidden, expected[s.ids[0] - 3])


def test_prefetcher_reraises_and_stops(target):
    provider = TargetFeatures(target.model, CPU)
    bad = [[Sample([3, 4, 5], 1)], [Sample([3, 4, 1000], 1)]]  # id 1000 is outside the vocabulary
    with pytest.raises(IndexError), FeaturePrefetcher(provider, iter(bad), CPU) as pf:
        list(pf)
    many = ([Sample([3, 4, 5, i % 90], 1)] for i in range(10_000))
    with FeaturePrefetcher(provider, many, CPU, depth=2) as pf:
        first = next(iter(pf))
    assert first[0][0].ids == [3, 4, 5, 0] and not pf._thread.is_alive()


def test_close_waits_for_the_batch_in_flight(target, monkeypatch):
    """A training run cut short (time budget) closes the prefetcher while the worker computes a batch; close
    waits for it, bounded by CLOSE_TIMEOUT_S: a daemon thread still in a torch op at interpreter exit aborted a
    CPU recipe run (2026-11-30). The old bound was 10 s, so a slow batch outlived it."""
    import time

    from baton.train import online

    provider = TargetFeatures(target.model, CPU)
    real_many = provider.many

    def slow_many(seqs):
        time.sleep(0.6)
        return real_many(seqs)

    monkeypatch.setattr(provider, "many", slow_many)
    monkeypatch.setattr(online, "CLOSE_TIMEOUT_S", 5.0)
    many = ([Sample([3, 4, 5, i % 90], 1)] for i in range(100))
    pf = FeaturePrefetcher(provider, many, CPU, depth=1)
    next(iter(pf))  # the worker is now inside the next batch's slow forward
    t0 = time.perf_counter()
    pf.close()
    assert not pf._thread.is_alive() and time.perf_counter() - t0 < 5.0
