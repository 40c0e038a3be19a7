"""``baton train``: speculative drafts trained on data the target makes itself, with its features online.

Steps (each one command; together they retrain every draft from scratch):

  data       generate prompt/response token ids with the target (GSM8K train prompts + an optional prompt
             file; greedy and sampled responses), split off held-out prompts.
  nextn      train a NEXTN (MTP-structured) head for a target without an MTP layer.
  dspark     train a DSpark draft (backbone + Markov head + confidence head; --algorithm dflash: backbone only).
  calibrate  fit the STS temperatures of a DSpark confidence head on held-out data.
  ablate     train a small grid of one option (e.g. --vary markov_rank=0,32,128) and report each accept length.

Target features are computed online: a worker thread runs the frozen target (PREFILL, no grad) on
--target-device a few batches ahead while the draft trains on --device (one GPU: both the same, time-shared;
two GPUs: --target-device cuda:0 --device cuda:1, the SplitServe layout). Every training command writes the
checkpoint, metrics.json and train_curves.png (loss, accuracy and accept-length curves) into --output.
Accept lengths come from the Engine itself (greedy, the held-out prompts, the trained draft).

Example (embedded SmolLM2-135M-Instruct):

  baton train data --data-path ../shared/data/gsm8k --output runs/data/smollm2.jsonl
  baton train nextn --train-data runs/data/smollm2.jsonl --holdout-data runs/data/smollm2.holdout.jsonl \\
      --output runs/nextn
  baton train dspark --train-data runs/data/smollm2.jsonl --holdout-data runs/data/smollm2.holdout.jsonl \\
      --output runs/dspark
  baton train calibrate --draft runs/dspark --holdout-data runs/data/smollm2.holdout.jsonl \\
      --output runs/dspark/sts.json
  baton train ablate --algorithm dspark --vary markov_rank=0,32,128 --train-data ... --holdout-data ... \\
      --output runs/ablate-rank
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ---- argument groups ----


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target (frozen)")
    g.add_argument("--model-path", default=None,
                   help="target: Hugging Face directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer-path", default=None)
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--dtype", default="auto", help="target dtype: auto (bf16 on CUDA, fp32 on CPU), ...")
    g.add_argument("--json-model-override-args", default=None)
    g.add_argument("--target-device", default=None,
                   help="device of the target forwards (default: cuda when available); cuda:0 with --device "
                        "cuda:1 is the two-GPU SplitServe layout")
    g.add_argument("--context-length", type=int, default=None, help="the evaluation engine's context length")
    g.add_argument("--disable-cuda-graph", action="store_true", help="evaluation engine: eager CUDA path")


def _add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--train-data", required=True, help="training records (JSONL from `baton train data`)")
    g.add_argument("--output", required=True, help="directory: the draft checkpoint, metrics.json, train_curves.png")
    g.add_argument("--device", default=None, help="trainer device (default: cuda when available)")
    g.add_argument("--steps", type=int, default=None, help="optimiser steps (default: --epochs over the data)")
    g.add_argument("--epochs", type=float, default=2.0)
    g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="cut the run to the optimiser steps that fit in SECONDS (measured step time; the learning-rate "
                        "schedule follows the cut; evaluations not counted)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per optimiser step")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine floor as a fraction of --lr")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--warmup-frac", type=float, default=0.04)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="data order, anchors and initialisation")
    g.add_argument("--max-seq-len", type=int, default=2048, help="sequences are cut to this many tokens")
    g.add_argument("--log-every", type=int, default=20, help="steps between log lines (all steps: metrics.json)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--prefetch", type=int, default=2, help="batches of target features computed ahead")
    g.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="profile N optimiser steps after the first 10 (torch.profiler, the GPU's kernels on CUDA): "
                        "OUTPUT/profile.txt and profile.json give wall and GPU kernel time per step, and the "
                        "operators that take them (the profiled steps run slower)")
    g.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "fp8"],
                   help="dtype of the saved draft's weights (training itself runs in fp32; bf16 halves the file; fp8: "
                        "the matrices in e4m3 with 128 x 128 block scales, the rest bf16, half a bf16 file again; "
                        "the loaders dequantise it)")
    g.add_argument("--dp-size", type=int, default=1, metavar="N",
                   help="data parallel: N processes on cuda:0..N-1 (each its own target and draft replica; "
                        "--device / --target-device then only choose cuda or cpu) split every batch of "
                        "--batch-size sequences and sum the gradients; same steps as one process, N times the "
                        "throughput (without CUDA: N CPU processes over gloo)")
    e = p.add_argument_group("evaluation (accept length through the Engine, greedy)")
    e.add_argument("--holdout-data", default=None, help="held-out records; their prompts are the eval prompts")
    e.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts decoded per evaluation")
    e.add_argument("--eval-max-new-tokens", type=int, default=128)
    e.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: only at the end)")


def _add_nextn_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("NEXTN head")
    g.add_argument("--unroll-steps", type=int, default=3,
                   help="chain steps trained per row, the head's own hidden fed back as when drafting "
                        "(1 = teacher forcing)")
    g.add_argument("--step-decay", type=float, default=0.8, help="loss weight of chain step s: decay^(s-1)")
    _add_init_arg(p, g)
    g.add_argument("--eval-num-steps", type=int, default=3, help="--speculative-num-steps when evaluating")


def _add_init_arg(p: argparse.ArgumentParser, g) -> None:
    """``--init``, shared by the NEXTN and DSpark groups (``ablate`` has both): None = the algorithm's default."""
    if any(a.dest == "init" for a in p._actions):
        return
    g.add_argument("--init", default=None, choices=["target", "random"],
                   help="target: NEXTN's body / DSpark's layers start as copies of the target's last decoder "
                        "layer(s); random: N(0, 1/fan_in) (default: target for NEXTN, random for DSpark)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this draft checkpoint's weights (e.g. the shipped draft, to train it further) "
                        "instead of --init; for DSpark the checkpoint also fixes the architecture (block size, "
                        "layers, Markov rank, tapped layers, q/k norm, mask token). The learning-rate schedule "
                        "and the optimiser state start afresh")


