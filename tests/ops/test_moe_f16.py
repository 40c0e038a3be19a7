"""fp8 MoE on the fp16 MMA (``mode="f16"``: the w8a8 kernels with x and each pair's SwiGLU output scaled per (row,
128-K group) by a power of two into fp16's range, the e4m3 weights widened to fp16): the kernels (Triton interpreter
on CPU, compiled on CUDA) against the plain-PyTorch reference ``naive.fused_experts_fp8_f16``, which computes the same
arithmetic; that reference against the w8a16 fp32 product; the table switch that makes it the default."""

from __future__ import annotations

import pytest
import torch

from baton.ops.moe.naive import fused_experts, fused_experts_fp8_f16
from baton.ops.quant import dequantize_fp8_block, dequantize_fp8_gate_up
from baton.ops.quant.fp8 import scale_act_f16
from tests.ops.test_moe_w8a8 import _experts, _routes
from tests.ops.triton_support import interpreted_module

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _mt():
    return interpreted_module("baton.ops.moe.triton")


@pytest.mark.parametrize("k", [128, 300, 7])
def test_f16_scaling_is_exact_for_bf16_rows(k):
    """Powers of two that put each group's amax in [2^14, 2^15); bf16 values come back exactly (far from the
    group's amax too: a row spanning 2^-20 .. 1); fp32 values to fp16's 11 bits; a zero group gives zeros."""
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=gen) * torch.logspace(-20, 20, 5)[:, None]).bfloat16()  # inside the +-100 clamp
    x[2, :] = 0.0
    x[3, :] = (torch.randn(k, generator=gen) * 2.0**-20).bfloat16()  # one group spanning 2^-2x .. 1
    x[3, 0] = 1.0
    q, s = scale_act_f16(x)
    assert q.dtype == torch.float16 and q.shape == x.shape and s.shape == (5, (k + 127) // 128)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)
    pad = (-k) % 128
    qf = torch.nn.functional.pad(q.float(), (0, pad)).view(5, -1, 128)
    deq = (qf * s[..., None]).view(5, -1)[:, :k]
    assert torch.equal(deq, x.float())
    amax = qf.abs().amax(-1)
    nz = amax > 0
    assert torch.all((amax[nz] >= 2.0**14) & (amax[nz] < 2.0**15))
    xf = torch.randn(3, k, generator=gen) * 1e3
    q32, s32 = scale_act_f16(xf)
    back = (torch.nn.functional.pad(q32.float(), (0, pad)).view(3, -1, 128) * s32[..., None]).view(3, -1)[:, :k]
    assert ((back - xf).abs() <= xf.abs() * 2.0**-11 + 1e-30).all()


@pytest.mark.parametrize("num_tokens,align,drop_from", [(1, None, None), (2, None, 1), (3, None, None),
                                                       (6, "triton", 4), (6, "torch", None)])
@pytest.mark.parametrize("limit", [0.0, 4.0])
def test_f16_kernel_matches_reference(num_tokens, align, drop_from, limit):
    """Ragged shapes (d = 160, I = 136: partial 128-groups along both K axes), top-3 of 6 experts (aligned blocks of
    several rows), ids -1 past ``drop_from``; bf16 activations as the model runs them."""
    mt = _mt()
    gen = torch.Generator().manual_seed(10 * num_tokens + int(limit))
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    x = torch.randn(num_tokens, 160, generator=gen).bfloat16()
    ids, w = _routes(num_tokens, 6, 3, gen, drop_from)
    res = torch.randn(num_tokens, 160, generator=gen).bfloat16()
    shared = torch.randn(num_tokens, 160, generator=gen).bfloat16()
    ref = (fused_experts_fp8_f16(x, q13, s13, q2, s2, ids, w, limit) + shared.float() + res.float()).bfloat16()
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), limit, residual=to(res),
                                  shared_out=to(shared), w13_scale=to(s13), w2_scale=to(s2), mode="f16", align=align)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=1e-2, atol=1e-2)  # one bf16 rounding apart
    # fp32 activations: no output rounding, the sums' order alone
    out32 = mt.fused_experts_decode(to(x.float()), to(q13), to(q2), to(ids), to(w), limit, residual=to(res.float()),
                                    shared_out=to(shared.float()), w13_scale=to(s13), w2_scale=to(s2), mode="f16",
                                    align=align)
    ref32 = fused_experts_fp8_f16(x.float(), q13, s13, q2, s2, ids, w, limit) + shared.float() + res.float()
    torch.testing.assert_close(out32.cpu(), ref32, rtol=1e-4, atol=1e-4)


