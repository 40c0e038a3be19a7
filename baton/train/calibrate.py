"""Sequential Temperature Scaling (STS) of the DSpark confidence head (dspark-dflash.md §4.3,
``baton train calibrate``).

The confidence head gives raw logits z_k per slot; served, ``c_k = sigmoid(z_k / T_k)`` and the prefix
survival is ``a_k = prod_{i<=k} c_i``, the probability that drafts 1..k are all accepted. On held-out data,
left to right over k, STS grid-searches the scalar T_k that minimises the expected calibration error (ECE)
of a_k against the observed prefix acceptance, with T_1..T_{k-1} already fixed. The result is the JSON
``--speculative-dspark-confidence-sts-path`` reads::

    {"temperatures": [T_1, ..., T_gamma], "ece_before": [...], "ece_after": [...], ...}

Observed acceptance (``--mode``):

- ``greedy`` (default; what greedy serving sees): slot k is accepted when the draft's argmax (Markov chain
  teacher-forced on the recorded tokens) equals the target's argmax at that position; the prefix acceptance
  y_k is the product over slots 0..k. Only greedy (temperature 0) held-out records are used when there are
  any, since there the recorded continuation is the target's argmax chain;
- ``soft``: y_k = prod_{i<=k} c*_i with c* = 1 - 0.5 ||p_d - p_t||_1, the analytic acceptance probability of
  rejection sampling at T = 1 (the confidence head's training label).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from baton import env
from baton.models.dspark import DSparkDraftModel
from baton.train.common import FrozenHead, Sample, autocast, fast_fp32_matmul
from baton.train.dspark import block_outputs, sample_anchors
from baton.train.online import TargetFeatures

log = logging.getLogger(__name__)


def ece(pred: torch.Tensor, label: torch.Tensor, num_bins: int = 15) -> float:
    """Expected calibration error of probabilities ``pred`` [N] against outcomes ``label`` [N] (0/1 or soft):
    equal-width bins over [0, 1], sum over bins of (bin count / N) * |mean pred - mean label|."""
    if pred.numel() == 0:
        return 0.0
    pred, label = pred.double().flatten(), label.double().flatten()
    idx = (pred * num_bins).long().clamp(0, num_bins - 1)
    sum_p = torch.bincount(idx, weights=pred, minlength=num_bins)
    sum_y = torch.bincount(idx, weights=label, minlength=num_bins)
    return float((sum_p - sum_y).abs().sum() / pred.numel())


def default_grid() -> torch.Tensor:
    """Candidate temperatures: 241 log-spaced values in [0.05, 20] (1.0 included)."""
    return torch.logspace(math.log10(0.05), math.log10(20.0), 241, dtype=torch.float64)


@dataclass
class StsResult:
    temperatures: list[float]
    ece_before: list[float]  # ECE of a_k with every T = 1
    ece_after: list[float]  # ECE of a_k with the fitted T_1..T_k
    num_samples: list[int]  # blocks with slot k valid

    def to_json(self, **extra: object) -> dict:
        return {**asdict(self), **extra}


def fit_sts(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None = None, num_bins: int = 15,
            grid: torch.Tensor | None = None) -> StsResult:
    """z [N, gamma] raw confidence logits, y [N, gamma] observed prefix acceptance (0/1 or soft), valid
    [N, gamma] bool (slot k of block n observed; valid prefixes) -> temperatures and ECE before / after."""
    z, y = z.double(), y.double()
    valid = torch.ones_like(z, dtype=torch.bool) if valid is None else valid.bool()
    grid = default_grid() if grid is None else grid.double()
    raw = torch.sigmoid(z).cumprod(dim=1)  # a_k with T = 1
    prefix = torch.ones(z.shape[0], dtype=torch.float64)
    temps, before, after, counts = [], [], [], []
    for k in range(z.shape[1]):
        m = valid[:, k]
        zk, yk, pk = z[m, k], y[m, k], prefix[m]
        cand = pk[None, :] * torch.sigmoid(zk[None, :] / grid[:, None])  # [G, N_k]
        errs = torch.tensor([ece(c, yk, num_bins) for c in cand])
        best = int(errs.argmin()) if m.any() else int((grid - 1.0).abs().argmin())
        t = float(grid[best])
        temps.append(t)
        before.append(ece(raw[m, k], yk, num_bins))
        after.append(float(errs[best]) if m.any() else 0.0)
        counts.append(int(m.sum()))
        prefix = prefix * torch.sigmoid(z[:, k] / t)
    return StsResult(temps, before, after, counts)


# ---- collecting (z, y) on held-out data ----


@dataclass
class ConfidenceData:
    z: torch.Tensor  # [N, gamma] raw confidence logits
    y: torch.Tensor  # [N, gamma] observed prefix acceptance
    valid: torch.Tensor  # [N, gamma] bool


@torch.no_grad()
def collect_confidence(model: DSparkDraftModel, frozen: FrozenHead, provider: TargetFeatures,
                       samples: Sequence[Sample], device: torch.device, num_anchors: int = 64, mode: str = "greedy",
                       seed: int = 0) -> ConfidenceData:
    """Run the draft teacher-forced over random anchors of every held-out sample; return (z, y, valid)."""
    if model.confidence_head is None:
        raise ValueError("STS needs a DSpark draft (a Markov and a confidence head)")
    if mode not in ("greedy", "soft"):
        raise ValueError(f"mode {mode!r}: choose greedy or soft")
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    zs, ys, vs = [], [], []
    for sample in tqdm(samples, desc="confidence", unit="seq", disable=env.disable_progress()):
        anchors = sample_anchors(sample, num_anchors, gen)
        if anchors.numel() == 0:
            continue
        feats = provider(sample.ids).to(device)
        ids = torch.tensor(sample.ids, dtype=torch.long, device=device)
        # as in training: bf16 target features meet the fp32 draft under bf16 autocast
        with fast_fp32_matmul(device), autocast(device):
            out = block_outputs(model, frozen, ids, sample.prompt_len, feats, anchors)
        gamma = out.blocks.valid.shape[1]
        valid = out.blocks.valid.float().cumprod(1).bool()  # [n, gamma]
        if mode == "greedy":
            accepted = (out.logits.argmax(-1) == out.target_logits.argmax(-1)).view(-1, gamma).double()
        else:
            p_d, p_t = torch.softmax(out.logits, -1), torch.softmax(out.target_logits, -1)
            accepted = (1 - 0.5 * (p_d - p_t).abs().sum(-1)).clamp(0, 1).view(-1, gamma).double()
        zs.append(out.conf_logits.view(-1, gamma).double().cpu())
        ys.append((accepted * valid).cumprod(1).cpu())
        vs.append(valid.cpu())
    if not zs:
        raise ValueError("no held-out blocks to calibrate on")
    return ConfidenceData(torch.cat(zs), torch.cat(ys), torch.cat(vs))


def greedy_first(samples: Sequence[Sample]) -> list[Sample]:
    """The temperature-0 records when there are any (their continuation is the target's argmax chain)."""
    greedy = [s for s in samples if float(s.meta.get("temperature", 0.0)) == 0.0]
    return greedy or list(samples)


def write_sts(result: StsResult, path: str, **extra: object) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result.to_json(**extra), f, indent=1)
        f.write("\n")


