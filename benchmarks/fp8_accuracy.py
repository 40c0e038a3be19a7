"""fp8 expert accuracy against bf16 (CPU is enough: the reference path dequantises, the kernel matches it).

    python benchmarks/fp8_accuracy.py [--tokens 256]

1. A small random Ling config (8 layers, 32 experts of width 256, bf16 weights): the fp8 model quantises the same
   experts with 128 x 128 block scales (e4m3). Reported: relative logit error over the bf16 model's own 256-token
   greedy continuation (teacher-forced), the fraction of positions whose argmax agrees, and how many tokens the two
   free-running greedy generations share before they diverge.
2. The embedded SmolLM2-135M-Instruct with its MLP weights (gate/up and down: its "experts") quantised the same way
   (quantise then dequantise in place), same three figures on a chat prompt.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from benchmarks.common import env_card, save

SMALL_LING = dict(
    model_type="bailing_hybrid", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, layer_group_size=4,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_shared_experts=1,
    moe_shared_expert_intermediate_size=256, rope_theta=10000.0, eos_token_id=1,
)


def _compare(ref_model, test_model, prompt: list[int], tokens: int) -> dict:
    from baton.layers.context import ModelRunner
    from baton.types import ForwardMode

    def forward(model, ids):
        p = next(model.parameters())
        runner = ModelRunner(model.make_cache(len(ids) + 8, torch.float32, p.device), p.device)
        with torch.inference_mode():
            return model.compute_logits(model(torch.tensor(ids), runner.context(ForwardMode.PREFILL, 0, len(ids))))

    def greedy(model, ids, n):
        p = next(model.parameters())
        runner = ModelRunner(model.make_cache(len(ids) + n + 8, torch.float32, p.device), p.device)
        out = []
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(ids), runner.context(ForwardMode.PREFILL, 0, len(ids))))
            for i in range(n):
                out.append(int(logits[-1].argmax()))
                ctx = runner.context(ForwardMode.DECODE, len(ids) + i, 1)
                logits = model.compute_logits(model(torch.tensor(out[-1:]), ctx))
        return out

    ref_tokens = greedy(ref_model, prompt, tokens)
    seq = prompt + ref_tokens
    a, b = forward(ref_model, seq)[len(prompt) - 1 : -1], forward(test_model, seq)[len(prompt) - 1 : -1]
    test_tokens = greedy(test_model, prompt, tokens)
    shared = next((i for i, (x, y) in enumerate(zip(ref_tokens, test_tokens, strict=True)) if x != y), tokens)
    return {"logit_rel_err": ((a - b).norm() / a.norm()).item(),
            "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "greedy_shared_prefix": shared, "tokens": tokens}


def small_ling(tokens: int) -> dict:
    from baton.config import parse_model_config
    from baton.models.build import build_model
    from baton.models.checkpoint import init_dummy_weights, load_tensors, save_hf_checkpoint

    cfg = parse_model_config(SMALL_LING)
    ref = build_model(cfg, "cpu", torch.bfloat16)
    init_dummy_weights(ref, 0)
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(ref, SMALL_LING, d)
        fp8_cfg = parse_model_config({**SMALL_LING, "quantization_config": {"quant_method": "fp8"}})
        from baton.models.checkpoint import iter_safetensors, safetensors_files

        fp8 = build_model(fp8_cfg, "cpu", torch.float32)
        load_tensors(fp8, iter_safetensors(safetensors_files(d)))
    ref = ref.float()  # compute in fp32 with the bf16-valued weights: the error measured is the fp8 experts'
    return _compare(ref, fp8, list(range(10, 42)), tokens)


def smollm2(tokens: int) -> dict:
    from baton.config import ServerArgs
    from baton.engine.engine import Engine
    from baton.layers.fake_quant import fake_quantize_mlp_fp8

    ref = Engine(ServerArgs())
    test = Engine(ServerArgs())
    fake_quantize_mlp_fp8(test.model)
    tok = ref.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Explain how a rainbow forms."}]))
    return _compare(ref.model, test.model, prompt, tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    record = {"benchmark": "fp8_accuracy", "env": env_card(), "small_ling": small_ling(args.tokens),
              "smollm2_mlp_fp8": smollm2(args.tokens)}
    print(json.dumps(record, indent=2, default=str))
    save("fp8_accuracy", record)


if __name__ == "__main__":
    main()