def test_f16_tiles():
    mt = _mt()
    gen = torch.Generator().manual_seed(2)
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    x = torch.randn(4, 160, generator=gen)
    ids, w = _routes(4, 6, 3, gen)
    ref = fused_experts_fp8_f16(x, q13, s13, q2, s2, ids, w, 0.0)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    for bn, st in ((32, 2), (128, 1)):
        cfg = mt.MoEConfig(up=mt.MoETile(bn, 128, 4, st), down=mt.MoETile(bn, 128, 4, st))
        out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), 0.0, w13_scale=to(s13),
                                      w2_scale=to(s2), mode="f16", config=cfg)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_f16_reference_against_w8a16_product():
    """The fp16 scaling costs fp16's rounding of the SwiGLU output alone: against fp32 math on the same
    (dequantised) fp8 experts, ~1e-4 relative; the capture form equals the loop."""
    gen = torch.Generator().manual_seed(7)
    _, _, q13, s13, q2, s2 = _experts(8, 384, 256, gen)
    x = torch.randn(5, 384, generator=gen).bfloat16().float()
    ids, w = _routes(5, 8, 4, gen, drop_from=4)
    got = fused_experts_fp8_f16(x, q13, s13, q2, s2, ids, w, 4.0)
    deq = fused_experts(x, dequantize_fp8_gate_up(q13, s13, torch.float32), dequantize_fp8_block(q2, s2, torch.float32),
                        ids, w, 4.0)
    rel = ((got - deq).norm() / deq.norm()).item()
    assert rel < 1e-3
    torch.testing.assert_close(fused_experts_fp8_f16(x, q13, s13, q2, s2, ids, w, 4.0, capturing=True), got,
                               rtol=1e-6, atol=1e-6)


def test_f16_is_the_default_only_where_the_table_prefers_it(monkeypatch):
    """Without a tuned ``fp8_f16`` entry that prefers it (the CPU, a GPU without one) fp8 experts take the direct
    kernels; with one, the fp16 MMA; an explicit mode or act_fp8 overrides the table."""
    mt = _mt()
    from baton.ops.moe import table

    calls = []
    real = mt.fused_experts_w8a8

    def spy(*a, act="e4m3", **k):
        calls.append(act)
        return real(*a, act=act, **k)

    monkeypatch.setattr(mt, "fused_experts_w8a8", spy)
    gen = torch.Generator().manual_seed(4)
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    x = torch.randn(2, 160, generator=gen)
    ids, w = _routes(2, 6, 3, gen)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    args = (to(x), to(q13), to(q2), to(ids), to(w), 0.0)
    kw = dict(w13_scale=to(s13), w2_scale=to(s2))
    assert not table.get_config(2, "fp8_f16").preferred or HAS_CUDA
    if not HAS_CUDA:
        mt.fused_experts_decode(*args, **kw)
        assert calls == []
    prefer = {"fp8_f16": {table.ANY_T: table.MoEConfig(up=table.MoETile(64, 128, 4, 2),
                                                       down=table.MoETile(64, 128, 4, 2))}}
    monkeypatch.setattr(table, "device_table", lambda name: {**table.FALLBACK, **prefer})
    ref = fused_experts_fp8_f16(x, q13, s13, q2, s2, ids, w, 0.0)
    torch.testing.assert_close(mt.fused_experts_decode(*args, **kw).cpu(), ref, rtol=1e-4, atol=1e-4)
    assert calls[-1] == "f16"
    mt.fused_experts_decode(*args, **kw, mode="direct")
    mt.fused_experts_decode(*args, **kw, act_fp8=True)
    assert calls[-1] == "e4m3" and calls.count("f16") == 1


