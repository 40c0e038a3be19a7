"""fp8 dense projections for Ling (``--quantization fp8``: routed experts and every dense projection in e4m3 with
128 x 128 block scales; ``fp8-experts``: the experts only), on CPU: which layers are fp8, quantisation at load from a
bf16 checkpoint (``baton convert random-checkpoint``) part by part, dummy weights, fp8 checkpoints written and read
back (and dequantised under fp8-experts), logits close to the unquantised model's, the greedy speculative
invariant, the layers' fused forwards through the Triton kernel (interpreter) against the reference, tensor
parallelism (rank slices in one process; two gloo ranks end to end) and the census' dense bytes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from baton import dist
from baton.config import ServerArgs, SpecConfig, load_model_config
from baton.engine.engine import Engine
from baton.layers.linear import Linear
from baton.models.build import apply_quantization, build_model, init_dummy
from baton.models.checkpoint import hf_layout, init_dummy_weights, load_safetensors, save_hf_checkpoint
from baton.ops.quant import FP8_DTYPE, quantize_fp8_block
from tests.conftest import TINY_LING
from tests.helpers import full_logits, record_figure
from tests.ops.triton_support import interpreted_module
from tests.speculative.test_spec_core import PROMPT, run

IDS = torch.tensor([3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59])


# Tensor parallelism with fp8 experts needs moe_intermediate_size / tp a multiple of 128 (the experts refuse otherwise);
# the dense shards stay unaligned (heads * head_dim = 64, 4 heads, a 24-wide shared expert).
TP_LING = {**TINY_LING, "moe_intermediate_size": 256, "num_experts": 8, "n_group": 2, "topk_group": 1,
           "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def ling_tp_path(tmp_path_factory) -> str:
    from tests.speculative.conftest import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("fp8_tp"), "ling_tp", TP_LING)


@pytest.fixture(scope="module")
def models(ling_path):
    """The tiny Ling loaded once per mode (unquantised, fp8-experts, fp8), for the tests that only read the model."""
    cache = {}

    def get(quantization=None):
        if quantization not in cache:
            cache[quantization] = _engine(ling_path, quantization=quantization).model
        return cache[quantization]

    return get


def _engine(path: str, **kw) -> Engine:
    spec = kw.pop("spec", {})
    return Engine(ServerArgs(model_path=path, device="cpu", context_length=256,
                             spec=SpecConfig(**{"adaptive": False, **spec}), **kw))


def _dense(model) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and "lm_head" not in n}


def test_which_layers_are_fp8(ling_path, models):
    fp8 = models("fp8")
    dense = _dense(fp8)
    kinds = {n.rsplit(".", 1)[-1] for n in dense}
    assert {"in_proj", "o_proj", "dense", "gate_up_proj", "down_proj", "eh_proj", "kv_b_proj"} <= kinds
    for name, m in dense.items():
        want = not name.endswith("kv_b_proj")  # the absorbed MLA decode reads kv_b_proj per head: model dtype
        assert (m.weight.dtype == FP8_DTYPE) == want, name
        if want:
            assert m.weight_scale_inv.dtype == torch.float32, name
    assert any(n.startswith("mtp.") for n in dense)  # the MTP layer's projections too
    assert fp8.lm_head.weight.dtype == torch.float32 and fp8.model.word_embeddings.weight.dtype == torch.float32
    assert fp8.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router
    assert fp8.model.layers[1].mlp.experts.w13.dtype == FP8_DTYPE

    experts_only = models("fp8-experts")
    assert experts_only.model.layers[1].mlp.experts.w13.dtype == FP8_DTYPE
    assert all(m.weight.dtype == torch.float32 for m in _dense(experts_only).values())


def test_quantised_at_load_part_by_part(ling_path, models):
    """Each checkpoint tensor of a fused projection is block-quantised on its own (MLA in_proj: q_proj, then the
    576-wide-at-scale kv_a part and g_proj, which do not start on a block: the row -> scale-row map)."""
    model = models("fp8")
    tensors = load_file(os.path.join(ling_path, "model.safetensors"))
    params = dict(model.named_parameters())
    layout = hf_layout(model)
    for name in ("model.layers.2.attention.g_proj.weight", "model.layers.2.attention.kv_a_proj_with_mqa.weight",
                 "model.layers.0.attention.b_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight", f"model.layers.{TINY_LING['num_hidden_layers']}"
                 ".eh_proj.weight"):
        q, s = quantize_fp8_block(tensors[name])
        assert torch.equal(layout[name].view(params).view(torch.uint8), q.view(torch.uint8)), name
        torch.testing.assert_close(layout[name + "_scale_inv"].view(params), s)
    assert model.model.layers[2].attention.in_proj.weight_row_block is not None


def _logit_figures(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(),
            "rel_err": ((a - b).norm() / a.norm()).item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "logit_std": a.std().item()}


def test_logits_close_to_the_unquantised_model(ling_path, models):
    ref = models()
    experts = models("fp8-experts")
    fp8 = models("fp8")
    a, b, c = (full_logits(m, IDS) for m in (ref, experts, fp8))
    dense_fig, experts_fig = _logit_figures(a, c), _logit_figures(a, b)
    record_figure("fp8_dense_tiny_ling_logits", fp8=dense_fig, fp8_experts=experts_fig)
    print("fp8 (experts + dense) vs fp32:", json.dumps(dense_fig))
    print("fp8-experts vs fp32:", json.dumps(experts_fig))
    assert torch.isfinite(c).all()
    # A random 6-layer model amplifies any perturbation (its router flips experts): even fp8 experts alone move its
    # logits by a quarter. The figures are recorded; the bounds only catch a broken path.
    assert dense_fig["rel_err"] < 0.8 and dense_fig["top1_agreement"] >= 0.5
    assert dense_fig["rel_err"] > experts_fig["rel_err"]  # more weights rounded: more error, measured not assumed


def test_one_layer_is_close_to_the_unquantised_layer(ling_path, models):
    """What fp8 costs one layer (no amplification through depth): the attention of a KDA and an MLA layer and a
    dense MLP on the same input, about e4m3's 2-3% per weight through two projections."""
    from baton.layers.context import ModelRunner
    from baton.types import ForwardMode

    ref, fp8 = models(), models("fp8")
    x = torch.randn(7, TINY_LING["hidden_size"])
    errs = {}
    with torch.inference_mode():
        for i in (0, 2):  # KDA, MLA
            outs = []
            for m in (ref, fp8):
                runner = ModelRunner(m.make_cache(16, torch.float32, torch.device("cpu")), torch.device("cpu"))
                layer = m.model.layers[i]
                outs.append(layer.attention(x, runner.context(ForwardMode.PREFILL, 0, 7), norm=layer.input_layernorm))
            errs[f"layer{i}_attention"] = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
        a, b = ref.model.layers[0].mlp(x), fp8.model.layers[0].mlp(x)
        errs["layer0_dense_mlp"] = ((a - b).norm() / a.norm()).item()
    record_figure("fp8_dense_tiny_ling_layer_rel_err", **errs)
    print("one layer, fp8 vs fp32 (relative error):", json.dumps(errs))
    assert all(e < 0.08 for e in errs.values()), errs


