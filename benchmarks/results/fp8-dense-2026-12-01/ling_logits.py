"""fp8 dense vs bf16 logits on a small random Ling (CPU; the reference path dequantises, the kernel matches it).

    python benchmarks/results/fp8-dense-2026-12-01/ling_logits.py [--tokens 128] [--out FILE]

The small Ling of benchmarks/fp8_accuracy.py (8 layers, hidden 256, 32 experts of width 256, bf16 weights written as a
checkpoint) loaded three times in fp32: unquantised, ``--quantization fp8-experts`` and ``--quantization fp8``
(experts + dense), the fp8 weights quantised at load. Per mode: over the unquantised model's own greedy continuation
(teacher-forced), the max / mean absolute logit difference, the relative error, the top-1 agreement, and the greedy
prefix the free-running generations share; and one layer's relative error (KDA and MLA attention, the dense MLP, a
MoE block) on the same input, which no depth amplifies.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from benchmarks.common import env_card
from benchmarks.fp8_accuracy import SMALL_LING, _compare


def _layer_errors(ref, test) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, SMALL_LING["hidden_size"], generator=gen)
    out = {}
    with torch.inference_mode():
        for name, fn in (("kda_attention", lambda m: _attn(m, 0, x)), ("mla_attention", lambda m: _attn(m, 3, x)),
                         ("dense_mlp", lambda m: m.model.layers[0].mlp(x)),
                         ("moe_block", lambda m: m.model.layers[1].mlp(x))):
            a, b = fn(ref), fn(test)
            out[name] = ((a - b).norm() / a.norm()).item()
    return out


def _attn(model, i, x):
    from baton.layers.context import ModelRunner
    from baton.types import ForwardMode

    runner = ModelRunner(model.make_cache(x.shape[0] + 8, torch.float32, torch.device("cpu")), torch.device("cpu"))
    layer = model.model.layers[i]
    return layer.attention(x, runner.context(ForwardMode.PREFILL, 0, x.shape[0]), norm=layer.input_layernorm)


def _abs_figures(ref, test, prompt, tokens) -> dict:
    from baton.layers.context import ModelRunner
    from baton.types import ForwardMode

    def forward(model, ids):
        runner = ModelRunner(model.make_cache(len(ids) + 8, torch.float32, torch.device("cpu")), torch.device("cpu"))
        with torch.inference_mode():
            return model.compute_logits(model(torch.tensor(ids), runner.context(ForwardMode.PREFILL, 0, len(ids))))

    a, b = forward(ref, prompt + tokens), forward(test, prompt + tokens)
    a, b = a[len(prompt) - 1 : -1], b[len(prompt) - 1 : -1]
    d = (a - b).abs()
    return {"max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(), "logit_std": a.std().item()}


def main() -> None:
    from baton.config import parse_model_config
    from baton.models.load import _apply_quantization, build_model
    from baton.models.loader import (
        init_dummy_weights,
        iter_safetensors,
        load_tensors,
        safetensors_files,
        save_hf_checkpoint,
    )

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cfg = parse_model_config(SMALL_LING)
    bf16 = build_model(cfg, "cpu", torch.bfloat16)
    init_dummy_weights(bf16, 0)
    record = {"benchmark": "fp8_dense_ling_logits", "env": env_card(), "config": SMALL_LING, "tokens": args.tokens}
    prompt = list(range(10, 42))
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(bf16, SMALL_LING, d)

        def load(quantization):
            c = parse_model_config(SMALL_LING)
            _apply_quantization(c, quantization)
            m = build_model(c, "cpu", torch.float32)
            load_tensors(m, iter_safetensors(safetensors_files(d)))
            return m

        ref = load(None)  # the bf16-valued weights computed in fp32: the error measured is fp8's
        for mode in ("fp8-experts", "fp8"):
            test = load(mode)
            fig = _compare(ref, test, prompt, args.tokens)
            fig.update(_abs_figures(ref, test, prompt, [int(t) for t in _greedy(ref, prompt, args.tokens)]))
            fig["one_layer_rel_err"] = _layer_errors(ref, test)
            record[mode] = fig
            print(mode, json.dumps(fig), flush=True)
    text = json.dumps(record, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


def _greedy(model, ids, n):
    from baton.layers.context import ModelRunner
    from baton.types import ForwardMode

    runner = ModelRunner(model.make_cache(len(ids) + n + 8, torch.float32, torch.device("cpu")), torch.device("cpu"))
    out = []
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), runner.context(ForwardMode.PREFILL, 0, len(ids))))
        for i in range(n):
            out.append(int(logits[-1].argmax()))
            logits = model.compute_logits(model(torch.tensor(out[-1:]), runner.context(ForwardMode.DECODE,
                                                                                       len(ids) + i, 1)))
    return out


if __name__ == "__main__":
    main()