def _add_dspark_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DSpark / DFlash draft")
    _add_init_arg(p, g)
    g.add_argument("--algorithm", default="dspark", choices=["dspark", "dflash"],
                   help="dflash: backbone only (no Markov / confidence head), CE loss")
    g.add_argument("--grow-layers", type=int, default=None, metavar="N",
                   help="with --init-from: N draft layers, the checkpoint's first and new ones appended with their "
                        "output projections (o_proj, down_proj) at zero, so training starts from the checkpoint's "
                        "exact function (a deeper draft without starting over)")
    g.add_argument("--block-size", type=int, default=7, help="gamma: query slots = drafts per round")
    g.add_argument("--num-layers", type=int, default=2, help="draft depth")
    g.add_argument("--markov-rank", type=int, default=256, help="Markov head rank (0 = DFlash)")
    g.add_argument("--num-anchors", type=int, default=512, help="random anchors (blocks) per sequence")
    g.add_argument("--batched-loss", action="store_true",
                   help="one vocabulary pass (lm_head, Markov bias, softmaxes, loss) over the whole batch's blocks "
                        "instead of one per sequence: fewer, larger kernels; memory for [blocks x slots of the "
                        "batch, vocabulary] fp32 tensors")
    g.add_argument("--loss-decay-gamma", type=float, default=4.0, help="slot weight exp(-k0 / this)")
    g.add_argument("--ce-weight", type=float, default=None, help="default 0.1 (DSpark), 1.0 (DFlash)")
    g.add_argument("--tv-weight", type=float, default=None, help="default 0.9 (DSpark), 0 (DFlash)")
    g.add_argument("--conf-weight", type=float, default=None, help="default 1.0 (DSpark)")
    g.add_argument("--mask-token-id", type=int, default=None, help="default: the last vocabulary id")
    g.add_argument("--target-layer-ids", type=_ints, default=None,
                   help="tapped target layers, e.g. 1,27 (default: spread over the target, one per draft layer)")
    g.add_argument("--no-qk-norm", action="store_true", help="no per-head q/k RMSNorm in the draft")


