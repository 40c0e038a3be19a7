"""The census's time attribution (pure functions; the GPU census itself runs on the H200 only)."""

import pytest

from baton.bench.census import attribute, classify, exclusive_times


def test_exclusive_times_give_an_overlap_to_the_kernel_that_started_first():
    # A runs 0-10; B (PDL: launched at 4, waits for A) ends at 14; C alone 20-25; D inside C
    shares = exclusive_times([(0, 10), (4, 14), (20, 25), (21, 22)])
    assert shares == [10, 4, 5, 0]


def test_exclusive_times_ignore_input_order_and_add_up_to_the_union():
    intervals = [(5, 9), (0, 3), (2, 6), (12, 13)]
    shares = exclusive_times(intervals)
    assert shares == [3, 3, 3, 1]
    assert sum(shares) == 10  # union: [0, 9] and [12, 13]


def test_attribute_splits_a_pdl_chain_by_category_and_counts_idle():
    # two steps of: gemv 0-10, moe kernel launched at 2 (waits) ending at 30, gap, attention 35-40
    step = [("gemv_kernel", 0, 10), ("fused_moe_fp8", 2, 30), ("flash_decode", 35, 40)]
    kernels = step + [(n, s + 100, e + 100) for n, s, e in step]
    att = attribute(kernels, num_steps=2)
    assert att["per_cat"]["dense GEMM"] == pytest.approx(10)
    assert att["per_cat"]["MoE GEMM"] == pytest.approx(20)  # not its raw 28
    assert att["inclusive"]["MoE GEMM"] == pytest.approx(28)
    assert att["per_cat"]["attention"] == pytest.approx(5)
    span = att["span"]  # 0 .. 140 over 2 steps
    assert span == pytest.approx(70)
    busy = sum(v for k, v in att["per_cat"].items() if k != "idle")
    assert busy + att["per_cat"]["idle"] == pytest.approx(span)
    assert att["top_kernels"][0] == ("fused_moe_fp8", 20)


def test_attribute_counts_launches_per_step_by_category_and_name():
    step = [("gemv_kernel", 0, 10), ("gemv_kernel", 10, 12), ("fused_moe_fp8", 12, 30), ("copy", 30, 31)]
    kernels = step + [(n, s + 100, e + 100) for n, s, e in step]
    att = attribute(kernels, num_steps=2)
    assert att["count_by_category"] == {"dense GEMM": 2, "MoE GEMM": 1, "router / activation / glue": 1}
    assert att["most_launched"][0] == ("gemv_kernel", 2, 12)
    assert sum(n for _, n, _ in att["most_launched"]) == 4


def test_classify_names():
    assert classify("ncclDevKernel_AllReduce") == "all-reduce"
    assert classify("fused_moe_direct_kernel") == "MoE GEMM"
    assert classify("linear_kernel") == "dense GEMM"
    assert classify("elementwise_kernel") == "router / activation / glue"


def test_plot_census_reads_bench_results_and_draws_one_bar_per_mode(tmp_path):
    from pathlib import Path

    from benchmarks.plot_census import load_bars, main

    d = Path(__file__).resolve().parents[2] / "benchmarks/results/h200-2026-11-30c/d"
    files = [str(d / "ling_flash_42l_tp2_plain.json"), str(d / "ling_flash_42l_fp8_tp2.json")]
    bars = load_bars(files)
    assert [b["label"] for b in bars] == ["bf16 plain", "fp8 plain", "fp8 nextn"]
    assert bars[0]["census"]["dense GEMM"] == pytest.approx(1814.55) and bars[0]["floor_ms"] > 1.0
    out = tmp_path / "census.png"
    main([*files, "--output", str(out)])
    assert out.stat().st_size > 10_000


def test_step_bytes_count_a_block_drafter(tmp_path):
    """The floor of a DSpark step includes the drafter: its weights, its context cache and one lm_head pass (the
    census of 2026-11-30 printed the plain step's floor for it)."""
    from baton.bench.census import block_draft_bytes, step_bytes
    from baton.config import load_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft
    from tests.conftest import TINY_LLAMA
    from tests.speculative.conftest import make_engine, write_checkpoint

    target = write_checkpoint(tmp_path, "llama", TINY_LLAMA)
    draft = str(tmp_path / "draft")
    write_random_dspark_draft(load_model_config(target), draft, block_size=4, markov_rank=8)
    plain = step_bytes(make_engine(target), 100, 1, 0.0)
    engine = make_engine(target, algorithm="DSPARK", draft_model_path=draft)
    spec = step_bytes(engine, 100, engine.num_draft_tokens, 0.0)
    lm_head = engine.model.lm_head_weight.nbytes
    weights = sum(p.nbytes for n, p in engine.drafter.model.named_parameters() if "embed" not in n)
    assert spec["draft"] == pytest.approx(block_draft_bytes(engine.drafter, 100, lm_head))
    assert spec["draft"] > weights + lm_head  # and the context cache on top
    assert spec["total"] == pytest.approx(sum(v for k, v in spec.items() if k != "total"))
    assert spec["total"] > plain["total"] + weights


def test_step_bytes_count_the_fp8_draft_lm_head(tmp_path):
    """Under --enable-fp8-draft-lm-head a draft step's lm_head pass reads the fp8 copy (1 byte a weight and the
    scales), not the model's lm_head."""
    from baton.bench.census import draft_head_bytes, step_bytes
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine
    from tests.conftest import TINY_LING
    from tests.speculative.conftest import write_checkpoint

    target = write_checkpoint(tmp_path, "ling", TINY_LING)

    def engine(fp8_head: bool) -> Engine:
        return Engine(ServerArgs(model_path=target, device="cpu", context_length=256,
                                 enable_fp8_draft_lm_head=fp8_head, spec=SpecConfig(algorithm="NEXTN", num_steps=3)))

    bf16, fp8 = engine(False), engine(True)
    head = draft_head_bytes(bf16.drafter.head)
    q, s = fp8.model.draft_lm_head_fp8
    assert step_bytes(bf16, 100, 4, 0.0)["draft"] == pytest.approx(3 * (head + bf16.model.lm_head_weight.nbytes))
    assert step_bytes(fp8, 100, 4, 0.0)["draft"] == pytest.approx(3 * (head + q.nbytes + s.nbytes))


def test_prefill_census_runs_on_the_cpu_and_never_hits_the_prefix_cache(tmp_path):
    """`baton census --prefill` on the CPU: the median prefill time and the host's top ops (no kernel trace there);
    every timed prefill starts from a flushed cache, so none is a prefix-cache hit."""
    from baton.bench.census import format_prefill_census, run_prefill_census
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine
    from tests.conftest import TINY_LLAMA
    from tests.speculative.conftest import write_checkpoint

    path = write_checkpoint(tmp_path, "llama", TINY_LLAMA)
    engine = Engine(ServerArgs(model_path=path, device="cpu", context_length=128, spec=SpecConfig(adaptive=False)))
    result = run_prefill_census(engine, input_len=40, repeats=2)
    assert result["prefill_ms"] > 0 and len(result["prefill_ms_runs"]) == 2
    assert result["host_top_ops_ms"] and "census_us" not in result
    assert engine.last_cached_tokens == 0
    assert "prefill of 40 tokens" in format_prefill_census(result)
