"""Shared fixtures: tiny configs of the real architectures, fp32 on CPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU-only machines; this must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from baton.cli import main as baton_main

TINY_LING = dict(
    model_type="bailing_hybrid", vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=6,
    num_attention_heads=4, head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, layer_group_size=3,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None,
    short_conv_kernel_size=4, num_shared_experts=1, moe_shared_expert_intermediate_size=24,
    expert_swiglu_limit_list=[0, 0, 0, 0, 4.0, 4.0], share_expert_swiglu_limit_list=[0, 0, 0, 5.0, 7.0, 7.0],
    num_nextn_predict_layers=1, rope_theta=10000.0, eos_token_id=1, tie_word_embeddings=False,
)

TINY_LLAMA = dict(
    model_type="llama", vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, eos_token_id=1, max_position_embeddings=512,
)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# ---- tiny checkpoints on disk (session-wide), used by the spec, engine, server and tool tests ----

@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("spec_ckpts")


@pytest.fixture(scope="session")
def ling_path(ckpt_root) -> str:
    return _write_checkpoint(ckpt_root, "ling", TINY_LING)


@pytest.fixture(scope="session")
def llama_path(ckpt_root) -> str:
    return _write_checkpoint(ckpt_root, "llama", TINY_LLAMA)


@pytest.fixture(scope="session")
def llama_nextn_path(ckpt_root, llama_path) -> str:
    out = str(ckpt_root / "llama_nextn")
    assert baton_main(["convert", "random-draft", "--target", llama_path, "--algorithm", "NEXTN",
                       "--output", out]) == 0
    return out




def _write_checkpoint(root, name: str, cfg: dict) -> str:
    from tests.speculative.conftest import write_checkpoint

    return write_checkpoint(root, name, cfg)


def pytest_collection_modifyitems(config, items):
    """GPU tests (marked ``gpu``) are skipped on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