# ---- shared plumbing ----


def _target_args(ns: argparse.Namespace):
    from baton.config import ServerArgs

    return ServerArgs(model_path=ns.model_path, tokenizer_path=ns.tokenizer_path, load_format=ns.load_format,
                      dtype=ns.dtype, device=ns.target_device, json_model_override_args=ns.json_model_override_args,
                      context_length=ns.context_length, disable_cuda_graph=ns.disable_cuda_graph, seed=ns.seed)


def _train_options(ns: argparse.Namespace):
    from baton.train.common import TrainOptions

    return TrainOptions(output=ns.output, steps=ns.steps, epochs=ns.epochs, batch_size=ns.batch_size, lr=ns.lr,
                        min_lr_ratio=ns.min_lr_ratio, weight_decay=ns.weight_decay, warmup_frac=ns.warmup_frac,
                        grad_clip=ns.grad_clip, seed=ns.seed, log_every=ns.log_every, eval_every=ns.eval_every,
                        max_seq_len=ns.max_seq_len, prefetch=ns.prefetch, save_dtype=ns.save_dtype,
                        time_budget=ns.time_budget, profile_steps=ns.profile_steps)


def _eval_spec(ns: argparse.Namespace, target, algorithm: str, num_steps: int | None = None):
    from baton.train.evaluate import holdout_prompts
    from baton.train.runner import EvalSpec

    if not ns.holdout_data or ns.eval_prompts <= 0:
        return None
    prompts = holdout_prompts(ns.holdout_data, ns.eval_prompts)
    return EvalSpec(target.args, algorithm, prompts, ns.eval_max_new_tokens, num_steps)


def _summary(history, output: str) -> dict[str, Any]:
    last = history.steps[-1] if history.steps else {}
    out = {"output": output, "steps": len(history.steps), "final_loss": last.get("loss")}
    if history.evals:
        out["accept_length"] = history.evals[-1]["accept_length"]
        out["accept_length_curve"] = [(e["step"], round(e["accept_length"], 4)) for e in history.evals]
    return out


# ---- commands ----


def run_nextn(ns: argparse.Namespace, target=None, dp=None):
    """Train a NEXTN head as ``ns`` says (``target``: an already loaded FrozenTarget; ``dp``: this process's
    place in a data-parallel run); returns the History."""
    from baton.train.common import FrozenHead, read_samples, resolve_device
    from baton.train.nextn import NextNOptions, NextNTask, build_trainable_head
    from baton.train.runner import load_frozen_target, run_training

    target = target or load_frozen_target(_target_args(ns))
    device = resolve_device(ns.device)
    nopts = NextNOptions(unroll_steps=ns.unroll_steps, step_decay=ns.step_decay, init=ns.init or "target",
                         init_seed=ns.seed)
    head, body_cfg = build_trainable_head(target.model, target.config, nopts, device)
    if getattr(ns, "init_from", None):
        _load_init_from(head, ns.init_from, "nextn", target.model)
    task = NextNTask(head, body_cfg, FrozenHead(target.model, device), nopts, device)
    samples = read_samples(ns.train_data, ns.max_seq_len)
    spec = _eval_spec(ns, target, "NEXTN", ns.eval_num_steps)
    return run_training(task, target, (), samples, _train_options(ns), device, spec, title="nextn",
                        extra={"nextn_options": vars(nopts), "train_data": ns.train_data,
                               "dp_size": 1 if dp is None else dp.world}, dp=dp)


def _dspark_options(ns: argparse.Namespace):
    from baton.train.dspark import DFLASH_ALPHAS, DSPARK_ALPHAS, DSparkOptions

    rank = 0 if ns.algorithm == "dflash" else ns.markov_rank
    alphas = None
    if any(w is not None for w in (ns.ce_weight, ns.tv_weight, ns.conf_weight)):
        base = DSPARK_ALPHAS if rank > 0 else DFLASH_ALPHAS
        alphas = tuple(b if w is None else w for b, w in zip(base, (ns.ce_weight, ns.tv_weight, ns.conf_weight),
                                                              strict=True))
    return DSparkOptions(block_size=ns.block_size, num_layers=ns.num_layers, markov_rank=rank,
                         num_anchors=ns.num_anchors, loss_decay_gamma=ns.loss_decay_gamma, alphas=alphas,
                         mask_token_id=ns.mask_token_id, target_layer_ids=ns.target_layer_ids,
                         qk_norm=not ns.no_qk_norm, init=ns.init or "random", init_seed=ns.seed,
                         batched_loss=getattr(ns, "batched_loss", False))