def test_dummy_fp8_dense_is_the_fp32_dummy_quantised(ling_path):
    """Dummy fp8 dense weights are drawn as the fp32 model's (same generator) and quantised part by part."""
    cfg = load_model_config(ling_path)
    ref = build_model(cfg, "cpu", torch.float32)
    init_dummy_weights(ref, 3)
    apply_quantization(cfg, "fp8")
    fp8 = build_model(cfg, "cpu", torch.float32)
    init_dummy_weights(fp8, 3)
    params, ref_params = dict(fp8.named_parameters()), dict(ref.named_parameters())
    layout = hf_layout(fp8)
    for name in ("model.layers.2.attention.q_proj.weight", "model.layers.2.attention.g_proj.weight",
                 "model.layers.0.attention.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        q, s = quantize_fp8_block(hf_layout(ref)[name].view(ref_params))
        assert torch.equal(layout[name].view(params).view(torch.uint8), q.view(torch.uint8)), name
        torch.testing.assert_close(layout[name + "_scale_inv"].view(params), s)
    engine = _engine(ling_path, quantization="fp8", load_format="dummy")
    tokens, _ = run(engine, max_new_tokens=8)
    assert len(tokens) == 8


def test_fp8_dense_checkpoint_round_trip_and_experts_only(ling_path, tmp_path):
    fp8 = _engine(ling_path, quantization="fp8")
    out = str(tmp_path / "fp8_dense")
    cfg = json.loads(open(os.path.join(ling_path, "config.json")).read())
    save_hf_checkpoint(fp8.model, {**cfg, "quantization_config": fp8.model.config.quantization_config}, out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert tensors["model.layers.0.attention.o_proj.weight"].dtype == FP8_DTYPE
    assert tensors["model.layers.0.attention.o_proj.weight_scale_inv"].dtype == torch.float32
    assert tensors["model.layers.2.attention.kv_b_proj.weight"].dtype == torch.float32
    again = _engine(out)  # an fp8 checkpoint without --quantization: served as stored
    p1, p2 = dict(fp8.model.named_parameters()), dict(again.model.named_parameters())
    for name, slot in hf_layout(fp8.model).items():
        a, b = slot.view(p1), slot.view(p2)
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b), name
    torch.testing.assert_close(full_logits(again.model, IDS), full_logits(fp8.model, IDS))
    # the same checkpoint under fp8-experts: the dense tensors dequantised into fp32 layers, the same numbers
    experts = _engine(out, quantization="fp8-experts")
    assert experts.model.model.layers[0].attention.o_proj.weight.dtype == torch.float32
    torch.testing.assert_close(full_logits(experts.model, IDS), full_logits(fp8.model, IDS), rtol=1e-4, atol=1e-4)


def test_fp8_experts_only_spec_equals_plain(ling_path):
    """Greedy NEXTN == plain under fp8-experts (``--quantization fp8``, now experts + dense: tests/models/test_fp8.py
    ``test_fp8_spec_equals_plain``)."""
    plain, _ = run(_engine(ling_path, quantization="fp8-experts"))
    got, verify = run(_engine(ling_path, quantization="fp8-experts", spec={"algorithm": "NEXTN", "num_steps": 3}))
    assert got == plain and verify > 0


def test_layers_through_the_kernel_match_the_reference(models):
    """Every fp8 projection of the tiny Ling (its real fused weights, row maps, SwiGLU limits) through the Triton
    kernel in the interpreter against the module's CPU path (the reference), with the fusions the layers use."""
    ft = interpreted_module("baton.ops.fp8_linear.triton")
    model = models("fp8")
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for name, m in _dense(model).items():
        if m.weight.dtype != FP8_DTYPE:
            continue
        k, n = m.in_features, m.out_features
        x = torch.randn(6, k, generator=gen)
        nw = torch.rand(k, generator=gen) + 0.5
        if name.endswith("gate_up_proj"):
            want = m.linear_swiglu(x, nw, 1e-6, 5.0)
            got = ft.fp8_dense(x, m.weight, m.weight_scale_inv, m.weight_row_block, nw, 1e-6, None, True, 5.0,
                               pdl=False)
        else:
            res = torch.randn(6, n, generator=gen)
            want = m.linear(x, nw, 1e-6, res)
            got = ft.fp8_dense(x, m.weight, m.weight_scale_inv, m.weight_row_block, nw, 1e-6, res, pdl=False)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)
        got1 = ft.fp8_dense(x[:1], m.weight, m.weight_scale_inv, m.weight_row_block, pdl=False)
        torch.testing.assert_close(got1, m.linear(x[:1]), rtol=1e-4, atol=1e-4, msg=name)
        checked += 1
    assert checked >= 10