def plot_reliability(data: ConfidenceData, result: StsResult, path: str, num_bins: int = 10) -> None:
    """Reliability of a_k before / after STS, pooled over slots (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = torch.tensor(result.temperatures, dtype=torch.float64)
    curves = {"raw (T = 1)": torch.sigmoid(data.z).cumprod(1), "STS": torch.sigmoid(data.z / temps).cumprod(1)}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    ax = axes[0]
    ax.plot([0, 1], [0, 1], "k:", lw=1)
    for name, a in curves.items():
        p, y = a[data.valid], data.y[data.valid]
        idx = (p * num_bins).long().clamp(0, num_bins - 1)
        xs, ys = [], []
        for b in range(num_bins):
            sel = idx == b
            if sel.any():
                xs.append(float(p[sel].mean()))
                ys.append(float(y[sel].mean()))
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("predicted prefix survival a_k")
    ax.set_ylabel("observed")
    ax.legend()
    ax = axes[1]
    ks = list(range(1, len(result.temperatures) + 1))
    ax.plot(ks, result.ece_before, marker="o", label="ECE raw")
    ax.plot(ks, result.ece_after, marker="o", label="ECE STS")
    ax.set_xlabel("slot k")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["ConfidenceData", "StsResult", "collect_confidence", "default_grid", "ece", "fit_sts", "greedy_first",
           "plot_reliability", "write_sts"]