def test_table_round_trips_preferred(tmp_path):
    from baton.ops.moe import table

    cfg = table.MoEConfig(up=table.MoETile(64, 128, 4, 3), down=table.MoETile(128, 128, 8, 3), preferred=False)
    path = table.write_table([{"kind": "fp8_f16", "max_tokens": 1, "config": cfg},
                              {"kind": "fp8_f16", "max_tokens": 8, "config": table.MoEConfig(cfg.up, cfg.down)}],
                             "test gpu", tmp_path / "t.json")
    back = table.read_table(path)["fp8_f16"]
    assert back[1] == cfg and back[8].preferred and not back[1].preferred
    cfg2 = table.MoEConfig(cfg.up, cfg.down, token_down=True)
    path = table.write_table([{"kind": "fp8_f16", "max_tokens": 8, "config": cfg2}], "test gpu", tmp_path / "t.json")
    assert table.read_table(path)["fp8_f16"][8] == cfg2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 6, 17])
def test_gpu_f16_ling_shapes(num_tokens):
    """Ling-3.0-flash fp8 experts (32 of them: the kernels index by id), bf16 activations, random routes, rows past
    the last dropped: the compiled fp16 MMA against the reference (one bf16 output rounding, the MMA's order) and
    against the direct fp8 kernels (w8a16 in fp32 FMAs: the same numbers to fp16's rounding of the SwiGLU output);
    then captured in a CUDA graph under sync-debug 'error'."""
    import baton.ops.moe.triton as mt
    from baton.ops.quant import quantize_fp8_block, quantize_fp8_gate_up
    from tests.ops.triton_support import assert_graph_replays_without_sync

    e, d, inter = 32, 2560, 768
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    q13, s13 = quantize_fp8_gate_up(torch.randn(e, 2 * inter, d, generator=gen, device=DEVICE) * d**-0.5)
    q2, s2 = quantize_fp8_block(torch.randn(e, d, inter, generator=gen, device=DEVICE) * inter**-0.5)
    cpu_gen = torch.Generator().manual_seed(num_tokens)
    ids, w = _routes(num_tokens, e, 8, cpu_gen, drop_from=num_tokens - 1 if num_tokens > 1 else None)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    x = torch.randn(num_tokens, d, generator=gen, device=DEVICE).bfloat16()
    res = torch.randn(num_tokens, d, generator=gen, device=DEVICE).bfloat16()
    step = lambda: mt.fused_experts_decode(x, q13, q2, ids, w, 7.0, residual=res, w13_scale=s13,  # noqa: E731
                                           w2_scale=s2, mode="f16")
    out = step().float()
    ref = fused_experts_fp8_f16(x, q13, s13, q2, s2, ids, w, 7.0) + res.float()
    routed = (ref - res.float()).norm()
    assert ((out - ref).norm() / routed).item() < 1e-2
    direct = mt.fused_experts_decode(x, q13, q2, ids, w, 7.0, residual=res, w13_scale=s13, w2_scale=s2,
                                     mode="direct").float()
    assert ((out - direct).norm() / routed).item() < 1e-2
    assert_graph_replays_without_sync(step)


@pytest.mark.parametrize("act,num_tokens,drop_from", [("f16", 6, 4), ("e4m3", 6, None), ("f16", 12, None),
                                                      ("e4m3", 1, None)])