def test_tp2_rank_slices_quantised_on_their_own(ling_tp_path):
    """Two ranks (built in one process) load the bf16 checkpoint under fp8: each rank's fp8 part is its block of
    the checkpoint tensor quantised on its own (the tiny shards are not 128-aligned), and an fp8-dense checkpoint
    loads at TP2 too (unaligned parts dequantised and quantised again, aligned ones copied)."""
    tensors = load_file(os.path.join(ling_tp_path, "model.safetensors"))
    cfg = load_model_config(ling_tp_path)
    apply_quantization(cfg, "fp8")
    rows = TINY_LING["num_attention_heads"] * TINY_LING["head_dim"]
    for rank in range(2):
        with dist.layout_context(rank, 2):
            model = build_model(cfg, "cpu", torch.float32)
            load_safetensors(model, ling_tp_path)
            layout = hf_layout(model)
        params = dict(model.named_parameters())
        for name, dim in (("model.layers.0.attention.q_proj.weight", 0), ("model.layers.0.attention.o_proj.weight", 1),
                          ("model.layers.0.mlp.down_proj.weight", 1), ("model.layers.2.attention.g_proj.weight", 0)):
            full = tensors[name]
            n = full.shape[dim] // 2
            q, s = quantize_fp8_block(full.narrow(dim, rank * n, n))
            assert torch.equal(layout[name].view(params).view(torch.uint8), q.view(torch.uint8)), (rank, name)
            torch.testing.assert_close(layout[name + "_scale_inv"].view(params), s)
        assert model.model.layers[0].attention.in_proj.weight.shape[0] < 5 * rows  # this rank's rows only


