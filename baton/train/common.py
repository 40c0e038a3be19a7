"""Shared pieces of ``baton train``: training records (JSONL) and batching, the frozen target embedding and
lm_head on the trainer device, masked attention for training forwards, AdamW with warmup + cosine, the
training loop (gradient accumulation over the sequences of a batch, one global loss normaliser), and the
metric log with its loss / accept-length curves (PNG).

A training record (one line of the JSONL ``baton train data`` writes) holds at least ``prompt_ids`` and
``response_ids``; the sequence is their concatenation and losses are taken on response positions only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from baton import env
from baton.plotting import can_plot
from baton.train.dp import DataParallel, plan_generator

log = logging.getLogger(__name__)


# ---- records and batches ----


@dataclass
class Sample:
    ids: list[int]  # prompt + response token ids
    prompt_len: int  # labels at positions >= prompt_len are response tokens (trained on)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, rows: Sequence[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_samples(path: str, max_len: int | None = None, min_response: int = 2) -> list[Sample]:
    """Training records -> Samples (sequences cut at ``max_len``; ones with < ``min_response`` response tokens
    left are dropped)."""
    out = []
    for row in read_jsonl(path):
        ids = list(row["prompt_ids"]) + list(row["response_ids"])
        if max_len is not None:
            ids = ids[:max_len]
        if len(ids) - len(row["prompt_ids"]) < min_response:
            continue
        meta = {k: v for k, v in row.items() if k not in ("prompt_ids", "response_ids")}
        out.append(Sample(ids, len(row["prompt_ids"]), meta))
    return out


def batches(samples: Sequence[Sample], batch_size: int, num_steps: int, seed: int) -> Iterator[list[Sample]]:
    """``num_steps`` batches of ``batch_size`` samples: epochs of a seeded shuffle, the last batch of an epoch
    may be short."""
    if not samples:
        raise ValueError("no training samples")
    rng = random.Random(seed)
    step = 0
    while True:
        order = list(range(len(samples)))
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            if step >= num_steps:
                return
            yield [samples[j] for j in order[i : i + batch_size]]
            step += 1


def steps_for(num_samples: int, batch_size: int, epochs: float, steps: int | None) -> int:
    return steps if steps is not None else max(1, math.ceil(epochs * math.ceil(num_samples / batch_size)))


# ---- the frozen target pieces the draft shares ----


class FrozenHead:
    """The target's input embedding and lm_head weights on the trainer device (shared, never trained, never
    written into a draft checkpoint). With the target on the same device these are the target's tensors."""

    def __init__(self, target: nn.Module, device: torch.device) -> None:
        vocab = target.config.vocab_size
        self.embed_weight = target.embed_tokens.weight.detach()[:vocab].to(device)  # [V, d]
        self.head_weight = target.lm_head_weight.detach()[:vocab].to(device)  # [V, d]
        self.vocab_size = vocab
        # the fp32 copy ``logits`` multiplies by, made once (a bf16 target's was re-made twice a sequence)
        self._head_fp32 = self.head_weight if self.head_weight.dtype == torch.float32 else self.head_weight.float()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, d] in the target dtype."""
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] -> fp32 logits [N, V] (as ``CausalLM.compute_logits`` with lm_head_fp32)."""
        with _no_autocast(hidden.device):
            return hidden.float() @ self._head_fp32.t()


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def fast_fp32_matmul(device: torch.device):
    """TF32 for the fp32 matmuls of a training run on CUDA (the frozen lm_head's fp32 logits over a 49k-152k
    vocabulary dominate a step's FLOPs; TF32 runs them on the tensor cores at ~1e-3 relative error, the same
    order as the bf16 lm_head the served target uses). No effect on CPU; the previous setting is restored.
    ``BATON_TRAIN_TF32=0`` keeps full fp32 (an A/B switch; the step times of both are in docs/performance.md)."""
    if device.type != "cuda" or not env.train_tf32():
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def autocast(device: torch.device):
    """bf16 autocast on CUDA, plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv], mask [T, S] bool (True = visible) -> [T, H, Dv]; or with a
    leading batch dim on q, k, v (the mask shared by the batch). Differentiable (SDPA); every query row must
    see at least one key.

    The unbatched form calls SDPA with 3-d tensors: the 4-d call picks the memory-efficient kernel for a boolean
    mask, which made a DSpark training step several times slower on the H200 (docs/performance.md)."""
    h = q.dim() - 2  # the heads' dim: 1 unbatched (SDPA then gets 3-d tensors, as it always did), 2 batched
    rep = q.shape[h] // k.shape[h]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=h), v.repeat_interleave(rep, dim=h)
    v = v.to(q.dtype)
    o = F.scaled_dot_product_attention(q.transpose(h - 1, h), k.to(q.dtype).transpose(h - 1, h),
                                       v.transpose(h - 1, h), attn_mask=mask, scale=scale)  # [(B,) H, T, Dv]
    return o.transpose(h - 1, h)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a stream sync: on CUDA through pinned memory, copied asynchronously
    (a copy from pageable memory, ``torch.tensor(..., device=cuda)`` included, waits for the GPU to drain its queue,
    so a training step that makes one per sequence keeps the GPU from running ahead of the host; the caching pinned
    allocator keeps the buffer until the copy is done)."""
    if device.type != "cuda" or x.device.type != "cpu" or not env.train_async_h2d():
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def resolve_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---- optimisation ----


@dataclass
class TrainOptions:
    output: str
    steps: int | None = None  # None: ``epochs`` over the data
    epochs: float = 1.0
    batch_size: int = 8  # sequences per optimiser step
    lr: float = 6e-4
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    weight_decay: float = 0.0
    warmup_frac: float = 0.04
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate the accept length only at the end (when an evaluator is given)
    max_seq_len: int = 2048
    prefetch: int = 2  # batches of target features computed ahead
    save_dtype: str = "bfloat16"  # dtype of the saved draft's floating tensors (training runs in fp32)
    time_budget: float | None = None  # seconds of optimiser steps: the step count is fitted to it (``replan``)
    profile_steps: int = 0  # > 0: torch.profiler over that many steps after PROFILE_START (``StepProfiler``)


def lr_at(step: int, total: int, opts: TrainOptions) -> float:
    """Linear warmup over ``warmup_frac`` of the steps, then cosine from lr down to lr * min_lr_ratio."""
    warmup = max(1, int(round(opts.warmup_frac * total)))
    if step < warmup:
        return opts.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    floor = opts.lr * opts.min_lr_ratio
    return floor + (opts.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# Steps at which a --time-budget run re-estimates its step time and sets its step count to what fits: the first
# estimate skips the first few steps (allocator and kernel warm-up), the later ones refine it, up or down (early
# steps can be several times slower than the steady state, so a single early estimate cuts a run far short of
# its budget; docs/performance.md has the run that showed it).
REPLAN_AT = (20, 100, 400, 1000)
REPLAN_SKIP = 5


def replan(total: int, done: int, elapsed: float, window_s: float, budget: float,
           window_steps: int | None = None) -> int:
    """The step count that fits ``budget`` seconds: ``done`` steps took ``elapsed`` s, the last
    ``window_steps`` of them (default ``done - REPLAN_SKIP``) ``window_s`` s (the per-step estimate). Never
    more than ``total`` nor less than ``done`` (a budget already spent ends the run at the next step)."""
    n = done - REPLAN_SKIP if window_steps is None else window_steps
    per_step = window_s / max(1, n)
    fits = done + int(max(0.0, budget - elapsed) / max(per_step, 1e-9))
    return max(done, min(total, fits))


def make_optimizer(module: nn.Module, opts: TrainOptions) -> torch.optim.AdamW:
    """AdamW; norms, biases and 1-d parameters take no weight decay."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": opts.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)