def _dspark_options_from(dopts, path: str):
    """``dopts`` with the architecture of the DSpark / DFlash checkpoint at ``path`` (``--init-from``)."""
    import dataclasses

    from baton.config import ConfigError
    from baton.models.dspark_checkpoint import read_dspark_config

    ck = read_dspark_config(path)
    if (ck.markov_rank > 0) != dopts.with_heads:
        raise ConfigError(f"--init-from {path}: a {'DSpark' if ck.markov_rank else 'DFlash'} checkpoint, but the "
                          f"run trains {'DSpark' if dopts.with_heads else 'DFlash'} (--algorithm)")
    changed = {k: v for k, v in dict(block_size=ck.block_size, num_layers=ck.num_hidden_layers,
                                      markov_rank=ck.markov_rank, target_layer_ids=ck.target_layer_ids,
                                      qk_norm=ck.qk_norm, mask_token_id=ck.mask_token_id).items()
               if getattr(dopts, k) != v}
    if changed:
        log.info("--init-from %s: the checkpoint's architecture replaces the command line's: %s", path, changed)
    return dataclasses.replace(dopts, **changed)


def _load_init_from(model, path: str, kind: str, target=None) -> None:
    """Fill the fp32 trainable ``model`` from the checkpoint at ``path`` (its dtype converted); a tensor the
    checkpoint lacks or shapes differently fails, naming it."""
    if kind == "nextn":
        from baton.models.nextn_checkpoint import load_safetensors_with_prefix, nextn_checkpoint_config

        nextn_checkpoint_config(path, target)  # the checks the serving loader makes
        load_safetensors_with_prefix(model, path)
    else:
        from baton.models.dspark_checkpoint import load_dspark_weights

        load_dspark_weights(model, path, ignore_heads=False)
    log.info("--init-from %s: %s weights loaded", path, kind)


def run_dspark(ns: argparse.Namespace, target=None, dp=None):
    """Train a DSpark / DFlash draft as ``ns`` says (``dp`` as in ``run_nextn``); returns the History."""
    import dataclasses

    from baton.config import ConfigError
    from baton.train.common import FrozenHead, read_samples, resolve_device
    from baton.train.dspark import DSparkTask, build_trainable_draft, grow_draft
    from baton.train.runner import load_frozen_target, run_training

    target = target or load_frozen_target(_target_args(ns))
    device = resolve_device(ns.device)
    dopts = _dspark_options(ns)
    if getattr(ns, "init_from", None):
        dopts = _dspark_options_from(dopts, ns.init_from)
    grow = getattr(ns, "grow_layers", None)
    if grow is not None:
        if not getattr(ns, "init_from", None):
            raise ConfigError("--grow-layers needs --init-from (the draft whose layers it starts from)")
        if grow <= dopts.num_layers:
            raise ConfigError(f"--grow-layers {grow}: the checkpoint {ns.init_from} has {dopts.num_layers} layer(s); "
                              "ask for more")
        model, cfg = grow_draft(target.config, dopts, grow, ns.init_from, device, target.model)
        dopts = dataclasses.replace(dopts, num_layers=grow)
    else:
        model, cfg = build_trainable_draft(target.config, dopts, device, target.model)
        if getattr(ns, "init_from", None):
            _load_init_from(model, ns.init_from, "dspark")
    task = DSparkTask(model, cfg, FrozenHead(target.model, device), dopts, device)
    samples = read_samples(ns.train_data, ns.max_seq_len)
    algorithm = "DSPARK" if dopts.with_heads else "DFLASH"
    spec = _eval_spec(ns, target, algorithm)
    return run_training(task, target, cfg.target_layer_ids, samples, _train_options(ns), device, spec,
                        title=algorithm.lower(), extra={"dspark_options": vars(dopts), "train_data": ns.train_data,
                                                        "alphas": list(dopts.loss_alphas()),
                                                        "dp_size": 1 if dp is None else dp.world}, dp=dp)