def test_tp2_fp8_checkpoint_loads(ling_tp_path, tmp_path):
    fp8 = _engine(ling_tp_path, quantization="fp8")
    out = str(tmp_path / "fp8_dense_tp")
    cfg = json.loads(open(os.path.join(ling_tp_path, "config.json")).read())
    save_hf_checkpoint(fp8.model, {**cfg, "quantization_config": fp8.model.config.quantization_config}, out)
    with dist.layout_context(1, 2):
        model = build_model(load_model_config(out), "cpu", torch.float32)
        load_safetensors(model, out)
    w = model.model.layers[0].attention.o_proj
    assert w.weight.dtype == FP8_DTYPE and torch.isfinite(w.weight_scale_inv).all()


def test_tp2_dummy_fp8_dense(ling_tp_path):
    """Tensor-parallel dummy fp8 dense weights: each rank's part of the single-rank fp32 draw, quantised on its own."""
    cfg = load_model_config(ling_tp_path)
    apply_quantization(cfg, "fp8")
    ref_cfg = load_model_config(ling_tp_path)
    ref = build_model(ref_cfg, "cpu", torch.float32)
    init_dummy_weights(ref, 0)
    ref_params, ref_layout = dict(ref.named_parameters()), hf_layout(ref)
    with dist.layout_context(1, 2):
        model = build_model(cfg, "cpu", torch.float32)
        init_dummy(model, cfg, 0, torch.float32)
        layout = hf_layout(model)
    params = dict(model.named_parameters())
    name = "model.layers.0.attention.o_proj.weight"
    full = ref_layout[name].view(ref_params)
    n = full.shape[1] // 2
    q, _ = quantize_fp8_block(full[:, n:])
    assert torch.equal(layout[name].view(params).view(torch.uint8), q.view(torch.uint8))