def test_direct_token_down_matches_reference(act, num_tokens, drop_from):
    """``align="none"``: the up kernel per pair and ``moe_down_token_kernel`` (down + combine per token), for both
    activation scalings, against the references (ids -1 past ``drop_from``; ragged d = 160, I = 136)."""
    from baton.ops.moe.naive import fused_experts_w8a8

    mt = _mt()
    gen = torch.Generator().manual_seed(num_tokens + len(act))
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    x = torch.randn(num_tokens, 160, generator=gen)
    ids, w = _routes(num_tokens, 6, 3, gen, drop_from)
    res, shared = torch.randn(num_tokens, 160, generator=gen), torch.randn(num_tokens, 160, generator=gen)
    ref = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 4.0, act=act) + shared + res
    to = lambda t: t.to(DEVICE)  # noqa: E731
    form = {"mode": "f16"} if act == "f16" else {"act_fp8": True}
    out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), 4.0, residual=to(res),
                                  shared_out=to(shared), w13_scale=to(s13), w2_scale=to(s2), align="none", **form)
    tol = dict(rtol=1e-2, atol=2e-3) if HAS_CUDA and act == "e4m3" else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.cpu(), ref, **tol)


@pytest.mark.parametrize("act,num_tokens,align", [("e4m3", 2, "none"), ("f16", 3, "triton")])
def test_fused_shared_expert_f16_and_token_down(act, num_tokens, align):
    """A fused shared expert (expert 6 of 7, every row's last column, weight 1, its own clamp) on the fp16 MMA
    (mode "f16", aligned) and on the token-down kernel (``align="none"``)."""
    from baton.ops.moe.naive import append_shared_expert
    from tests.ops.test_moe_w8a8 import _shared_reference

    mt = _mt()
    gen = torch.Generator().manual_seed(num_tokens + len(act))
    _, _, q13, s13, q2, s2 = _experts(7, 160, 136, gen)
    x = torch.randn(num_tokens, 160, generator=gen)
    ids, w = append_shared_expert(*_routes(num_tokens, 6, 3, gen), 6)
    res = torch.randn(num_tokens, 160, generator=gen)
    want = _shared_reference(x, q13, s13, q2, s2, ids, w, 0.6, 1.0, act=act) + res
    to = lambda t: t.to(DEVICE)  # noqa: E731
    form = {"mode": "f16"} if act == "f16" else {"act_fp8": True}
    out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), 0.6, residual=to(res), w13_scale=to(s13),
                                  w2_scale=to(s2), align=align, shared_id=6, shared_limit=1.0, **form)
    tol = dict(rtol=1e-2, atol=2e-3) if HAS_CUDA and act == "e4m3" else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.cpu(), want, **tol)


def test_token_down_is_the_tables_choice(monkeypatch):
    """Tiles with ``token_down`` run two launches at any T (no alignment, no combine); without it, T >= 3 takes the
    alignment and the combine."""
    mt = _mt()
    launched = []
    for name in ("moe_align_fwd", "moe_combine_fwd"):
        real = getattr(mt, name)
        monkeypatch.setattr(mt, name, lambda *a, _n=name, _r=real, **k: (launched.append(_n), _r(*a, **k))[1])
    gen = torch.Generator().manual_seed(9)
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    tiles = dict(up=mt.MoETile(32, 128, 4, 2), down=mt.MoETile(32, 128, 4, 2))
    for token_down, expect in ((True, []), (False, ["moe_align_fwd", "moe_combine_fwd"])):
        launched.clear()
        x = torch.randn(5, 160, generator=gen)
        ids, w = _routes(5, 6, 3, gen)
        out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), 0.0, w13_scale=to(s13),
                                      w2_scale=to(s2), mode="f16",
                                      config=mt.MoEConfig(**tiles, token_down=token_down))
        assert launched == expect
        torch.testing.assert_close(out.cpu(), fused_experts_fp8_f16(x, q13, s13, q2, s2, ids, w, 0.0),
                                   rtol=1e-4, atol=1e-4)