def data_server_args(ns: argparse.Namespace):
    """The target's ServerArgs for data generation: plain decoding, also for the embedded model, whose shipped
    drafts are otherwise on by default (with them on, the recipe's data step fails). None when the command line
    asks for speculation."""
    from baton.args import server_args_from
    from baton.speculative.shipped import DISABLE

    requested = ns.speculative_algorithm
    if (requested is not None and requested.lower() not in DISABLE) or ns.speculative_draft_model_path:
        return None
    return server_args_from(argparse.Namespace(**{**vars(ns), "speculative_algorithm": "none"}))


def cmd_data(ns: argparse.Namespace) -> int:
    from baton.engine.engine import Engine
    from baton.train.data import DataOptions, build_dataset, build_dataset_parallel

    args = data_server_args(ns)
    if args is None:
        print("baton train data: generation uses plain decoding; drop the --speculative-* flags", file=sys.stderr)
        return 2
    if ns.backend == "hf":  # the Hugging Face model is built from the target's tensors
        from baton.train.runner import dequantised_gguf

        args = dequantised_gguf(args)
    opts = DataOptions(output=ns.output, data_path=ns.data_path, extra_prompts=ns.extra_prompts,
                       num_prompts=ns.num_prompts, skip_prompts=ns.skip_prompts,
                       num_extra_prompts=ns.num_extra_prompts,
                       temperatures=ns.temperatures, top_p=ns.top_p,
                       samples_per_temperature=ns.samples_per_temperature, max_new_tokens=ns.max_new_tokens,
                       prompt_formats=tuple(ns.prompt_formats.split(",")), num_shots=ns.num_shots,
                       holdout_frac=ns.holdout_frac, holdout_output=ns.holdout_output, seed=ns.data_seed,
                       holdout_seed=ns.holdout_seed, time_budget=ns.time_budget)
    if ns.backend == "hf" and ns.num_workers > 1:
        print("baton train data: --num-workers is for --backend engine (hf batches on one device)", file=sys.stderr)
        return 2
    if ns.num_workers > 1:
        summary = build_dataset_parallel(args, opts, ns.num_workers)
    else:
        summary = build_dataset(Engine(args), opts, backend=ns.backend, gen_batch_size=ns.gen_batch_size)
    print(json.dumps(summary, indent=1))
    return 0


def _dp_rank(kind: str, ns: argparse.Namespace, dp) -> None:
    """One rank of ``baton train nextn|dspark --dp-size N`` (``baton.train.dp.launch`` runs it): its GPU holds
    its target and its draft replica; rank 0 prints the summary."""
    rank_ns = copy.copy(ns)
    rank_ns.device = rank_ns.target_device = str(dp.device)
    history = (run_nextn if kind == "nextn" else run_dspark)(rank_ns, dp=dp)
    if dp.is_main:
        print(json.dumps(_summary(history, ns.output), indent=1), flush=True)


def _run(kind: str, ns: argparse.Namespace) -> int:
    if ns.dp_size == 1:
        history = (run_nextn if kind == "nextn" else run_dspark)(ns)
        print(json.dumps(_summary(history, ns.output), indent=1))
        return 0
    import functools

    from baton.train.dp import launch, resolve_dp_devices

    try:
        devices = resolve_dp_devices(ns.dp_size, ns.device or ns.target_device)
    except ValueError as e:
        print(f"baton train {kind}: {e}", file=sys.stderr)
        return 2
    try:
        launch(ns.dp_size, devices, functools.partial(_dp_rank, kind, ns), ns.log_level)
    except Exception as e:  # a rank's failure (torch.multiprocessing carries its traceback in the message)
        print(f"baton train {kind} --dp-size {ns.dp_size}: a rank failed:\n{e}", file=sys.stderr)
        return 1
    return 0


