"""STS: ECE on a hand example, and sequential temperature scaling recovers the temperatures of a synthetic,
overconfident confidence head (its ECE falls), in the JSON format the engine reads."""

from __future__ import annotations

import torch

from baton.speculative.dspark import load_sts_temperatures
from baton.train.calibrate import ece, fit_sts, write_sts


def test_ece_hand_example():
    pred = torch.tensor([0.1, 0.1, 0.9, 0.9])
    label = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin of 0.1: mean pred 0.1 vs 0.5 (2/4 of the data); bin of 0.9: 0.9 vs 1.0 (2/4)
    assert abs(ece(pred, label, num_bins=10) - (0.5 * 0.4 + 0.5 * 0.1)) < 1e-6
    assert ece(torch.tensor([0.25, 0.75]), torch.tensor([0.25, 0.75])) == 0.0  # soft labels
    assert ece(torch.tensor([]), torch.tensor([])) == 0.0


def _synthetic(n: int, true_temps: list[float], seed: int = 0):
    """Raw logits z; the true per-slot acceptance is sigmoid(z_k / T_k); y is the observed prefix acceptance."""
    g = torch.Generator().manual_seed(seed)
    gamma = len(true_temps)
    z = torch.randn(n, gamma, generator=g) * 3 + 1.0
    p = torch.sigmoid(z / torch.tensor(true_temps))
    accepted = (torch.rand(n, gamma, generator=g) < p).double()
    return z, accepted.cumprod(1)


def test_sts_reduces_ece_on_a_miscalibrated_head(tmp_path):
    true_temps = [3.0, 2.0, 0.7, 1.5]  # the raw head is overconfident on slots 1, 2, 4 and timid on 3
    z, y = _synthetic(40_000, true_temps)
    result = fit_sts(z, y)
    for t, want in zip(result.temperatures, true_temps, strict=True):
        assert abs(t - want) / want < 0.15
    assert all(a < b for a, b in zip(result.ece_after, result.ece_before, strict=True))
    assert result.ece_before[0] > 0.05 and max(result.ece_after) < 0.02
    valid = torch.ones_like(z, dtype=torch.bool)
    valid[::2, 2:] = False  # shorter blocks: later slots observed less often
    partial = fit_sts(z, y, valid)
    assert partial.num_samples == [40_000, 40_000, 20_000, 20_000]
    path = str(tmp_path / "sts.json")
    write_sts(result, path, mode="greedy")
    torch.testing.assert_close(load_sts_temperatures(path, 4), torch.tensor(result.temperatures, dtype=torch.float32))
