"""The embedded SmolLM2-135M-Instruct (a llama, fp32 on CPU) with its weights rounded through fp8 e4m3 with 128 x 128
block scales, in place (the CPU emulation of an fp8 target): the MLP only (``fake_quantize_mlp_fp8``, the stand-in for
fp8 experts) and every dense projection (``fake_quantize_dense_fp8``, attention too: the stand-in for
``--quantization fp8``), against the unrounded model on a chat prompt: relative logit error, max / mean absolute
difference and top-1 agreement over the reference's own greedy continuation (teacher-forced), and the greedy prefix
the two free-running generations share.

    PYTHONPATH=. python benchmarks/results/fp8-dense-2026-12-01/smollm2_logits.py [--tokens 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import env_card
from benchmarks.fp8_accuracy import _compare


def main() -> None:
    from baton.config import ServerArgs
    from baton.engine.engine import Engine
    from baton.layers.context import ModelRunner
    from baton.ops.quant import fake_quantize_dense_fp8, fake_quantize_mlp_fp8
    from baton.types import ForwardMode

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ref = Engine(ServerArgs(dtype="float32"))
    tok = ref.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Explain how a rainbow forms."}]))
    record = {"benchmark": "fp8_dense_smollm2_logits", "env": env_card(), "tokens": args.tokens}
    for name, rounding in (("mlp", fake_quantize_mlp_fp8), ("dense", fake_quantize_dense_fp8)):
        test = Engine(ServerArgs(dtype="float32"))
        record[f"{name}_matrices"] = rounding(test.model)
        fig = _compare(ref.model, test.model, prompt, args.tokens)

        def forward(model, ids):
            runner = ModelRunner(model.make_cache(len(ids) + 8, torch.float32, torch.device("cpu")),
                                 torch.device("cpu"))
            with torch.inference_mode():
                return model.compute_logits(model(torch.tensor(ids), runner.context(ForwardMode.PREFILL, 0,
                                                                                    len(ids))))

        a, b = forward(ref.model, prompt), forward(test.model, prompt)
        d = (a - b).abs()
        fig.update(prompt_max_abs_diff=d.max().item(), prompt_mean_abs_diff=d.mean().item(),
                   prompt_logit_std=a.std().item())
        record[name] = fig
        print(name, json.dumps(fig), flush=True)
        del test
    text = json.dumps(record, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