def cmd_nextn(ns: argparse.Namespace) -> int:
    return _run("nextn", ns)


def cmd_dspark(ns: argparse.Namespace) -> int:
    return _run("dspark", ns)


def cmd_calibrate(ns: argparse.Namespace) -> int:
    import torch

    from baton.models.build import materialize
    from baton.models.dspark import DSparkDraftModel
    from baton.models.dspark_checkpoint import build_target_layer_ids, load_dspark_weights, read_dspark_config
    from baton.plotting import can_plot
    from baton.train.calibrate import collect_confidence, fit_sts, greedy_first, plot_reliability, write_sts
    from baton.train.common import FrozenHead, read_samples, resolve_device
    from baton.train.online import TargetFeatures
    from baton.train.runner import load_frozen_target

    target = load_frozen_target(_target_args(ns))
    device = resolve_device(ns.device)
    cfg = read_dspark_config(ns.draft)
    if cfg.target_layer_ids is None:
        cfg.target_layer_ids = build_target_layer_ids(target.config.num_hidden_layers, cfg.num_hidden_layers)
    model = materialize(DSparkDraftModel(cfg, with_heads=True, device="meta", dtype=torch.float32), device)
    load_dspark_weights(model, ns.draft, ignore_heads=False)
    samples = read_samples(ns.holdout_data, ns.max_seq_len)
    samples = greedy_first(samples) if ns.mode == "greedy" else samples
    samples = samples[: ns.max_seqs] if ns.max_seqs else samples
    provider = TargetFeatures(target.model, target.device, cfg.target_layer_ids, max_len=ns.max_seq_len)
    data = collect_confidence(model, FrozenHead(target.model, device), provider, samples, device, ns.num_anchors,
                              ns.mode, ns.seed)
    result = fit_sts(data.z, data.y, data.valid, ns.num_bins)
    output = ns.output or os.path.join(ns.draft, "sts.json")
    write_sts(result, output, mode=ns.mode, num_sequences=len(samples), num_blocks=int(data.z.shape[0]))
    png = os.path.splitext(output)[0] + "_reliability.png"
    if can_plot(f"the reliability diagram ({png})"):
        plot_reliability(data, result, png)
    print(json.dumps({"output": output, **result.to_json()}, indent=1))
    return 0


def _parse_vary(text: str) -> tuple[str, list[str]]:
    if "=" not in text:
        raise argparse.ArgumentTypeError("--vary takes NAME=v1,v2,... (e.g. markov_rank=0,32,128)")
    name, values = text.split("=", 1)
    return name.strip().replace("-", "_"), [v.strip() for v in values.split(",") if v.strip()]


def cmd_token_map(ns: argparse.Namespace) -> int:
    from baton.speculative.token_map import build_token_map, save_token_map
    from baton.train.common import read_jsonl

    rows = [r for path in ns.train_data for r in read_jsonl(path)]
    if not rows:
        print(f"baton train token-map: no records in {', '.join(ns.train_data)}", file=sys.stderr)
        return 2
    vocab = ns.vocab_size or 1 + max(max([*r["prompt_ids"], *r["response_ids"]], default=0) for r in rows)
    ids, coverage = build_token_map((r["response_ids"] for r in rows), ns.size, vocab)
    save_token_map(ids, ns.output)
    n = sum(len(r["response_ids"]) for r in rows)
    print(f"{ns.output}: {len(ids)} token ids (vocabulary {vocab}) covering {100 * coverage:.2f}% of the {n} response "
          f"tokens of {len(rows)} records; serve it with --speculative-token-map {ns.output}")
    return 0