def _ranks_dequantised_checkpoint(path: str, out: str) -> None:
    """The fp32 checkpoint of what two fp8 ranks hold after loading ``path`` under --quantization fp8: each rank's
    parts dequantised and put back where its slots say."""
    from safetensors.torch import save_file

    from baton.ops.quant import dequantize_fp8_block

    cfg = load_model_config(path)
    apply_quantization(cfg, "fp8")
    full = {n: t.clone() for n, t in load_file(os.path.join(path, "model.safetensors")).items()}
    for rank in range(2):
        with dist.layout_context(rank, 2):
            model = build_model(cfg, "cpu", torch.float32)
            load_safetensors(model, path)
            layout = hf_layout(model)
        params = dict(model.named_parameters())
        for name, slot in layout.items():
            if name.endswith("_scale_inv"):
                continue
            t = slot.view(params)
            if t.dtype == FP8_DTYPE:
                t = dequantize_fp8_block(t, layout[name + "_scale_inv"].view(params), torch.float32)
            if slot.src is None:
                full[name] = t.clone()
            else:
                dim, start, stop, _ = slot.src
                full[name].narrow(dim, start, stop - start).copy_(t)
    os.makedirs(out)
    save_file(full, os.path.join(out, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(out, "config.json"), "w") as g:
        g.write(f.read())


def test_tp2_gloo_fp8_dense(ling_tp_path, tmp_path):
    """Two gloo ranks with fp8 dense weights (loaded from the bf16 checkpoint, each rank's parts quantised on its
    own) give exactly the greedy tokens of one fp32 rank holding the weights they hold, dequantised; NEXTN too."""
    from baton.engine.tp import run_tp
    from tests.dist.ranks import generate_all

    ref_path = str(tmp_path / "ranks_fp32")
    _ranks_dequantised_checkpoint(ling_tp_path, ref_path)
    requests = [(list(PROMPT), dict(temperature=0.0, max_new_tokens=16, ignore_eos=True))]
    for spec in ({}, {"algorithm": "NEXTN", "num_steps": 2}):
        args = ServerArgs(model_path=ling_tp_path, device="cpu", context_length=256, tp_size=2, quantization="fp8",
                          spec=SpecConfig(**{"adaptive": False, **spec}))
        got = run_tp(args, generate_all, ([(list(i), dict(k)) for i, k in requests],), rank0_in_caller=False,
                     timeout_s=120)
        want = generate_all(_engine(ref_path, spec=spec), [(list(i), dict(k)) for i, k in requests])
        assert got[0][0] == want[0][0] and len(got[0][0]) == 16, spec


def test_census_counts_fp8_dense_bytes(ling_path):
    """``baton census``'s bytes (what the floor divides): fp8 dense weights count one byte each plus their fp32
    scales, in the target's dense bytes and in the NEXTN head's; the floor falls by what the quantisation saves."""
    from baton.bench.census import draft_head_bytes, step_bytes

    spec = {"algorithm": "NEXTN", "num_steps": 3}
    # the shared expert a dense MLP in both (fused under fp8, its bytes would move to the experts': the census
    # test in tests/models/test_shared_fusion.py checks that the total stays)
    ref = _engine(ling_path, quantization="fp8-experts", spec=spec)
    fp8 = _engine(ling_path, quantization="fp8", spec=spec, disable_shared_experts_fusion=True)
    a, b = step_bytes(ref, 100, 4, 0.0), step_bytes(fp8, 100, 4, 0.0)
    saved = {True: 0, False: 0}  # bytes saved in the target's layers / the MTP head
    refs = dict(_dense(ref.model))
    for name, m in _dense(fp8.model).items():
        if m.weight.dtype == FP8_DTYPE:
            saved[name.startswith("mtp.")] += refs[name].weight.nbytes - m.weight.nbytes - m.weight_scale_inv.nbytes
    assert saved[False] > 0 and saved[True] > 0
    assert a["dense_weights"] - b["dense_weights"] == saved[False]
    assert draft_head_bytes(ref.drafter.head) - draft_head_bytes(fp8.drafter.head) == saved[True]
    assert b["total"] < a["total"]


# ---- on the GPU (bf16, the Triton kernels): run later on an H200 by benchmarks/gpu_fp8_dense.sh ----


@pytest.mark.gpu
def test_gpu_fp8_dense_projections_of_a_loaded_model(ling_path):
    """Every fp8 projection of the tiny Ling loaded on CUDA in bf16: the dispatch (the Triton kernel at 1, 6 and 17
    rows, the dequantise-then-cuBLAS path at 40) against the fp32 reference on the same fp8 weights."""
    from baton.ops.fp8_linear import naive as ref

    model = Engine(ServerArgs(model_path=ling_path, device="cuda", dtype="bfloat16", context_length=256,
                              quantization="fp8", disable_cuda_graph=True)).model
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, m in _dense(model).items():
        if m.weight.dtype != FP8_DTYPE:
            continue
        for rows in (1, 6, 17, 40):
            x = torch.randn(rows, m.in_features, device="cuda", generator=gen).bfloat16()
            nw = (torch.rand(m.in_features, device="cuda", generator=gen) + 0.5).bfloat16()
            if name.endswith("gate_up_proj"):
                got = m.linear_swiglu(x, nw, 1e-6, 5.0)
                want = ref.fp8_dense_linear_swiglu(x.float(), m.weight, m.weight_scale_inv, m.weight_row_block,
                                                   nw.float(), 1e-6, 5.0)
            else:
                res = torch.randn(rows, m.out_features, device="cuda", generator=gen).bfloat16()
                got = m.linear(x, nw, 1e-6, res)
                want = ref.fp8_dense_linear(x.float(), m.weight, m.weight_scale_inv, m.weight_row_block, nw.float(),
                                            1e-6, res.float())
            err = ((got.float() - want).norm() / want.norm()).item()
            assert got.dtype == torch.bfloat16 and err < 1e-2, (name, rows, err)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["fp8", "fp8-experts"])
