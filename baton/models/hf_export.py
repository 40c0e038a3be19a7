"""A Hugging Face ``transformers`` model holding the weights of a loaded baton model (llama-type targets only).

Used where a batched reference is wanted: ``baton train data --backend hf`` (batched generation) and the
SmolLM2 decode benchmark (``transformers`` ``generate`` against baton). transformers is imported here lazily,
inside the function, so ``import baton`` never imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def to_hf_llama(model: nn.Module, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, attn_implementation: str = "sdpa") -> Any:
    """A ``transformers.LlamaForCausalLM`` (eval mode) with the same weights as the baton llama ``model``.

    The config comes from ``model.config`` (``baton.config.config_to_dict``), the tensors from the checkpoint
    layout (``baton.models.checkpoint.hf_layout`` slots viewed in ``model``'s parameters). Where ``device`` and
    ``dtype`` (default: those of ``model``) match, the HF parameters share storage with baton's (no copy);
    otherwise they are converted copies. Attention: ``attn_implementation`` (transformers' name; default
    ``"sdpa"``, torch's scaled_dot_product_attention). Raises ValueError for a target that is not a llama
    model, or one sharded by tensor parallelism.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from baton.config import LlamaConfig as BatonLlamaConfig
    from baton.config import config_to_dict
    from baton.models.checkpoint import hf_layout

    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if not isinstance(cfg, BatonLlamaConfig) or model_type != "llama":
        raise ValueError(f"a Hugging Face export is only available for llama-type targets, not {model_type!r} "
                         "(use the engine backend)")
    layout = hf_layout(model)
    if any(slot.src is not None for slot in layout.values()):
        raise ValueError("a Hugging Face export needs the whole model on one device (no tensor parallelism)")
    first = next(model.parameters())
    device = torch.device(device) if device is not None else first.device
    dtype = dtype or first.dtype

    # sdpa, stated (not left to transformers' default): eager attention materialises the (batch, heads, query,
    # key) scores, which batched generation with long prompts cannot afford
    hf_cfg = LlamaConfig(**{k: v for k, v in config_to_dict(cfg).items() if k not in ("model_type", "torch_dtype")},
                         attn_implementation=attn_implementation)
    params = dict(model.named_parameters())
    sd = {name: slot.view(params).detach().to(device=device, dtype=dtype) for name, slot in layout.items()}
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    with torch.device(device):
        hf = LlamaForCausalLM(hf_cfg)  # its random weights are all replaced below; buffers (RoPE) stay fp32
    hf.requires_grad_(False)
    # assign=True: the HF parameters become these tensors (views of baton's where no conversion was needed)
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"Hugging Face export: missing {missing}, unexpected {unexpected}")
    return hf.eval()


__all__ = ["to_hf_llama"]