def cmd_ablate(ns: argparse.Namespace) -> int:
    from baton.train.common import plot_curves
    from baton.train.runner import load_frozen_target

    name, values = ns.vary
    if ns.dp_size != 1:
        print("baton train ablate: --dp-size is for `baton train nextn|dspark` (ablate trains one run at a time)",
              file=sys.stderr)
        return 2
    if not hasattr(ns, name):
        print(f"baton train ablate: --vary {name}: not an option of this command", file=sys.stderr)
        return 2
    if not ns.holdout_data:
        print("baton train ablate: --holdout-data is needed (the accept length is measured on it)", file=sys.stderr)
        return 2
    target = load_frozen_target(_target_args(ns))
    current = getattr(ns, name)
    runs, bars, rows = {}, {}, []
    for value in values:
        vns = copy.copy(ns)
        setattr(vns, name, _convert(value, current))
        vns.output = os.path.join(ns.output, f"{name}={value}")
        history = (run_nextn if ns.algorithm == "nextn" else run_dspark)(vns, target)
        label = f"{name}={value}"
        runs[label] = history
        summary = _summary(history, vns.output)
        bars[label] = summary.get("accept_length", float("nan"))
        rows.append({"variant": label, **summary})
        print(f"{label}: accept length {bars[label]:.3f}, final loss {summary['final_loss']:.4f}", file=sys.stderr)
    plot_curves(runs, os.path.join(ns.output, "ablation.png"), accept_bars=bars)
    with open(os.path.join(ns.output, "ablation.json"), "w") as f:
        json.dump({"algorithm": ns.algorithm, "vary": name, "results": rows}, f, indent=1)
    print(json.dumps(rows, indent=1))
    return 0