def test_gpu_fp8_engine_runs_with_cuda_graphs(ling_path, quantization):
    """The tiny Ling on CUDA (bf16, CUDA graphs) under both modes, plain and NEXTN: tokens come out, and the first
    greedy token of the fp8 model matches its eager run's."""
    def engine(**kw):
        return Engine(ServerArgs(model_path=ling_path, device="cuda", dtype="bfloat16", context_length=256,
                                 quantization=quantization, **kw))

    graphs, _ = run(engine(), max_new_tokens=16)
    eager, _ = run(engine(disable_cuda_graph=True), max_new_tokens=16)
    spec, verify = run(engine(spec=SpecConfig(algorithm="NEXTN", num_steps=3)), max_new_tokens=16)
    assert len(graphs) == len(spec) == 16 and verify > 0
    assert graphs[0] == eager[0]
    record_figure("fp8_dense_gpu_engine", quantization=quantization, graphs_equal_eager=graphs == eager,
                  spec_equal_plain=spec == graphs)


def test_fake_quantize_dense_fp8_rounds_every_dense_matrix_once():
    """The CPU emulation of an fp8 dense target for a model without fp8 layers (the embedded SmolLM2, a llama): every
    checkpoint matrix of its attention and MLP rounded through e4m3 in place (the fused q/k/v each on its own), the
    embeddings / tied lm_head left alone; rounding twice changes nothing."""
    from baton.layers.fake_quant import fake_quantize_dense_fp8
    from baton.ops.quant import dequantize_fp8_block
    from tests.conftest import TINY_LLAMA
    from tests.helpers import tiny_model

    model = tiny_model(TINY_LLAMA)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert fake_quantize_dense_fp8(model) == 7 * TINY_LLAMA["num_hidden_layers"]
    layout, params = hf_layout(model), dict(model.named_parameters())
    q_name = "model.layers.1.self_attn.k_proj.weight"
    want = before[layout[q_name].param][layout[q_name].rows[0] : layout[q_name].rows[1]]
    torch.testing.assert_close(layout[q_name].view(params), dequantize_fp8_block(*quantize_fp8_block(want),
                                                                                 torch.float32))
    assert torch.equal(params["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    fake_quantize_dense_fp8(model)
    assert all(torch.equal(p, after[n]) for n, p in model.named_parameters())


def test_fp8_activation_scheme_dynamic_is_w8a8_everywhere(ling_path, models):
    """--fp8-activation-scheme dynamic: every fp8 projection and expert stack multiplies with e4m3 activations
    (the reference here, the same arithmetic as the kernels); the logits move a little from w8a16's, measured."""
    from baton.layers.moe import Experts

    w8a8 = _engine(ling_path, quantization="fp8", fp8_activation_scheme="dynamic").model
    fp8 = [m for m in w8a8.modules() if isinstance(m, Linear | Experts) and m.fp8]
    assert fp8 and all(m.act_fp8 for m in fp8)
    assert not any(m.act_fp8 for m in models("fp8").modules() if isinstance(m, Linear | Experts))
    ref, w8a16 = full_logits(models(), IDS), full_logits(models("fp8"), IDS)
    got = full_logits(w8a8, IDS)
    fig, base = _logit_figures(ref, got), _logit_figures(ref, w8a16)
    record_figure("fp8_w8a8_tiny_ling_logits", w8a8=fig, w8a16=base, w8a8_vs_w8a16=_logit_figures(w8a16, got))
    assert torch.isfinite(got).all() and not torch.equal(got, w8a16)
    assert fig["rel_err"] < 0.8 and fig["top1_agreement"] >= 0.5


def test_fp8_w8a8_spec_equals_plain(ling_path):
    """The greedy speculative invariant holds under w8a8 too (the verify's rows are quantised row by row)."""
    kw = dict(quantization="fp8", fp8_activation_scheme="dynamic")
    plain, _ = run(_engine(ling_path, **kw))
    got, verify = run(_engine(ling_path, spec={"algorithm": "NEXTN", "num_steps": 3}, **kw))
    assert got == plain and verify > 0


def test_fp8_activation_scheme_follows_the_checkpoint_unless_given(ling_path):
    from baton.config import ConfigError

    cfg = load_model_config(ling_path)
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    apply_quantization(cfg, None)
    assert cfg.fp8_activations  # an fp8 checkpoint's own setting
    apply_quantization(cfg, None, "none")
    assert not cfg.fp8_activations
    cfg = load_model_config(ling_path)
    apply_quantization(cfg, "fp8")
    assert cfg.fp8_dense and not cfg.fp8_activations  # at-load quantisation: the default, weight-only
    apply_quantization(cfg, "fp8", "dynamic")
    assert cfg.fp8_activations
    with pytest.raises(ConfigError, match="fp8-activation-scheme"):
        apply_quantization(cfg, "fp8", "static")


def test_fake_quantize_activations_fp8_rounds_every_projection_input():
    """The CPU emulation of w8a8 for models without fp8 layers: each projection sees its input (after the fused
    RMSNorm) rounded through e4m3 per row and 128 columns, exactly as the w8a8 reference does."""
    from baton.layers.fake_quant import fake_quantize_activations_fp8
    from baton.ops.linear import naive as dense
    from baton.ops.quant.fp8 import dequantize_act_e4m3, quantize_act_e4m3
    from baton.ops.rmsnorm.naive import rms_norm

    torch.manual_seed(0)
    m = Linear(200, 24, dtype=torch.float32)
    torch.nn.init.normal_(m.weight)
    holder = torch.nn.ModuleDict({"proj": m})
    x, norm = torch.randn(3, 200), torch.rand(200) + 0.5
    plain = m.linear(x, norm, 1e-6)
    assert fake_quantize_activations_fp8(holder) == 1
    got = m.linear(x, norm, 1e-6)
    h = rms_norm(x, norm, 1e-6)
    want = dequantize_act_e4m3(*quantize_act_e4m3(h)) @ m.weight.t()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain, rtol=1e-4, atol=1e-4)
    swi = m.linear_swiglu(x, norm, 1e-6)
    assert torch.allclose(swi, dense.swiglu(want, 0.0), rtol=1e-5, atol=1e-5)


def test_tp2_gloo_w8a8_spec_equals_plain(ling_tp_path):
    """w8a8 (--fp8-activation-scheme dynamic) on two gloo ranks: each rank quantises the rows of its own shards
    (column-parallel inputs whole, row-parallel inputs per local K slice), and greedy NEXTN equals plain."""
    from baton.engine.tp import run_tp
    from tests.dist.ranks import generate_all

    requests = [(list(PROMPT), dict(temperature=0.0, max_new_tokens=12, ignore_eos=True))]
    out = []
    for spec in ({}, {"algorithm": "NEXTN", "num_steps": 2}):
        args = ServerArgs(model_path=ling_tp_path, device="cpu", context_length=256, tp_size=2, quantization="fp8",
                          fp8_activation_scheme="dynamic", spec=SpecConfig(**{"adaptive": False, **spec}))
        out.append(run_tp(args, generate_all, ([(list(i), dict(k)) for i, k in requests],), rank0_in_caller=False,
                          timeout_s=120)[0][0])
    assert out[0] == out[1] and len(out[0]) == 12
