"""The ``baton`` command: serve | generate | bench | gate | sweep | eval | census | train | convert.

Flags that configure the engine use SGLang's names (``--model-path``, ``--speculative-num-steps``, ...), so
an SGLang launch line works after replacing ``python -m sglang.launch_server`` with ``baton serve``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from baton.args import add_engine_args, add_server_args, server_args_from
from baton.config import ConfigError, ServerArgs


def cmd_generate(ns: argparse.Namespace) -> int:
    args = server_args_from(ns)
    if args.tp_size > 1:  # rank 0 (this process) runs _generate_with; the other ranks follow it
        from baton.engine.tp import run_tp

        return run_tp(args, _generate_with, (ns,))
    from baton.engine.engine import Engine

    return _generate_with(Engine(args), ns)


def _generate_with(engine, ns: argparse.Namespace) -> int:
    from baton.types import Request, SamplingParams

    tok = engine.tokenizer
    use_chat = ns.chat if ns.chat is not None else tok.has_chat_template
    prompt = ns.prompt if ns.prompt is not None else ns.prompt_pos
    if prompt is None:
        prompt = "What is the capital of France?"
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if use_chat else prompt
    ids = tok.encode(text, add_special_tokens=not use_chat)
    sp = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                        max_new_tokens=ns.max_new_tokens, seed=ns.sampling_seed, ignore_eos=ns.ignore_eos,
                        stop=ns.stop or [])
    t0 = time.perf_counter()
    ttft = None
    num_tokens, num_verify, simulated, reason = 0, 0, False, None
    for out in engine.generate(Request(ids, sp)):
        if ttft is None:
            ttft = time.perf_counter() - t0
        num_tokens += len(out.token_ids)
        num_verify, simulated, reason = out.num_verify_steps, out.simulated, out.finish_reason
        sys.stdout.write(out.text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    decode_time = elapsed - (ttft or 0)
    rate = (num_tokens - 1) / decode_time if num_tokens > 1 and decode_time > 0 else 0.0
    summary = (f"\n[{num_tokens} tokens in {elapsed:.2f} s, {rate:.1f} tok/s decode, TTFT {1000 * (ttft or 0):.0f} ms"
               f", finish {reason['type'] if reason else '?'}")
    if num_verify:
        summary += f", accept length {num_tokens / num_verify:.2f}" + (" (simulated)" if simulated else "")
    print(summary + "]", file=sys.stderr)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    args = server_args_from(ns)
    if args.tp_size > 1:  # rank 0 (this process) serves HTTP; the other ranks follow its requests
        from baton.engine.tp import run_tp

        run_tp(args, _serve_with, (args,))
        return 0
    from baton.engine.engine import Engine
    from baton.server.app import run_server

    run_server(args, Engine)
    return 0


def _serve_with(engine, args: ServerArgs) -> None:
    from baton.server.app import run_server

    run_server(args, lambda _: engine)


def cmd_random_checkpoint(ns: argparse.Namespace) -> int:
    import json

    import torch

    from baton.config import parse_model_config
    from baton.models.build import build_model
    from baton.models.checkpoint import init_dummy_weights, parse_dtype, save_hf_checkpoint

    with open(ns.config) as f:
        data = json.load(f)
    cfg = parse_model_config(data, ns.json_model_override_args)
    dtype = parse_dtype(ns.dtype, torch.device("cpu"))
    model = build_model(cfg, "cpu", dtype)
    init_dummy_weights(model, ns.seed)
    save_hf_checkpoint(model, data | (json.loads(ns.json_model_override_args) if ns.json_model_override_args else {}),
                       ns.output, max_shard_bytes=int(ns.max_shard_mb * 2**20))
    print(f"wrote a random {cfg.model_type} checkpoint to {ns.output}")
    return 0


def cmd_random_draft(ns: argparse.Namespace) -> int:
    from baton.config import load_model_config

    target_cfg = load_model_config(ns.target, ns.json_model_override_args)
    if ns.algorithm.upper() in ("NEXTN", "EAGLE"):
        from baton.models.nextn_checkpoint import write_random_nextn_head

        write_random_nextn_head(target_cfg, ns.output, ns.seed)
    else:
        from baton.models.dspark_checkpoint import write_random_dspark_draft

        write_random_dspark_draft(target_cfg, ns.output, ns.seed, block_size=ns.block_size,
                                  num_layers=ns.num_layers, markov_rank=ns.markov_rank,
                                  with_heads=ns.algorithm.upper() == "DSPARK")
    print(f"wrote a random {ns.algorithm.upper()} draft for {ns.target} to {ns.output}")
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt, streamed to the terminal",
                       description="Generate from one prompt and print a summary line (tokens, tok/s, TTFT).")
    add_engine_args(p)
    p.add_argument("prompt_pos", nargs="?", default=None, metavar="PROMPT", help="the prompt")
    p.add_argument("--prompt", default=None, help="the prompt (default: 'What is the capital of France?')")
    p.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template (default for models that have one)")
    p.add_argument("--no-chat", dest="chat", action="store_false")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (SGLang flags)",
                       description="Serve /generate, /v1/completions, /v1/chat/completions and friends.")
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=cmd_serve)


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="write random checkpoints (models and drafts) in the real layouts")
    csub = p.add_subparsers(dest="convert_command", required=True)
    r = csub.add_parser("random-checkpoint", help="random weights for a config.json, in the HF safetensors layout")
    r.add_argument("--config", required=True, help="a config.json (bailing_hybrid or llama)")
    r.add_argument("--output", required=True, help="directory to write")
    r.add_argument("--json-model-override-args", default=None)
    r.add_argument("--dtype", default="float32")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-shard-mb", type=float, default=2048, help="shard size; smaller writes an index")
    r.set_defaults(func=cmd_random_checkpoint)
    d = csub.add_parser("random-draft", help="a random draft checkpoint for a target model directory")
    d.add_argument("--target", required=True, help="target model directory (config.json)")
    d.add_argument("--algorithm", default="NEXTN", choices=["NEXTN", "EAGLE", "DSPARK", "DFLASH"])
    d.add_argument("--output", required=True)
    d.add_argument("--json-model-override-args", default=None)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--block-size", type=int, default=8, help="DSpark/DFlash: gamma query slots")
    d.add_argument("--num-layers", type=int, default=1, help="DSpark/DFlash draft depth")
    d.add_argument("--markov-rank", type=int, default=32, help="DSpark Markov head rank")
    d.set_defaults(func=cmd_random_draft)


def _add_bench(sub) -> None:
    from baton.bench.serving import add_bench_args
    from baton.bench.serving import main as bench_main

    p = sub.add_parser("bench", help="bench_serving-compatible benchmark client",
                       description="Benchmark a running baton / SGLang / vLLM / OpenAI-compatible server.")
    add_bench_args(p)
    p.set_defaults(func=lambda ns: bench_main(ns))


def _add_census(sub) -> None:
    from baton.bench import census

    p = sub.add_parser("census", help="GPU time of one decode step by category, with the floor",
                       description=census.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    census.add_census_args(p)
    p.set_defaults(func=census.main)


def _add_train(sub) -> None:
    from baton.train.cli import add_train_parser

    add_train_parser(sub)


def _add_gate(sub) -> None:
    from baton.bench.gate import add_gate_parser

    add_gate_parser(sub)


def _add_sweep(sub) -> None:
    from baton.bench.sweep import add_sweep_parser

    add_sweep_parser(sub)


def _add_eval(sub) -> None:
    from baton.bench.gsm8k import add_eval_parser

    add_eval_parser(sub)


# Every subcommand: its one-line help and the function that adds its parser. A tool's module (and what it imports)
# is loaded only when its command runs or its --help is asked for, so `baton --help` and `baton generate` never
# import the tools' dependencies.
COMMANDS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "generate": ("generate text from one prompt, streamed to the terminal", _add_generate),
    "serve": ("OpenAI-compatible HTTP server (SGLang flags)", _add_serve),
    "convert": ("write random checkpoints (models and drafts) in the real layouts", _add_convert),
    "census": ("GPU time of one decode step by category, with the floor", _add_census),
    "bench": ("bench_serving-compatible benchmark client", _add_bench),
    "gate": ("correctness gate: greedy parity, accept length, state pollution", _add_gate),
    "sweep": ("benchmark a grid of NEXTN steps or DSpark gammas", _add_sweep),
    "eval": ("accuracy evaluations (gsm8k)", _add_eval),
    "train": ("train speculative drafts (NEXTN, DSpark, DFlash) on target-made data", _add_train),
}


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand an argument list names (its first word that is one), or None (``baton --help``)."""
    return next((a for a in argv if a in COMMANDS), None)


def build_parser(command: str | None = "all") -> argparse.ArgumentParser:
    """The ``baton`` parser. ``command`` names the one subcommand whose full parser is built (the others are
    listed by name and help only); "all" builds every one (this imports every tool module)."""
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (text, add) in COMMANDS.items():
        if command in ("all", name):
            add(sub)
        else:
            sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser(command_of(argv)).parse_args(argv)
    logging.basicConfig(level=getattr(ns, "log_level", "warning").upper() if hasattr(ns, "log_level") else "WARNING",
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        rc = ns.func(ns) or 0
    except ConfigError as e:
        print(f"baton: error: {e}", file=sys.stderr)
        rc = 2
    except FileNotFoundError as e:  # a path on the command line (data, checkpoint, output parent) that is not there
        print(f"baton: error: {e.strerror}: {e.filename}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        rc = 130
    dist = sys.modules.get("baton.dist")
    if dist is not None and dist.nccl_left_behind():  # a TP run on GPUs: its NCCL group must not be destructed
        dist.hard_exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