def _convert(value: str, current: Any) -> Any:
    if isinstance(current, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    if isinstance(current, list):
        return _ints(value.replace("+", ","))
    return value


# ---- parsers ----


def _add_data(tsub: Any) -> None:
    from baton.args import add_engine_args
    from baton.train import data

    p = tsub.add_parser("data", help="generate training data with the target (prompt/response token ids)",
                        description=data.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None, help="GSM8K train.jsonl, or the directory holding it")
    g.add_argument("--extra-prompts", default=None,
                   help="more prompts: .txt (one per line) or .jsonl, or 'general' (the train split of the project's "
                        "general prompt set: writing, explanation, code, summarisation, lists, translation, "
                        "multi-turn chat)")
    g.add_argument("--num-prompts", type=int, default=None, help="first N GSM8K prompts (default: all)")
    g.add_argument("--skip-prompts", type=int, default=0, metavar="K",
                   help="skip the first K GSM8K prompts (then --num-prompts): more data for prompts an earlier run "
                        "did not reach (its prompt ids keep their GSM8K index)")
    g.add_argument("--num-extra-prompts", type=int, default=None)
    g.add_argument("--prompt-formats", default="auto", help="comma list of auto, chat, plain, fewshot")
    g.add_argument("--num-shots", type=int, default=5, help="fewshot format: train examples in the prefix")
    g.add_argument("--temperatures", type=_floats, default=(0.0, 0.7, 1.0), help="e.g. 0,0.7,1.0 (0 = greedy)")
    g.add_argument("--top-p", type=float, default=0.95, help="top-p of the sampled settings")
    g.add_argument("--samples-per-temperature", type=int, default=1, help="responses per positive temperature")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--holdout-frac", type=float, default=0.02, help="fraction of prompts held out")
    g.add_argument("--data-seed", type=int, default=0, help="sampling seed (and the split's, unless --holdout-seed)")
    g.add_argument("--holdout-seed", type=int, default=None,
                   help="the train / held-out split's seed (default: --data-seed); keep it fixed across runs that "
                        "differ only in --data-seed, so a later run's held-out prompts were never trained on")
    g.add_argument("--num-workers", type=int, default=1,
                   help="processes generating in parallel, each with its own engine on --device (a small target "
                        "leaves the GPU mostly idle at batch 1); the output is the same as with one")
    g.add_argument("--backend", default="engine", choices=list(data.BACKENDS),
                   help="engine: baton's Engine, one request at a time; hf: batched generation through transformers "
                        "with the target's weights (llama targets; much faster on a GPU)")
    g.add_argument("--gen-batch-size", type=int, default=256, help="--backend hf: responses per batch")
    g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop starting new requests (engine) or batches (hf) once they would not end within SECONDS; "
                        "the responses made so far are written (hf interleaves formats and settings, so a cut run "
                        "stays balanced)")
    g.add_argument("--output", required=True, help="train records (JSONL)")
    g.add_argument("--holdout-output", default=None, help="held-out records (default: <output>.holdout.jsonl)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    p.set_defaults(func=cmd_data)


def _add_nextn(tsub: Any) -> None:
    from baton.train import nextn

    p = tsub.add_parser("nextn", help="train a NEXTN head (targets without an MTP layer)",
                        description=nextn.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(p)
    _add_train_args(p)
    _add_nextn_args(p)
    p.set_defaults(func=cmd_nextn)


def _add_dspark(tsub: Any) -> None:
    from baton.train import dspark

    p = tsub.add_parser("dspark", help="train a DSpark (or DFlash) block draft",
                        description=dspark.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(p)
    _add_train_args(p)
    _add_dspark_args(p)
    p.set_defaults(func=cmd_dspark)


def _add_calibrate(tsub: Any) -> None:
    from baton.train import calibrate

    p = tsub.add_parser("calibrate", help="STS temperatures for a DSpark confidence head",
                        description=calibrate.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(p)
    g = p.add_argument_group("calibration")
    g.add_argument("--draft", required=True, help="the DSpark draft checkpoint directory")
    g.add_argument("--holdout-data", required=True, help="held-out records (JSONL)")
    g.add_argument("--output", default=None, help="STS JSON (default: <draft>/sts.json)")
    g.add_argument("--device", default=None, help="device of the draft (default: cuda when available)")
    g.add_argument("--mode", default="greedy", choices=["greedy", "soft"])
    g.add_argument("--num-anchors", type=int, default=64, help="random blocks per held-out sequence")
    g.add_argument("--num-bins", type=int, default=15, help="ECE bins")
    g.add_argument("--max-seqs", type=int, default=None)
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_calibrate)


def _add_token_map(tsub: Any) -> None:
    from baton.speculative import token_map

    p = tsub.add_parser("token-map", help="the drafts' hot vocabulary (--speculative-token-map) from target-made data",
                        description=token_map.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-data", nargs="+", required=True, help="records of `baton train data` (JSONL)")
    p.add_argument("--size", type=int, default=8192, help="token ids in the map")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the target's vocabulary (default: one past the largest id in the records)")
    p.add_argument("--output", required=True, help="the map: .pt (SGLang's format) or .json")
    p.set_defaults(func=cmd_token_map)


def _add_ablate(tsub: Any) -> None:
    p = tsub.add_parser("ablate", help="train a small grid of one option and compare accept lengths",
                        description="Train one draft per value of --vary NAME=v1,v2,... (any option of the "
                        "nextn / dspark commands, dashes or underscores) with everything else equal, measure each "
                        "one's accept length on the held-out prompts with the Engine (greedy), and write "
                        "ablation.json and ablation.png (loss curves and accept-length bars) into --output.\n\n"
                        "Examples:\n  baton train ablate --algorithm dspark --vary markov_rank=0,32,128 ...\n"
                        "  baton train ablate --algorithm dspark --vary num_layers=1,2 ...\n"
                        "  baton train ablate --algorithm nextn --vary unroll_steps=1,3 ...",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vary", type=_parse_vary, required=True, help="NAME=v1,v2,...")
    _add_target_args(p)
    _add_train_args(p)
    _add_nextn_args(p)
    _add_dspark_args(p)
    p.set_defaults(func=cmd_ablate)
    for action in p._actions:  # --algorithm picks the draft kind here: nextn, dspark or dflash
        if action.dest == "algorithm":
            action.choices = ["nextn", "dspark", "dflash"]


def add_train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train speculative drafts (NEXTN, DSpark, DFlash) on target-made data",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tsub = p.add_subparsers(dest="train_command", required=True, metavar="STEP")
    _add_data(tsub)
    _add_nextn(tsub)
    _add_dspark(tsub)
    _add_calibrate(tsub)
    _add_token_map(tsub)
    _add_ablate(tsub)


__all__ = ["add_train_parser", "run_dspark", "run_nextn"]