# ---- the loop ----


class Plan(Protocol):
    weight_sum: float  # the sample's total loss weight (known before the forward)


# name -> (sum, count): logged as sum / count over the batch. A sum may stay a 0-d device tensor until the step
# ends (``finish_stats``), so that logging costs one device sync per step, not several per sample.
Stats = dict[str, tuple["float | torch.Tensor", float]]


class Task(Protocol):
    """What ``train_loop`` drives: a trainable module, a per-sample plan (anchors, label weights) and the
    weighted loss sum of one sample with its logged statistics."""

    module: nn.Module

    def plan(self, sample: Sample, gen: torch.Generator) -> Plan: ...

    def loss(self, sample: Sample, feats: Any, plan: Plan) -> tuple[torch.Tensor, Stats]: ...

    def save(self, path: str) -> None: ...


@dataclass
class History:
    """What one training run logged: per-step records and (step, accept length) evaluations."""

    steps: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    profile: dict[str, Any] | None = None  # ``StepProfiler``'s summary (``--profile-steps``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PROFILE_START = 10  # steps before a profiled window (allocator growth, kernel autotuning and caches settle)


class StepProfiler:
    """``--profile-steps N``: torch.profiler (host, and the GPU's kernels on CUDA) over optimiser steps
    ``PROFILE_START .. PROFILE_START + N - 1``, the background target-feature thread included. Writes
    ``profile.txt`` (the operator tables by device and by host time) and ``profile.json`` into the run's output:
    wall time per step against the GPU's kernel time per step says whether a step waits on the GPU or on the host.
    A run with fewer steps writes nothing."""

    def __init__(self, num_steps: int, out_dir: str, device: torch.device, rank0: bool = True) -> None:
        self.n, self.out_dir, self.device, self.rank0 = num_steps, out_dir, device, rank0
        self.first, self.last = PROFILE_START, PROFILE_START + num_steps - 1
        self.prof: Any = None
        self.t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, step: int) -> None:
        if self.n <= 0 or step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def after(self, step: int) -> dict[str, Any] | None:
        if self.prof is None or step != self.last:
            return None
        self._sync()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        events = self.prof.key_averages()
        self.prof = None
        dev_key = "self_device_time_total"
        per_step = lambda us: us / 1e3 / self.n  # noqa: E731  µs over the window -> ms per step
        device_ms = per_step(sum(getattr(e, dev_key, 0.0) for e in events))
        top = lambda key: [(e.key, round(per_step(getattr(e, key, 0.0)), 3))  # noqa: E731
                           for e in sorted(events, key=lambda e: -getattr(e, key, 0.0))[:25]]
        summary = {"steps": self.n, "first_step": self.first + 1, "wall_ms_per_step": 1e3 * wall / self.n,
                   "device_kernel_ms_per_step": device_ms, "device_busy_frac": device_ms / (1e3 * wall / self.n),
                   "top_device_ms_per_step": top(dev_key) if self.device.type == "cuda" else [],
                   "top_host_ms_per_step": top("self_cpu_time_total")}
        if self.rank0:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, "profile.json"), "w") as f:
                json.dump(summary, f, indent=1)
            with open(os.path.join(self.out_dir, "profile.txt"), "w") as f:
                f.write(f"steps {self.first + 1}..{self.last + 1}: wall {summary['wall_ms_per_step']:.1f} ms/step, "
                        f"GPU kernels {device_ms:.1f} ms/step (busy {summary['device_busy_frac']:.0%})\n\n")
                if self.device.type == "cuda":
                    f.write(events.table(sort_by=dev_key, row_limit=40) + "\n\n")
                f.write(events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
            log.info("profile of steps %d..%d: wall %.1f ms/step, GPU kernels %.1f ms/step -> %s", self.first + 1,
                     self.last + 1, summary["wall_ms_per_step"], device_ms, os.path.join(self.out_dir, "profile.txt"))
        return summary


def train_loop(task: Task, feature_batches: Iterator[list[tuple[Sample, Any]]], total_steps: int,
               opts: TrainOptions, device: torch.device,
               evaluate: Callable[[nn.Module], float] | None = None, desc: str = "train",
               dp: DataParallel | None = None) -> History:
    """AdamW steps over ``feature_batches`` (lists of (sample, target features)); per step the samples'
    weighted loss sums are divided by the batch's total weight, so the loss is a weighted mean over every
    trained position of the batch. Logs, evaluates, and returns the history.

    With ``opts.time_budget`` the run is fitted to the budget: at each step of ``REPLAN_AT`` (and at the end of
    a run an estimate cut short) the step time since the previous estimate sets ``total_steps``, lower or
    higher but never above the planned count (the learning-rate schedule follows it, so the cosine still
    reaches its floor), and a run over budget stops at once. Evaluations are not counted.

    With ``dp`` (``baton.train.dp``) each rank runs this loop on its share of every global batch; the replicas
    start from rank 0's parameters, and the step times are max-reduced so the budget decisions agree."""
    torch.manual_seed(opts.seed)
    if dp is not None:
        dp.broadcast_parameters(task.module)
    optimizer = make_optimizer(task.module, opts)
    history = History()
    task.module.train()
    t0 = time.perf_counter()
    if evaluate is not None and opts.eval_every:
        history.evals.append({"step": 0, "accept_length": _evaluate(task, evaluate)})
    bar = tqdm(total=total_steps, desc=desc, unit="step",
               disable=env.disable_progress() or (dp is not None and not dp.is_main))
    budget, spent = opts.time_budget, 0.0  # spent: seconds of steps (evaluations excluded)
    mark = (0, 0.0)  # (steps, seconds) where the current step-time window starts
    planned = total_steps  # the epochs' count: a time budget may cut it, never exceed it
    profiler = StepProfiler(opts.profile_steps, opts.output, device, dp is None or dp.is_main)
    for step, batch in enumerate(feature_batches):
        if step >= total_steps:
            break
        lr = lr_at(step, total_steps, opts)
        for group in optimizer.param_groups:
            group["lr"] = lr
        profiler.before(step)
        ts = time.perf_counter()
        record = _train_step(task, batch, step, optimizer, opts, device, dp)
        step_s = time.perf_counter() - ts
        profile = profiler.after(step)
        if profile is not None:
            history.profile = profile
        spent += step_s if dp is None else dp.max(step_s)
        if step + 1 == REPLAN_SKIP:
            mark = (step + 1, spent)  # the estimate's window starts after the warm-up steps
        due = budget is not None and (step + 1 in REPLAN_AT or step + 1 == total_steps < planned or spent >= budget)
        if due and step + 1 > mark[0]:
            # the window since the last estimate (the warm-up excluded), against the planned count: a later,
            # faster estimate gives back steps an earlier one cut (a run cut short re-estimates at its end)
            fit = replan(planned, step + 1, spent, spent - mark[1], budget, step + 1 - mark[0])
            mark = (step + 1, spent)
            if fit != total_steps:  # every rank of a data-parallel run takes the same decision (same ``spent``)
                if dp is None or dp.is_main:
                    log.info("time budget %.0f s: %d steps in %.1f s, total %s from %d to %d steps", budget,
                             step + 1, spent, "cut" if fit < total_steps else "raised", total_steps, fit)
                total_steps = fit
                bar.total = fit
        record.update(step=step + 1, lr=lr, elapsed_s=time.perf_counter() - t0)
        history.steps.append(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record.get('loss', float('nan')):.4f}")
        if opts.log_every and (step + 1) % opts.log_every == 0 and (dp is None or dp.is_main):
            log.info("step %d: %s", step + 1, {k: round(v, 5) for k, v in record.items()})
        if evaluate is not None and opts.eval_every and (step + 1) % opts.eval_every == 0 and step + 1 < total_steps:
            history.evals.append({"step": step + 1, "accept_length": _evaluate(task, evaluate)})
    bar.close()
    if evaluate is not None:
        history.evals.append({"step": len(history.steps), "accept_length": _evaluate(task, evaluate)})
    return history


def _evaluate(task: Task, evaluate: Callable[[nn.Module], float]) -> float:
    task.module.eval()
    try:
        return float(evaluate(task.module))
    finally:
        task.module.train()


def _train_step(task: Task, batch: list[tuple[Sample, Any]], step: int, optimizer: torch.optim.Optimizer,
                opts: TrainOptions, device: torch.device, dp: DataParallel | None = None) -> dict[str, float]:
    """One optimiser step on ``batch`` (with ``dp``: this rank's share of the global batch). Each sample's plan
    draws from its own generator (``plan_generator``: seed, step and the sample's index in the global batch)."""
    index = (lambda i: i) if dp is None else dp.global_index
    plans = [task.plan(sample, plan_generator(opts.seed, step, index(i))) for i, (sample, _) in enumerate(batch)]
    total = sum(p.weight_sum for p in plans)
    if dp is not None:
        total = dp.sum([total])[0]  # the global normaliser
    optimizer.zero_grad(set_to_none=True)
    if total <= 0:
        return {"loss": float("nan"), "skipped": 1.0}
    loss_sum, stats = 0.0, {}
    batch_loss = getattr(task, "batch_loss", None)  # a task that can run the whole batch in one forward
    if batch_loss is not None:
        kept = [(item, plan) for item, plan in zip(batch, plans, strict=True) if plan.weight_sum > 0]
        if kept:  # (a data-parallel rank's share may hold none)
            with autocast(device):
                loss, stats = batch_loss([item for item, _ in kept], [plan for _, plan in kept])
            (loss / total).backward()
            loss_sum = loss.detach()
    else:
        for (sample, feats), plan in zip(batch, plans, strict=True):
            if plan.weight_sum <= 0:
                continue
            with autocast(device):
                loss, sample_stats = task.loss(sample, feats, plan)
            (loss / total).backward()
            loss_sum = loss_sum + loss.detach()
            merge_stats(stats, sample_stats)
    tokens = float(sum(s.num_tokens for s, _ in batch))
    if dp is not None:
        dp.all_reduce_grads(task.module.parameters())
        loss_sum, tokens = dp.sum([float(loss_sum), tokens])
        stats = functools.reduce(merge_stats, dp.gather_stats(stats), {})
    params = [p for p in task.module.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, opts.grad_clip) if opts.grad_clip > 0 else torch.tensor(0.0)
    optimizer.step()
    record = {"loss": float(loss_sum) / total, **finish_stats(stats)}
    record.update(grad_norm=float(grad_norm), tokens=tokens)
    return record


def merge_stats(into: Stats, new: Stats) -> Stats:
    for k, (s, n) in new.items():
        s0, n0 = into.get(k, (0.0, 0.0))
        into[k] = (s0 + s, n0 + n)
    return into


def finish_stats(stats: Stats) -> dict[str, float]:
    return {k: float(s) / n for k, (s, n) in stats.items() if n > 0}


# ---- outputs ----


def write_history(history: History, out_dir: str, title: str, extra: dict[str, Any] | None = None) -> str:
    """metrics.json and train_curves.png in ``out_dir``; returns the PNG path."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump({**(extra or {}), **history.to_dict()}, f, indent=1)
    png = os.path.join(out_dir, "train_curves.png")
    if can_plot(f"the training curves ({png})"):
        plot_curves({title: history}, png)
    return png


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        finite = [a for a in acc if math.isfinite(a)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def _panels(runs: dict[str, History]) -> list[tuple[str, list[str]]]:
    """(title, metric keys) per panel: the total loss, the loss terms, the accuracies."""
    keys = sorted({k for h in runs.values() for r in h.steps for k in r})
    panels = [("loss", ["loss"]), ("loss terms", [k for k in keys if k.startswith("loss_")]),
              ("teacher-forced accuracy / est. acceptance", [k for k in keys if k.startswith(("acc", "accept_est"))])]
    return [(title, ks) for title, ks in panels if ks]


def plot_curves(runs: dict[str, History], path: str, accept_bars: dict[str, float] | None = None) -> None:
    """Loss, loss terms and accuracies per step (smoothed), accept length per evaluation, and optional final
    accept-length bars; one line per (run, metric)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(runs)
    has_evals = any(h.evals for h in runs.values())
    ncols = max(1, len(panels) + int(has_evals) + int(bool(accept_bars)))
    fig, axes = plt.subplots(1, ncols, figsize=(4.8 * ncols, 3.8), squeeze=False)
    axes = list(axes[0])
    multi = len(runs) > 1
    for ax, (title, keys) in zip(axes, panels, strict=False):
        for name, h in runs.items():
            for key in keys:
                xs = [r["step"] for r in h.steps if key in r]
                ys = [r[key] for r in h.steps if key in r]
                label = f"{name} {key}" if multi else key
                ax.plot(xs, _smooth(ys, max(1, len(ys) // 50)), label=label, lw=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    i = len(panels)
    if has_evals:
        ax = axes[i]
        for name, h in runs.items():
            ax.plot([e["step"] for e in h.evals], [e["accept_length"] for e in h.evals], marker="o", label=name)
        ax.set_title("accept length (Engine, greedy, held-out)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        i += 1
    if accept_bars:
        ax = axes[i]
        names = list(accept_bars)
        ax.bar(range(len(names)), [accept_bars[n] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
        ax.set_title("final accept length")
        for j, n in enumerate(names):
            ax.text(j, accept_bars[n], f"{accept_bars[n]:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["FrozenHead", "History", "Sample", "TrainOptions", "autocast", "batches", "fast_fp32_matmul",
           "finish_stats", "lr_at", "make_optimizer", "masked_attention", "merge_stats", "plot_curves", "read_jsonl",
           "read_samples", "replan", "resolve_device", "steps_for", "train_loop", "write_history", "write_jsonl"]
