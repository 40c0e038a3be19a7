"""One training job end to end: load the frozen target, stream its online features into the training loop,
evaluate the accept length with the Engine, save the draft, write metrics.json and train_curves.png."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from baton.config import ModelConfig, ServerArgs
from baton.engine.engine import pick_device
from baton.engine.load import load_target
from baton.models.base import CausalLM
from baton.models.checkpoint import cast_checkpoint, parse_dtype, quantize_checkpoint_fp8
from baton.train.common import (
    History,
    Sample,
    Task,
    TrainOptions,
    batches,
    fast_fp32_matmul,
    steps_for,
    train_loop,
    write_history,
)
from baton.train.dp import DataParallel
from baton.train.evaluate import AcceptLengthEval, spec_args
from baton.train.online import FeaturePrefetcher, TargetFeatures

log = logging.getLogger(__name__)


@dataclass
class FrozenTarget:
    model: CausalLM
    config: ModelConfig
    tokenizer: Any
    device: torch.device
    args: ServerArgs  # how it was loaded (the eval engine loads the same target)


def dequantised_gguf(args: ServerArgs) -> ServerArgs:
    """``args`` with ``--dtype float32`` where a GGUF would otherwise load on the CPU as its Q4_1 / Q8_0 blocks
    (``--dtype auto``), which training and the Hugging Face export cannot read as tensors."""
    gguf = args.is_embedded or (args.model_path or "").endswith(".gguf")
    if pick_device(args.device).type == "cpu" and args.dtype == "auto" and gguf:
        return dataclasses.replace(args, dtype="float32")
    return args


def load_frozen_target(args: ServerArgs) -> FrozenTarget:
    """The target in eval mode with gradients off, on ``args.device`` in ``args.dtype``. A GGUF on the CPU loads
    dequantised (``dequantised_gguf``)."""
    device = pick_device(args.device)
    args = dequantised_gguf(args)
    loaded = load_target(args, device, parse_dtype(args.dtype, device))
    model = loaded.model.eval().requires_grad_(False)
    return FrozenTarget(model, loaded.config, loaded.tokenizer, device, args)


@dataclass
class EvalSpec:
    """Accept-length evaluation during / after training: an Engine on ``args`` (the target), greedy."""

    args: ServerArgs
    algorithm: str  # NEXTN | DSPARK | DFLASH
    prompts: list[list[int]]
    max_new_tokens: int = 128
    num_steps: int | None = None  # NEXTN chain length (--speculative-num-steps)


def run_training(task: Task, target: FrozenTarget, layer_ids: Sequence[int], samples: Sequence[Sample],
                 opts: TrainOptions, device: torch.device, eval_spec: EvalSpec | None = None,
                 title: str = "draft", extra: dict[str, Any] | None = None,
                 dp: DataParallel | None = None) -> History:
    """Train ``task`` on ``samples`` with features from ``target``; save to ``opts.output``. With ``dp`` this
    rank computes features for and trains on its share of each batch; rank 0 alone evaluates and saves."""
    total = steps_for(len(samples), opts.batch_size, opts.epochs, opts.steps)
    provider = TargetFeatures(target.model, target.device, layer_ids, max_len=opts.max_seq_len)
    main = dp is None or dp.is_main
    tmp, evaluator = None, None
    if eval_spec is not None and eval_spec.prompts and main:
        tmp = tempfile.mkdtemp(prefix="baton-train-eval-")
        task.save(tmp)  # the engine is built from a checkpoint, then takes the trained weights in place
        evaluator = AcceptLengthEval(spec_args(eval_spec.args, eval_spec.algorithm, tmp, eval_spec.num_steps),
                                     eval_spec.prompts, eval_spec.max_new_tokens)
        evaluator.build()  # before the feature worker starts: CUDA graphs are captured with no other thread busy
    if main:
        log.info("training %s: %d samples, %d steps of %d sequences%s", title, len(samples), total, opts.batch_size,
                 "" if dp is None else f" over {dp.world} data-parallel ranks")
    stream = batches(samples, opts.batch_size, total, opts.seed)
    if dp is not None:
        stream = (dp.shard(b) for b in stream)
    try:
        with fast_fp32_matmul(device), FeaturePrefetcher(provider, stream, device, opts.prefetch) as prefetcher:
            evaluate = None if evaluator is None else _paused(prefetcher, evaluator)
            history = train_loop(task, iter(prefetcher), total, opts, device, evaluate, desc=title, dp=dp)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if not main:
        return history
    task.save(opts.output)
    if opts.save_dtype == "fp8":  # matrices in fp8 with block scales (half a bf16 draft), the rest bf16
        quantize_checkpoint_fp8(opts.output)
    else:
        cast_checkpoint(opts.output, getattr(torch, opts.save_dtype))
    info = {"title": title, "train_options": asdict(opts), **(extra or {})}
    png = write_history(history, opts.output, title, info)
    with open(os.path.join(opts.output, "train_args.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)
    log.info("saved %s to %s (curves: %s)", title, opts.output, png)
    return history


def _paused(prefetcher: FeaturePrefetcher, evaluator: AcceptLengthEval) -> Callable[[nn.Module], float]:
    """The evaluation, with the target-feature worker held between batches while the engine decodes."""

    def evaluate(module: nn.Module) -> float:
        with prefetcher.paused():
            return evaluator(module)

    return evaluate


__all__ = ["EvalSpec", "FrozenTarget", "load_frozen_target", "run_training"]
