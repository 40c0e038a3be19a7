"""The MLA glue options compiled for sm_90 on any machine (no GPU): ``mla_decode_kernel`` with the head-wise gate
in its store, ``attention_reduce_kernel`` with it in the merge, ``rope_and_cache_write_kernel`` with
kv_a_layernorm, at Ling-3.0-flash's widths, with the options off passed as the launchers pass them (None
pointers and scalars, constexpr False), whose kernels take no parameter for them. The interpreter tests run the
same code paths but cannot catch a construct only the compiler refuses. Runs in a process of its own (the test
session interprets the kernels); needs Triton's NVIDIA ptxas, skipped without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.ops import sass_linear

pytestmark = pytest.mark.skipif(not sass_linear.available(), reason="Triton has no NVIDIA ptxas here")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from baton.ops.attention import rope_cache as rc, triton as ta
from baton.ops.mla_decode import triton as tm

def compile_(kern, types, consts, **options):
    sig = {n: "constexpr" if n in consts else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
           for n in kern.arg_names}
    k = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, **options))
    entry = k.asm["ptx"][k.asm["ptx"].index(".entry"):]
    return dict(params=len(re.findall(r"\.param \.", entry[: entry.index(")")])), cubin=len(k.asm["cubin"]))

fp32_part = dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", pos_ptr="*i64")
red = dict(HEAD_DIM_V=512, BLOCK_DV=64, BLOCK_N=64, BLOCK_T=8, BLOCK_SPLITS=128, USE_PDL=True)
rope = dict(HALF=32, HEAD_DIM_K=64, HEAD_DIM_V=512, BLOCK_HALF=32, BLOCK_HQ=32, BLOCK_HK=1, BLOCK_HV=1, BLOCK_PASS=0,
            BLOCK_DV=512, INTERLEAVED=True, USE_TABLE=False, HAS_Q=True, HAS_V=True, INTERPRET=False,
            USE_LIBDEVICE=True, USE_PDL=True)
mla = dict(KV_RANK=512, ROPE_DIM=64, BLOCK_C=512, BLOCK_R=64, BLOCK_M=32, BLOCK_N=64, BLOCK_T=1, SPLIT_KV=False,
           PRECISION="tf32", UPCAST=False, USE_PDL=True)
off_red = dict(gate_ptr=None, stride_g_t=None, HAS_GATE=False)
off_rope = dict(v_norm_w_ptr=None, v_norm_eps=None, V_NORM=False)
out = {
    "reduce_gate": compile_(ta.attention_reduce_kernel, fp32_part, dict(red, HAS_GATE=True)),
    "reduce_plain": compile_(ta.attention_reduce_kernel, fp32_part, dict(red, **off_red)),
    "rope_norm": compile_(rc.rope_and_cache_write_kernel, dict(freq_ptr="*fp32", pos_ptr="*i64", v_norm_eps="fp32"),
                          dict(rope, V_NORM=True)),
    "rope_norm_w32": compile_(rc.rope_and_cache_write_kernel,
                              dict(freq_ptr="*fp32", pos_ptr="*i64", v_norm_eps="fp32", v_norm_w_ptr="*fp32"),
                              dict(rope, V_NORM=True)),
    "rope_plain": compile_(rc.rope_and_cache_write_kernel, dict(freq_ptr="*fp32", pos_ptr="*i64"),
                           dict(rope, **off_rope)),
    "mla_gate": compile_(tm.mla_decode_kernel, dict(fp32_part, qk_scale="fp32"), dict(mla, HAS_GATE=True),
                         num_stages=3),
}
print(json.dumps(out))
"""


def test_glue_options_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert all(v["cubin"] > 0 for v in out.values())
    # Off, the option's pointer and scalar are constexprs: two kernel parameters fewer than with it on.
    assert out["reduce_plain"]["params"] == out["reduce_gate"]["params"] - 2
    assert out["rope_plain"]["params"] == out["rope_norm"]["params"] - 2
