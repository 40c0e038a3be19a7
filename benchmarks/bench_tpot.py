"""Median TPOT of greedy requests through ``Engine.generate`` for one engine configuration, on one GPU: the A/B
harness for a change of the engine (it uses only Engine, ServerArgs and SpecConfig, so the same script times
an older checkout: ``PYTHONPATH=OLD python benchmarks/bench_tpot.py ...``).

    python benchmarks/bench_tpot.py --model-path benchmarks/configs/smollm2-135m-instruct --load-format dummy \\
        [--speculative-algorithm NEXTN --speculative-draft-model-path DRAFT --speculative-num-steps 3 \\
         --speculative-simulate-accept-len 3.0] [--input-len 512] [--output-len 256] [--num-requests 5] \\
        [--label NAME] [--json FILE]

Prints one JSON line: the label, the commit (``BATON_COMMIT``), TPOT median / min / max (ms), TTFT median, the
accept length, and each request's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from benchmarks.common import summarize, timed_request


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json-model-override-args", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-simulate-accept-len", type=float, default=None)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=5)
    p.add_argument("--label", default="")
    p.add_argument("--json", default=None, help="append the record to this file")
    ns = p.parse_args()

    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine

    spec = SpecConfig(algorithm=ns.speculative_algorithm, draft_model_path=ns.speculative_draft_model_path,
                      num_steps=ns.speculative_num_steps, num_draft_tokens=ns.speculative_num_draft_tokens,
                      simulate_accept_len=ns.speculative_simulate_accept_len)
    args = ServerArgs(model_path=ns.model_path, load_format=ns.load_format, dtype=ns.dtype, device="cuda",
                      json_model_override_args=ns.json_model_override_args, quantization=ns.quantization,
                      context_length=ns.input_len + ns.output_len + 64, spec=spec)
    engine = Engine(args)
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(100, min(vocab, 32000), (ns.input_len,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()

    timed_request(engine, prompt, 32)  # warm: compiles, captures, allocator
    runs = [timed_request(engine, prompt, ns.output_len) for _ in range(ns.num_requests)]
    record = {"label": ns.label, "commit": os.environ.get("BATON_COMMIT", "unknown"),
              "gpu": torch.cuda.get_device_name(), "argv": sys.argv[1:],
              "tpot_ms": summarize(runs, "tpot_ms"), "ttft_ms_median": summarize(runs, "ttft_ms")["median"],
              "accept_length": runs[-1]["accept_length"], "runs": runs}
    line = json.dumps(record)
    print(line, flush=True)
    if ns.json:
        with open(ns.json, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
