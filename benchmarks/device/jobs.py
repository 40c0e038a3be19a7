"""The jobs a device session can run: one entry per measurement or test run, read by ``benchmarks.device.run``.

A job is a name, one line saying what it measures, the shell commands it runs (in the repository root, in order,
each in ``bash``), the GPUs it needs, its time limit, what it needs carried (``NEEDS``) and the files it leaves in
its result folder ``$R``. The runner gives every command ``R`` (the job's result folder, also exported as ``OUT``,
where ``benchmarks.common.save`` writes its JSON), ``TMP`` (the device machine's scratch folder, /tmp),
``BATON_COMMIT``, ``CUDA_VISIBLE_DEVICES`` (the job's GPUs) and the job's ``env``. It stops a job at its limit with
``stop_signal`` (SIGINT: pytest then prints its failures; SIGABRT for the TP benches: PYTHONFAULTHANDLER dumps the
ranks' Python stacks), then SIGKILL after ``grace_s``. A ``background`` job runs on in its own process session
and copy of the tree past the call that started it (training outlasts one 600 s call); the same job named in the
next call, within the ~30 s the machine stays warm, waits for it and returns what it has so far. ``outputs`` are
globs under ``$R`` (or absolute, under ``{tmp}``): they, every ``*.log`` in ``$R`` and the runner's own files
(command.txt, commit.txt, gpu.txt, log.txt, job.json) come back in ``<job>.tgz``; a missing output is noted in
job.json.

How this list came from benchmarks/device_session.sh (17 single-letter phases, removed with device_run.sh,
gpu_one_program_ab.sh and gpu_fp8_dense.sh):

- a, b, e, g, n (kernel, attention, graph and sampled-graph tests; SmolLM2 censuses; Ling benches) ->
  gpu-tests, graph-tests, census-smollm2, smollm2-decode, ling18-nextn, ling-flash-fp8, ling-flash-tp2,
  ling-flash-fp8-tp2. Dropped: the census variants with BATON_FUSED_ATTENTION on and off (one A/B of 2026-11-30;
  smollm2-decode keeps the fused-attention A/B in one run) and phase g's "exclusive" censuses (now the census's
  only attribution: census-smollm2 is the same command).
- d -> tp2-tests, allreduce-bench, ling-flash-tp2, ling-flash-fp8-tp2.  s -> serve-bench-tp2.
- m, t, n's and c's tunes, f, f1 -> linear-tune-ling, linear-tune-smol, linear-tune-tp2, moe-tile-sweep,
  moe-tile-sweep-tp2, op-benches. Dropped: each phase's subset of shapes and M (C_TUNE, TUNE_S, --m 9 alone):
  the three tune jobs cover the M each model's steps use (Ling 1, 6; SmolLM2 1, 4, 6, 9); and ``merge_table``
  into the running copy: a tune (linear or MoE) now returns the committed table with its winners merged in, to be
  committed, and the benches after it read the committed one.
- c's fp8 work (C_FP8=tp2|one) -> ling-flash-fp8, ling-flash-fp8-tp2, fp8-dense. Dropped: the BATON_FP8_ALIGNED=0
  fallback when the (then new) aligned fp8 kernels failed their tests, the fp8 lm_head tile sweep (its tile is
  chosen) and the bf16-draft-head A/B (the fp8 draft head is measured by ling-flash-fp8).
- r, w -> train-drafts (baton/train/recipe_smollm2.sh in the background) and tp2-tests. Dropped: the TF32 A/B
  of DSpark's step (answered: 0.312 s/step with TF32, 0.377 without; TF32 stays on, docs/performance.md), and
  phase r's linear tune on the GPU the data generation left free (the linear-tune-* jobs).
- x, y -> train-dspark-more (benchmarks/train_more_dspark.sh in the background: MODE=dp NEW_DATA=1, the run the
  shipped drafter came from). Dropped: the A/Bs of async host-to-device copies (ASYNC_AB: no gain) and
  --batched-loss (BATCHED_AB: 0.255 against 0.259 s/step) and the one-GPU profile (PROFILE): each answered once;
  the job's env sets the script's switches (MODE, A_INIT, TRAIN_BUDGET ...) for another run.
- the GGUF in three parts (.carry0/1/2), GSM8K split over two calls, traindata.tgz -> benchmarks/device/parts.py
  and ``needs`` (gguf, gsm8k, traindata).
- device_run.sh (tests, linear bench, SmolLM2 and Ling 18) -> gpu-tests, op-benches, smollm2-decode,
  ling18-nextn. gpu_one_program_ab.sh -> ab-smollm2, ab-ling18 (its GPU tests of the new tree are graph-tests;
  its in-run HF peer is smollm2-decode-dummy). gpu_fp8_dense.sh -> fp8-dense, ling-flash-fp8-dense,
  ling-flash-fp8.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["JOBS", "NEEDS", "Job", "Need"]


@dataclass(frozen=True)
class Need:
    """Something a job needs that does not travel with the tree: it is there when every path exists (``{tmp}``:
    the device's scratch folder; relative paths: under the repository root); ``how`` says how to send it."""

    paths: tuple[str, ...]
    how: str


NEEDS = {
    "gguf": Need(("{tmp}/SmolLM2-135M-Instruct.Q4_1.gguf",),
                 "the embedded SmolLM2 GGUF (98 MB), rebuilt from parts: here `python -m benchmarks.device.parts "
                 "split`, then carry .carry/part0, .carry/part1, ... one per call, in any order"),
    "gsm8k": Need(("{tmp}/gsm8k/test.jsonl", "{tmp}/gsm8k/train.jsonl"),
                  "GSM8K: here `python -m benchmarks.device.parts add ../shared/data/gsm8k`, then carry .carry/data"),
    "traindata": Need(("{tmp}/traindata.tgz",),
                      "an earlier session's training data (data/gsm8k.jsonl and data/gsm8k.holdout.jsonl in a "
                      "traindata.tgz): `python -m benchmarks.device.parts add traindata.tgz`, carry .carry/data"),
    "ab-trees": Need((".old/commit.txt", ".new/commit.txt"),
                     "the two trees of an A/B: here `python -m benchmarks.device.parts trees OLD NEW`, then carry "
                     ".old and .new"),
}


@dataclass(frozen=True)
class Job:
    name: str
    about: str
    commands: tuple[str, ...]
    gpus: int = 1
    limit_s: int = 300
    needs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    stop_signal: str = "INT"
    grace_s: int = 20
    background: bool = False


# --- pieces several jobs share -----------------------------------------------------------------------------
PYTEST = "python3 -m pytest -q -p no:cacheprovider -rfEs"
SMOL_CONFIG = "benchmarks/configs/smollm2-135m-instruct"
DRAFTS = "baton/drafts/smollm2-135m-instruct"
TP_ENV = {"PYTHONFAULTHANDLER": "1", "BATON_TP_TIMEOUT": "120"}  # a hung rank fails in 120 s, with its stacks
TABLE = "baton/ops/linear/tuned/nvidia-h200.json"
MOE_TABLE = "baton/ops/moe/tuned/nvidia-h200.json"


def census(alg: str) -> str:
    """One census of a SmolLM2 step on dummy weights at its config (a replay's time does not depend on the
    weights' values); speculation at the GSM8K accept lengths, simulated: none, NEXTN (the shipped head, 3 steps)
    or DSPARK (the shipped drafter, gamma 8)."""
    spec = {"none": "--speculative-algorithm none",
            "NEXTN": f"--speculative-algorithm NEXTN --speculative-draft-model-path {DRAFTS}/nextn "
                     "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "
                     "--speculative-simulate-accept-len 2.97",
            "DSPARK": f"--speculative-algorithm DSPARK --speculative-draft-model-path {DRAFTS}/dspark "
                      "--speculative-num-draft-tokens 9 --speculative-simulate-accept-len 2.90"}[alg]
    return (f"python3 -m baton census --model-path {SMOL_CONFIG} --load-format dummy {spec} --input-len 512 "
            f"--num-steps 200 --output-file $R/census_smollm2_{alg}.jsonl")


def ling(layers: int, *flags: str) -> str:
    """benchmarks/bench_ling_flash.py: Ling-3.0-flash's shapes on dummy weights, 8192 in / 1024 out, one request."""
    return " ".join(["python3 -m benchmarks.bench_ling_flash", f"--num-layers {layers}", "--num-requests 1", *flags])


def tune(flags: str) -> str:
    """The linear kernels' config sweep; the winners merge into $R/nvidia-h200.json (a copy of the committed
    table, made by the job's first command): commit it as baton/ops/linear/tuned/nvidia-h200.json."""
    return (f"python3 -m benchmarks.ops.bench_linear --tune {flags} --json $R/tune.json "
            "--write-table $R/nvidia-h200.json")


SMOL_AB = f"--model-path {SMOL_CONFIG} --load-format dummy --input-len 512 --output-len 256"
FOLD_SHAPES = "kda_in_proj o_proj shared_gate_up shared_down dense_gate_up dense_down eh_proj"
MOE_SWEEP = "python3 -m benchmarks.ops.bench_moe --fp8 --sweep --tokens 1 6 --routes uniform --no-torch"

JOBS: list[Job] = [
    # --- tests ---------------------------------------------------------------------------------------------
    Job("gpu-tests", "every GPU test of the kernels, models and training on one GPU (graphs and TP2: own jobs)",
        commands=(f"{PYTEST} -m gpu tests --ignore=tests/engine --ignore=tests/dist --durations=10 "
                  "--junitxml=$R/junit.xml",),
        gpus=1, limit_s=480, env={"BATON_TEST_REPORT": "$R/figures.jsonl"}, outputs=("junit.xml", "figures.jsonl")),
    Job("graph-tests", "captured step programs == uncaptured (plain, NEXTN, DSpark, sampled); the embedded-GGUF "
                       "test runs when the GGUF is here",
        commands=(f"{PYTEST} -m gpu tests/engine --durations=10 --junitxml=$R/junit.xml",),
        gpus=1, limit_s=480, outputs=("junit.xml",)),
    Job("tp2-tests", "tensor parallelism on two GPUs: one-shot all-reduce == NCCL, TP2 engine == TP1 tokens",
        commands=(f"{PYTEST} -m gpu tests/dist/test_tp_gpu.py --durations=0 --junitxml=$R/junit.xml",),
        gpus=2, limit_s=450, env={**TP_ENV, "BATON_TEST_REPORT": "$R/figures.jsonl"},
        outputs=("junit.xml", "figures.jsonl")),
    Job("fp8-dense", "fp8 dense projections: their GPU tests, then the kernel at every Ling dense decode shape "
                     "(M = 1, 6, 17) against bf16 and the floor",
        commands=(f"{PYTEST} -m gpu tests/ops/test_fp8_dense.py tests/ops/test_fp8_linear.py "
                  "tests/models/test_fp8_dense.py --junitxml=$R/junit.xml",
                  "python3 -m benchmarks.ops.bench_fp8_linear --dense --rows 1 6 17 --json $R/fp8_dense_linear.json"),
        gpus=1, limit_s=330, env={"BATON_TEST_REPORT": "$R/figures.jsonl"},
        outputs=("junit.xml", "figures.jsonl", "fp8_dense_linear.json")),
    Job("per-row-smol", "issue 25's verify cost, issue 22 item 6: the per-row form (a verify's few rows as the GEMV "
                        "form row by row) in the tune; SmolLM2 step censuses with this GPU's table as it was, its "
                        "shapes tuned and written into this GPU's table, the censuses again, then the per-row kernel "
                        "tests compiled",
        commands=("mkdir -p $R/before && cp baton/ops/linear/tuned/*.json $R/before/",
                  *(census(alg).replace("census_smollm2_", "census_before_") for alg in ("none", "NEXTN", "DSPARK")),
                  "set -o pipefail; python3 benchmarks/bench_decode_gemm.py --tune --per-row --write-table --dtypes "
                  "bf16 --shapes smol_qkv smol_o smol_gate_up smol_down smol_lm_head --m 1 2 4 6 9 17 --impls baton "
                  "cublas --bandwidth measure --budget-s 90 --workers 14 --json $R/decode_gemm_smol.json 2>&1 "
                  "| tee $R/bench_smol.log",
                  "mkdir -p $R/tables && cp baton/ops/linear/tuned/*.json $R/tables/",
                  *(census(alg).replace("census_smollm2_", "census_after_") for alg in ("none", "NEXTN", "DSPARK")),
                  f"set -o pipefail; {PYTEST} -n 12 tests/ops/test_linear_per_row.py --junitxml=$R/junit_per_row.xml "
                  "2>&1 | tee $R/tests_per_row.log"),
        gpus=1, limit_s=380, outputs=("decode_gemm_smol.json", "census_*.jsonl", "tables", "before", "junit_*.xml")),
    Job("per-row-ling", "issue 22 items 2 and 6: the Ling dense shapes (bf16, w8a16) tuned with per-row candidates and "
                        "written into this GPU's tables; the tables as they were and after come back",
        commands=("mkdir -p $R/before && cp baton/ops/linear/tuned/*.json $R/before/ && for f in "
                  "baton/ops/fp8_linear/tuned/*.json; do cp $f $R/before/fp8-$(basename $f); done",
                  "set -o pipefail; python3 benchmarks/bench_decode_gemm.py --tune --per-row --write-table --dtypes "
                  "bf16 fp8 --shapes kda_in_proj o_proj dense_down shared_gate_up eh_proj --m 1 6 17 --impls baton "
                  "cublas --bandwidth measure --budget-s 90 --workers 14 --json $R/decode_gemm_ling.json 2>&1 "
                  "| tee $R/bench_ling.log",
                  "mkdir -p $R/tables && cp baton/ops/linear/tuned/*.json $R/tables/ && for f in "
                  "baton/ops/fp8_linear/tuned/*.json; do cp $f $R/tables/fp8-$(basename $f); done"),
        gpus=1, limit_s=240, outputs=("decode_gemm_ling.json", "tables", "before")),
    Job("fold-ling", "issue 22 item 2: w8a16 with the fp8 block scales folded into the rows (LinearConfig.fold: the "
                     "fp16 MMA accumulates in place, no wait on each chunk's product); its kernel tests compiled, "
                     "the fp8 Ling dense shapes with the table as it was, then tuned with fold candidates and written "
                     "into this GPU's fp8 table (M = 1, 6, 17; floor at the measured copy rate)",
        commands=("mkdir -p $R/before $R/tables && for f in baton/ops/fp8_linear/tuned/*.json; do cp $f "
                  "$R/before/fp8-$(basename $f); done",
                  f"set -o pipefail; {PYTEST} -n 12 tests/ops/test_decode_gemm.py -k fp8 "
                  "--junitxml=$R/junit_fold.xml 2>&1 | tee $R/tests_fold.log",
                  "set -o pipefail; python3 benchmarks/bench_decode_gemm.py --dtypes fp8 --shapes " + FOLD_SHAPES +
                  " --m 1 6 17 --impls baton --bandwidth measure --workers 14 --json $R/decode_gemm_before.json "
                  "2>&1 | tee $R/bench_before.log",
                  "set -o pipefail; python3 benchmarks/bench_decode_gemm.py --tune --write-table --dtypes fp8 "
                  "--shapes " + FOLD_SHAPES + " --m 1 6 17 --impls baton cublas --bandwidth measure --budget-s 120 "
                  "--workers 14 --json $R/decode_gemm_fold.json 2>&1 | tee $R/bench_fold.log",
                  "for f in baton/ops/fp8_linear/tuned/*.json; do cp $f $R/tables/fp8-$(basename $f); done"),
        gpus=1, limit_s=330, outputs=("decode_gemm_*.json", "tables", "before", "junit_*.xml")),
    Job("fp8-pre", "issue 22 item 2: w8a16 with the rows' prologue in a kernel of its own (LinearConfig.pre: "
                   "2.2-2.9 SASS instructions a weight against 4.3-8.3, benchmarks/ops/sass_linear.py) and the "
                   "8-warp 128 / 256-row tiles: the kernel tests compiled, the fp8 Ling dense shapes tuned into "
                   "this GPU's fp8 table (kept in $TMP/baton-tables for ling-flash-fp8-tuned: the whole step "
                   "after, in the next call; ling-flash-fp8-dense in an earlier one for the step before)",
        commands=("mkdir -p $R/before $R/tables && for f in baton/ops/fp8_linear/tuned/*.json; do cp $f "
                  "$R/before/fp8-$(basename $f); done",
                  f"set -o pipefail; {PYTEST} -n 12 tests/ops/test_decode_gemm.py -k 'fp8 or pre' "
                  "--junitxml=$R/junit_pre.xml 2>&1 | tee $R/tests_pre.log",
                  "set -o pipefail; python3 benchmarks/bench_decode_gemm.py --tune --write-table --dtypes fp8 "
                  "--shapes kda_in_proj o_proj mla_in_proj shared_gate_up shared_down dense_gate_up dense_down "
                  "eh_proj --m 1 6 17 --impls baton cublas --bandwidth measure --budget-s 170 --workers 14 "
                  "--json $R/decode_gemm_pre.json 2>&1 | tee $R/bench_pre.log",
                  "mkdir -p $TMP/baton-tables/fp8 && for f in baton/ops/fp8_linear/tuned/*.json; do "
                  "cp $f $R/tables/fp8-$(basename $f); cp $f $TMP/baton-tables/fp8/; done"),
        gpus=1, limit_s=420, outputs=("decode_gemm_*.json", "tables", "before", "junit_*.xml")),
    Job("ling-flash-fp8-tuned", "ling-flash-fp8-dense with the tables this machine's moe-f16 and fp8-pre wrote "
                                "(kept in $TMP/baton-tables while it stays warm; the tree's copies otherwise): the "
                                "step after, for the step before in an earlier call",
        commands=("if [ -d $TMP/baton-tables/moe ]; then cp $TMP/baton-tables/moe/*.json baton/ops/moe/tuned/; fi",
                  "if [ -d $TMP/baton-tables/fp8 ]; then cp $TMP/baton-tables/fp8/*.json baton/ops/fp8_linear/tuned/; "
                  "fi",
                  "mkdir -p $R/tables && cp baton/ops/moe/tuned/*.json baton/ops/fp8_linear/tuned/*.json $R/tables/",
                  ling(42, "--quantization fp8 --modes nextn --enable-fp8-draft-lm-head")),
        gpus=1, limit_s=270, outputs=("ling_flash_*.json", "tables")),
    Job("kda-fused", "issue 22 item 4: the KDA decode / verify in one kernel (the short conv and the output gated "
                     "RMSNorm inside the recurrence, the head's V-blocks meeting through a ticket counter): the "
                     "fused launch against the former conv + recurrence (+ norm) at Ling-3.0-flash's shapes, T = "
                     "1, 6, 17, inside CUDA graphs, then the tests not yet run compiled (the KDA, state-commit and "
                     "MLA kernel tests passed on the H200 at 6706a99: 111 of them in 240 s), three workers",
        commands=("set -o pipefail; python3 -m benchmarks.ops.bench_kda fused 2>&1 | tee $R/bench_kda_fused.log",
                  f"set -o pipefail; {PYTEST} -n 3 tests/ops/test_attention_triton.py tests/models/test_mla_layer.py "
                  "tests/models/test_shared_fusion.py tests/ops/test_kda_conv_triton.py "
                  "--junitxml=$R/junit_kda_fused.xml 2>&1 | tee $R/tests_kda_fused.log"),
        gpus=1, limit_s=260, outputs=("junit_kda_fused.xml", "tests_kda_fused.log", "bench_kda_fused.log")),
    Job("ling18-fp8-nextn", "18 Ling layers in fp8 (fits an H100): the NEXTN (5, 1, 6) step at simulated 3.25 with "
                            "its census (kernels a step by category, after the KDA / MLA / shared-expert fusions)",
        commands=(ling(18, "--quantization fp8 --modes nextn --enable-fp8-draft-lm-head"),),
        gpus=1, limit_s=240, outputs=("ling_flash_*.json",)),
    Job("ab-fusions-ling18", "issue 22: the fusions A/B in one call, 18 fp8 Ling layers (fits an H100), NEXTN (5, 1, "
                             "6) at 3.25 with its census each: the default (shared experts fused, KDA conv fused at "
                             "T = 1 only), then shared experts unfused, then the KDA conv fused at the verify's T = 6 "
                             "too (the whole model's step regressed 9.76 -> 11.30 ms between c5bf2a4 and 6706a99: "
                             "MoE + dense GEMMs +1.08 ms, KDA +0.54 ms)",
        commands=tuple(ling(18, "--quantization fp8 --modes nextn --enable-fp8-draft-lm-head", extra)
                       for extra in ("--tag default", "--disable-shared-experts-fusion --tag unfused_shared",
                                     "--kda-fused-conv-max-tokens 64 --tag kda_fused_t6")),
        gpus=1, limit_s=420, outputs=("ling_flash_*.json",)),
    Job("moe-f16", "issue 22 item 3: the fp8 experts on the fp16 MMA (mode 'f16': the w8a8 kernels with fp16 "
                   "activations, 3.0 SASS instructions a weight against the direct kernels' 4.7-9.3): its kernel "
                   "tests compiled, then T = 1, 6, 17 against the direct kernels with its tile sweep written into "
                   "this GPU's MoE table (kind fp8_f16, preferred where it won), then T = 132 (a cached follow-up's "
                   "prefill, issue 23) against the aligned fp8 kernels; run before fp8-pre on the same machine, "
                   "with the table fetched into the tree in between, so the whole step takes it",
        commands=(f"set -o pipefail; {PYTEST} tests/ops/test_moe_f16.py tests/ops/test_moe_w8a8.py "
                  "--junitxml=$R/junit_moe_f16.xml 2>&1 | tee $R/tests_moe_f16.log",
                  "set -o pipefail; python3 -m benchmarks.ops.bench_moe_w8a8 --act f16 --sweep --write-table "
                  "--json $R/moe_f16.jsonl 2>&1 | tee $R/bench_moe_f16.log",
                  "mkdir -p $R/moe_tables $TMP/baton-tables/moe && cp baton/ops/moe/tuned/*.json $R/moe_tables/ && "
                  "cp baton/ops/moe/tuned/*.json $TMP/baton-tables/moe/",
                  "python3 -m benchmarks.ops.bench_moe_w8a8 --act f16 --tokens 132 --json $R/moe_f16_prefill.jsonl"),
        gpus=1, limit_s=280, outputs=("moe_f16.jsonl", "moe_f16_prefill.jsonl", "moe_tables", "junit_moe_f16.xml")),
    Job("ncu-linear", "issue 22 item 2: Nsight Compute on the fp8 KDA in-projection at M = 6 (the NEXTN verify): "
                      "this GPU's table config, the fp16 MMA without and with the folded scales, and bf16; "
                      "throughput, warp stalls and the source lines they sit on",
        commands=("ncu --clock-control none -k regex:linear_kernel --section SpeedOfLight --section Occupancy "
                  "--section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis "
                  "--section SourceCounters --section InstructionStats python3 -m benchmarks.ops.profile_linear "
                  "kda_in_proj:fp8:6 kda_in_proj:fp8:6:swap-64x128-s1-w4-st4-f16 "
                  "kda_in_proj:fp8:6:swap-64x128-s1-w4-st4-f16-fold kda_in_proj:bf16:6 > $R/ncu.log 2>&1",),
        gpus=1, limit_s=180, outputs=("ncu.log",)),
    Job("tma-gemm", "issue 22, item 2: decode-shape projections with the weight tiles through tensor descriptors "
                    "(LinearConfig.tma): the tune's best per-thread-load config against its best TMA one at the "
                    "Ling dense shapes, bf16, w8a16 and w8a8, M = 1..17, on this GPU (floor at its measured copy "
                    "rate), then the TMA kernel tests compiled",
        commands=(f"set -o pipefail; {PYTEST} -n 12 tests/ops/test_linear_tma.py --junitxml=$R/junit_tma.xml "
                  "2>&1 | tee $R/tests_tma.log",
                  "set -o pipefail; python3 benchmarks/bench_decode_gemm.py --tune --tune-w8a8 --tma "
                  "--shapes kda_in_proj o_proj dense_gate_up dense_down shared_gate_up --m 1 6 17 "
                  "--impls baton w8a8 cublas --bandwidth measure --budget-s 240 --workers 14 "
                  "--json $R/decode_gemm_tma.json 2>&1 | tee $R/bench.log",
                  "set -o pipefail; python3 benchmarks/bench_decode_gemm.py --tune --tma --dtypes bf16 "
                  "--shapes smol_qkv smol_o smol_gate_up smol_down --m 1 2 4 9 --impls baton cublas "
                  "--bandwidth measure --budget-s 60 --workers 14 --json $R/decode_gemm_tma_smol.json "
                  "2>&1 | tee $R/bench_smol.log"),
        gpus=1, limit_s=560, outputs=("decode_gemm_tma.json", "decode_gemm_tma_smol.json", "junit_*.xml")),
    Job("fp8-w8a8", "w8a8 fp8 dense projections (fp8 activations, fp8 x fp8 MMA): tune its configs into the fp8 "
                    "table, time w8a16 / w8a8 / cuBLAS-on-bf16 at every Ling fp8 dense shape (M = 1..17), then the "
                    "GPU tests of w8a8, the fp8 dense path and the decode GEMMs",
        commands=("cp baton/ops/fp8_linear/tuned/nvidia-h200.json $R/fp8_table_before.json",
                  "set -o pipefail; python3 benchmarks/bench_decode_gemm.py --dtypes fp8 --tune-w8a8 --write-table "
                  "--impls baton w8a8 cublas scaled_mm --budget-s 130 --workers 14 --json $R/decode_gemm_w8a8.json "
                  "2>&1 | tee $R/bench.log",
                  "cp baton/ops/fp8_linear/tuned/nvidia-h200.json $R/nvidia-h200.json",
                  f"set -o pipefail; {PYTEST} -n 12 -m gpu tests/ops/test_fp8_w8a8.py --junitxml=$R/junit_w8a8.xml "
                  "2>&1 | tee $R/tests_w8a8.log",
                  "ncu --clock-control none -k regex:linear_kernel --section SpeedOfLight --section Occupancy "
                  "--section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis "
                  "python3 benchmarks/results/fp8-w8a8-2026-12-02/profile_w8a8.py > $R/ncu.log 2>&1",
                  f"set -o pipefail; {PYTEST} -n 12 -m gpu tests/ops/test_fp8_dense.py tests/ops/test_decode_gemm.py "
                  "--junitxml=$R/junit_fp8_decode.xml 2>&1 | tee $R/tests_fp8_decode.log"),
        gpus=1, limit_s=200, outputs=("decode_gemm_w8a8.json", "nvidia-h200.json", "fp8_table_before.json",
                                      "junit_*.xml")),
    # --- SmolLM2-135M-Instruct ---------------------------------------------------------------------------
    Job("smollm2-decode", "the published SmolLM2 figure: plain greedy decode of the embedded GGUF, fused attention "
                          "off and on, against HF generate and HF StaticCache + torch.compile in the same run",
        commands=("python3 -m benchmarks.bench_smollm2_decode --fused-attention ab",),
        gpus=1, limit_s=300, needs=("gguf",), outputs=("smollm2_decode.json",)),
    Job("domains-smollm2", "speculation over domains on the embedded model: accept length and tok/s against plain "
                           "for each held-out domain, GSM8K and random ids, the default drafter fixed and adaptive",
        commands=("python3 -m benchmarks.bench_domains --per-domain 3 --max-new-tokens 128 "
                  "--gsm8k $TMP/gsm8k/test.jsonl --name domains_h200 --plot $R/domains_h200.png",),
        gpus=1, limit_s=420, needs=("gguf", "gsm8k"), outputs=("domains_h200.json", "domains_h200.png")),
    Job("domains-quick", "issue 25 on a short device budget: the default (shipped) DSpark drafter over the domains "
                         "(3 prompts of 128 tokens each, fixed and adaptive against plain), then the story prompt "
                         "with none / DSPARK / NEXTN",
        commands=("python3 -m benchmarks.bench_domains --per-domain 3 --max-new-tokens 128 "
                  "--gsm8k $TMP/gsm8k/test.jsonl --name domains_dspark --plot $R/domains_dspark.png",
                  "for a in none DSPARK NEXTN; do baton generate 'Write a short story about a robot who learns to "
                  "paint.' --max-new-tokens 128 --speculative-algorithm $a; done > $R/story.log 2>&1"),
        gpus=1, limit_s=150, needs=("gguf", "gsm8k"),
        outputs=("domains_dspark.json", "domains_dspark.png", "story.log")),
    Job("adaptive-smollm2", "issue 25: adaptive depth with depth 0 as the plain decode step (deferred drafter "
                            "extends): the domain table for DSpark (the default) and NEXTN, fixed and adaptive "
                            "against plain, then the GPU test of depth changes (captured == uncaptured)",
        commands=("python3 -m benchmarks.bench_domains --per-domain 5 --max-new-tokens 128 "
                  "--gsm8k $TMP/gsm8k/test.jsonl --num-random 3 --name domains_dspark "
                  "--plot $R/domains_dspark.png",
                  "python3 -m benchmarks.bench_domains --speculative-algorithm NEXTN --speculative-num-steps 3 "
                  "--speculative-num-draft-tokens 4 --per-domain 5 --max-new-tokens 128 "
                  "--gsm8k $TMP/gsm8k/test.jsonl --num-random 3 --name domains_nextn --plot $R/domains_nextn.png",
                  f"set -o pipefail; {PYTEST} -m gpu tests/engine/test_cuda_graphs.py -k depth "
                  "--junitxml=$R/junit_depth.xml 2>&1 | tee $R/tests_depth.log"),
        gpus=1, limit_s=330, needs=("gguf", "gsm8k"),
        outputs=("domains_dspark.json", "domains_nextn.json", "domains_dspark.png", "domains_nextn.png",
                 "junit_depth.xml")),
    Job("smollm2-decode-dummy", "the same decode on dummy weights at SmolLM2's config (no GGUF needed), with the "
                                "HF compiled peer",
        commands=(f"python3 -m benchmarks.bench_smollm2_decode --model-path {SMOL_CONFIG} --load-format dummy "
                  "--skip-hf --repeats 3",),
        gpus=1, limit_s=240, outputs=("smollm2_decode.json",)),
    Job("census-smollm2", "GPU time of one SmolLM2 step by kernel category, plain / NEXTN / DSpark (dummy weights, "
                          "simulated GSM8K accept lengths)",
        commands=tuple(census(alg) for alg in ("none", "NEXTN", "DSPARK")),
        gpus=1, limit_s=240, outputs=("census_smollm2_*.jsonl",)),
    # --- Ling-3.0-flash (dummy weights) ------------------------------------------------------------------
    Job("ling18-nextn", "18 Ling layers on one GPU: plain decode and NEXTN (5, 1, 6) at simulated accept 3.25, "
                        "with the census",
        commands=(ling(18, "--modes plain,nextn"),), gpus=1, limit_s=240, outputs=("ling_flash_*.json",)),
    Job("ling-flash-fp8", "the whole Ling-3.0-flash (42 layers + MTP) on one GPU with fp8 experts, plain and NEXTN "
                          "with the fp8 draft lm_head: TPOT, census, peak memory",
        commands=(ling(42, "--quantization fp8-experts --modes plain,nextn --enable-fp8-draft-lm-head"),),
        gpus=1, limit_s=330, outputs=("ling_flash_*.json",)),
    Job("ling-flash-fp8-dense", "the whole model on one GPU with fp8 experts and fp8 dense projections, NEXTN",
        commands=(ling(42, "--quantization fp8 --modes nextn --enable-fp8-draft-lm-head"),),
        gpus=1, limit_s=270, outputs=("ling_flash_*.json",)),
    Job("ling-flash-fp8-modes", "the whole model on one GPU, fp8 experts + dense, plain, NEXTN (5, 1, 6) at 3.25 "
                                "and a random DSpark draft (block 16, 2 layers) at 9.95, one process, a census each",
        commands=(ling(42, "--quantization fp8 --modes plain,nextn,dspark --enable-fp8-draft-lm-head"),),
        gpus=1, limit_s=560, outputs=("ling_flash_*.json",)),
    Job("ling-flash-fp8-prefix-cache", "issue 23: the prefix cache on the whole fp8 model (dummy weights): an "
                                       "8192-token first turn, its 32-token answer and a 100-token follow-up; the "
                                       "follow-up's TTFT cached vs cold, turn 1 and TPOT with the cache on vs off, "
                                       "plain and NEXTN; then the prefix cache's GPU tests (CUDA graphs)",
        commands=("python3 -m benchmarks.bench_prefix_cache --num-layers 42 --quantization fp8 --input-len 8192 "
                  "--output-len 32 --followup-len 100 --repeats 3 --modes plain,nextn",
                  f"set -o pipefail; {PYTEST} -m gpu tests/engine/test_prefix_cache_gpu.py "
                  "tests/engine/test_cuda_graphs.py -k 'prefix or prefill' "
                  "--junitxml=$R/junit_prefix_cache.xml 2>&1 | tee $R/tests_prefix_cache.log"),
        gpus=1, limit_s=330, outputs=("prefix_cache_*.json", "junit_prefix_cache.xml")),
    Job("prefill-graph", "issue 23: short prefills as captured CUDA graphs (engine/prefill_graph.py): their GPU "
                         "tests (graph == eager, fp32 and bf16, no blocking read; the prefix cache under graphs), "
                         "then the cached follow-up's TTFT with the graphs against the eager prefill in the same "
                         "engine, on 18 fp8 Ling layers (fits an H100), plain",
        commands=(f"set -o pipefail; {PYTEST} -m gpu tests/engine/test_cuda_graphs.py "
                  "tests/engine/test_prefix_cache_gpu.py -k 'prefill or prefix or graph_replay_equals_uncaptured_ling' "
                  "--junitxml=$R/junit_prefill_graph.xml 2>&1 | tee $R/tests_prefill_graph.log",
                  "python3 -m benchmarks.bench_prefix_cache --num-layers 18 --quantization fp8 --input-len 8192 "
                  "--output-len 32 --followup-len 100 --repeats 3 --modes plain"),
        gpus=1, limit_s=300, outputs=("prefix_cache_*.json", "junit_prefill_graph.xml")),
    Job("ling-flash-w8a8-modes", "ling-flash-fp8-modes with fp8 activations (--fp8-activation-scheme dynamic: "
                                 "w8a8, the seed's numerics), NEXTN first",
        commands=(ling(42, "--quantization fp8 --fp8-activation-scheme dynamic --modes nextn,dspark,plain "
                           "--enable-fp8-draft-lm-head"),),
        gpus=1, limit_s=560, outputs=("ling_flash_*.json",)),
    Job("ling-prefill-census", "where the whole fp8 model's 8192-token prefill goes (TTFT 4.3-7.4 s at a7c5f83): "
                               "kernels by category and name, the host's top ops; w8a16, then w8a8",
        commands=tuple(
            "D=$(python3 -c 'from benchmarks.bench_ling_flash import flash_dir; print(flash_dir())') && "
            "python3 -m baton census --model-path $D --load-format dummy --quantization fp8 " + extra +
            "--input-len 8192 --context-length 8400 --prefill --output-file $R/prefill_census.jsonl"
            for extra in ("", "--fp8-activation-scheme dynamic ")),
        gpus=1, limit_s=250, outputs=("prefill_census.jsonl",)),
    Job("ling-prefill132-census", "issue 23: a cached follow-up turn's prefill (132 tokens) of the whole fp8 model: "
                                  "kernels by category and name, the host's top ops (181 ms, 5,242 kernels, 64% "
                                  "idle at dae8fba; since then the fp8 dense projections in 32-row launches and, "
                                  "where the table prefers it, the experts on the fp16 MMA)",
        commands=("D=$(python3 -c 'from benchmarks.bench_ling_flash import flash_dir; print(flash_dir())') && "
                  "python3 -m baton census --model-path $D --load-format dummy --quantization fp8 --input-len 132 "
                  "--context-length 8400 --prefill --output-file $R/prefill132.jsonl",),
        gpus=1, limit_s=150, outputs=("prefill132.jsonl",)),
    Job("new-kernel-gpu-tests", "this session's kernels on the GPU: the batched KDA state commit, w8a8 dense and "
                                "MoE, the MoE work list, fp8 dense and decode GEMMs",
        commands=(f"set -o pipefail; {PYTEST} -n 3 -m gpu tests/ops/test_state_commit.py tests/ops/test_fp8_w8a8.py "
                  "tests/ops/test_moe_w8a8.py tests/ops/test_moe_triton.py tests/ops/test_moe_fp8.py "
                  "tests/ops/test_moe_active_rows.py tests/models/test_fp8_dense.py tests/ops/test_kda_fla.py "
                  "--junitxml=$R/junit.xml "
                  "2>&1 | tee $R/tests.log",),
        gpus=1, limit_s=240, outputs=("junit.xml",)),
    Job("ling-flash-tp2", "the whole model in bf16 at TP2, plain and NEXTN, with rank 0's census",
        commands=(ling(42, "--tp-size 2 --modes plain,nextn"),),
        gpus=2, limit_s=300, env={**TP_ENV, "BATON_TP_ALLREDUCE": "auto"}, stop_signal="ABRT",
        outputs=("ling_flash_*.json",)),
    Job("ling-flash-fp8-tp2", "the whole model at TP2 with fp8 experts, plain and NEXTN",
        commands=(ling(42, "--tp-size 2 --quantization fp8-experts --modes plain,nextn"),),
        gpus=2, limit_s=330, env={**TP_ENV, "BATON_TP_ALLREDUCE": "auto"}, stop_signal="ABRT",
        outputs=("ling_flash_*.json",)),
    Job("serve-bench-tp2", "`baton serve` + `baton bench` at TP2 on the whole Ling-3.0-flash shape (dummy weights, "
                           "8192 in / 1024 out, concurrency 1), plain then NEXTN",
        commands=tuple(f"MODE={mode} bash benchmarks/serve_bench.sh $R" for mode in ("plain", "nextn")),
        gpus=2, limit_s=560, env={"MODEL": "ling-3.0-flash", "TP": "2", "NUM_PROMPTS": "2", "PORT": "30517"},
        outputs=("bench_*.jsonl", "serve_*.log")),
    # --- kernels -------------------------------------------------------------------------------------------
    Job("op-benches", "the kernel microbenchmarks with cold weights: linear (with and without PDL), fp8 lm_head, "
                      "attention, KDA, argmax",
        commands=("python3 -m benchmarks.ops.bench_linear --json $R/linear.json",
                  "python3 -m benchmarks.ops.bench_fp8_linear --json $R/fp8_linear.json",
                  "python3 -m benchmarks.ops.bench_attention",
                  "python3 -m benchmarks.ops.bench_kda",
                  "python3 -m benchmarks.ops.bench_argmax --json $R/argmax.json"),
        gpus=1, limit_s=450, outputs=("linear.json", "fp8_linear.json", "argmax.json")),
    Job("moe-bench", "the bf16 MoE kernels (direct, aligned, hybrid work lists) at T = 1, 6, 16 against torch",
        commands=("python3 -m benchmarks.ops.bench_moe --json $R/moe.jsonl",),
        gpus=1, limit_s=300, outputs=("moe.jsonl",)),
    Job("moe-tile-sweep", "every fp8 MoE tile at T = 1 and 6; nvidia-h200.json comes back with the winners merged "
                          "(commit it as " + MOE_TABLE + ")",
        commands=(f"cp {MOE_TABLE} $R/nvidia-h200.json",
                  f"{MOE_SWEEP} --write-table $R/nvidia-h200.json --json $R/moe_fp8_sweep.jsonl"),
        gpus=1, limit_s=420, outputs=("nvidia-h200.json", "moe_fp8_sweep.jsonl")),
    Job("moe-tile-sweep-tp2", "the same sweep at one TP2 rank's experts (I / 2 wide; one GPU; not written into the "
                              "table: its entries are the whole experts'), bf16 direct beside it",
        commands=(f"{MOE_SWEEP} --tp-size 2 --json $R/moe_fp8_sweep_tp2.jsonl",
                  "python3 -m benchmarks.ops.bench_moe --modes direct --tokens 1 6 --routes uniform --no-torch "
                  "--tp-size 2 --json $R/moe_bf16_tp2.jsonl"),
        gpus=1, limit_s=240, outputs=("moe_fp8_sweep_tp2.jsonl", "moe_bf16_tp2.jsonl")),
    Job("moe-w8a8", "fp8 MoE at T = 1, 6, 17 (cold weights, uniform routes): the default path before/after the "
                    "one-program alignment against w8a8 (act_fp8), the w8a8 tile sweep written into the MoE table "
                    "copy, and the MoE GPU tests",
        commands=(f"cp {MOE_TABLE} $R/nvidia-h200.json",
                  "python3 -m benchmarks.ops.bench_moe_w8a8 --sweep --write-table $R/nvidia-h200.json "
                  "--json $R/moe_w8a8.jsonl",
                  "python3 -m pytest -q -m gpu tests/ops/test_moe_w8a8.py tests/ops/test_moe_fp8.py "
                  "tests/ops/test_moe_triton.py tests/ops/test_moe_active_rows.py 2>&1 | tee $R/gpu_tests.log"),
        gpus=1, limit_s=420, outputs=("nvidia-h200.json", "moe_w8a8.jsonl")),
    Job("linear-tune-ling", "tune the linear kernels' configs at Ling's decode shapes, M = 1 and 6; nvidia-h200.json "
                            "comes back merged (commit it as " + TABLE + ")",
        commands=(f"cp {TABLE} $R/nvidia-h200.json", tune("--m 1 6 --only ling")),
        gpus=1, limit_s=480, outputs=("nvidia-h200.json", "tune.json")),
    Job("linear-tune-smol", "the same at SmolLM2's shapes, M = 1, 4 (NEXTN's verify), 6 and 9 (DSpark's)",
        commands=(f"cp {TABLE} $R/nvidia-h200.json", tune("--m 1 4 6 9 --only smol")),
        gpus=1, limit_s=300, outputs=("nvidia-h200.json", "tune.json")),
    Job("linear-tune-tp2", "the same at one TP2 rank's Ling shapes (ling.tp2.*), M = 1 and 6 (one GPU)",
        commands=(f"cp {TABLE} $R/nvidia-h200.json", tune("--tp-size 2 --only ling --m 1 6")),
        gpus=1, limit_s=300, outputs=("nvidia-h200.json", "tune.json")),
    Job("allreduce-bench", "one all-reduce at decode sizes on two GPUs: NCCL against the one-shot kernel, eager "
                           "and in a CUDA graph",
        commands=("python3 -m benchmarks.ops.bench_allreduce --tp-size 2 --json $R/allreduce.json",),
        gpus=2, limit_s=90, env={**TP_ENV, "BATON_TP_ALLREDUCE": "auto"}, outputs=("allreduce.json",)),
    # --- before / after: two trees carried as .old and .new (benchmarks/device/parts.py trees) -------------
    Job("ab-smollm2", "before/after A/B of SmolLM2 TPOT (dummy weights): plain and NEXTN (a random head, simulated "
                      "accept 3.0), the two trees alternating twice",
        commands=(f"python3 -m baton convert random-draft --target {SMOL_CONFIG} --algorithm NEXTN "
                  "--output $TMP/smol_nextn",
                  "python3 -m benchmarks.device.ab --rounds 2 -- python3 {root}/benchmarks/bench_tpot.py "
                  f"{SMOL_AB} --label smollm2_plain_{{tree}} --json $R/ab.jsonl",
                  "python3 -m benchmarks.device.ab --rounds 2 -- python3 {root}/benchmarks/bench_tpot.py "
                  f"{SMOL_AB} --speculative-algorithm NEXTN --speculative-draft-model-path $TMP/smol_nextn "
                  "--speculative-num-steps 3 --speculative-simulate-accept-len 3.0 --label smollm2_nextn_{tree} "
                  "--json $R/ab.jsonl",
                  "python3 -m benchmarks.device.ab --summary $R/ab.jsonl"),
        gpus=1, limit_s=480, needs=("ab-trees",), outputs=("ab.jsonl",)),
    Job("ab-ling18", "before/after A/B of the 18-layer Ling NEXTN (5, 1, 6) benchmark, 256 tokens, each tree's own "
                     "script; results in old/ and new/",
        commands=("python3 -m benchmarks.device.ab -- python3 benchmarks/bench_ling_flash.py --num-layers 18 "
                  "--modes nextn --num-requests 1 --output-len 256",),
        gpus=1, limit_s=480, needs=("ab-trees",), outputs=("old/*.json", "new/*.json")),
    # --- training (background: runs on past the call; name the job again in the next call to collect it) ---
    Job("train-drafts", "retrain the shipped SmolLM2 drafts from scratch (baton/train/recipe_smollm2.sh: data, "
                        "NEXTN on GPU 0 and DSpark on GPU 1, STS, the GSM8K report); reuses traindata.tgz if here",
        commands=("mkdir -p $R/train && if [ -f $TMP/traindata.tgz ]; then tar xzf $TMP/traindata.tgz -C $R/train "
                  "&& export REUSE_DATA=1; fi; bash baton/train/recipe_smollm2.sh $R/train",),
        gpus=2, limit_s=1500, needs=("gguf", "gsm8k"), background=True,
        env={"GSM8K": "$TMP/gsm8k", "GPUS": "cuda:0,cuda:1", "NUM_PROMPTS": "3000", "EPOCHS": "2",
             "DATA_BUDGET": "240", "TRAIN_BUDGET": "300", "MAX_NEW": "320"},
        outputs=("train/nextn", "train/dspark", "train/drafts_gsm8k_*", "train/data/*.summary.json", "train/*.log")),
    Job("finetune-drafts", "issue 25 on one GPU: the shipped drafts over the held-out domains (before), then "
                           "baton/train/recipe_smollm2.sh FROM_SHIPPED=1 SHIP=1 on GSM8K + the general set's train "
                           "split, then the domains again (after) for DSpark and NEXTN, and the story prompt "
                           "(BEFORE=0 in the runner's environment skips the 'before' runs: a short device budget)",
        commands=("mkdir -p $R/train",
                  "[ \"${BEFORE:-1}\" = 0 ] || OUT=$R/train python3 benchmarks/bench_domains.py --per-domain 3 "
                  "--max-new-tokens 128 --gsm8k $TMP/gsm8k/test.jsonl --name domains_shipped_dspark "
                  "--plot $R/train/domains_shipped.png",
                  "[ \"${BEFORE:-1}\" = 0 ] || OUT=$R/train python3 benchmarks/bench_domains.py "
                  "--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-num-draft-tokens 4 "
                  "--per-domain 3 --max-new-tokens 128 "
                  "--gsm8k $TMP/gsm8k/test.jsonl --name domains_shipped_nextn",
                  "bash baton/train/recipe_smollm2.sh $R/train",
                  "OUT=$R/train python3 benchmarks/bench_domains.py --speculative-algorithm NEXTN "
                  "--speculative-draft-model-path $R/train/nextn --speculative-num-steps 3 "
                  "--speculative-num-draft-tokens 4 --per-domain 3 --max-new-tokens 128 "
                  "--gsm8k $TMP/gsm8k/test.jsonl --name domains_nextn",
                  "OUT=$R/train python3 benchmarks/bench_domains.py --speculative-algorithm NEXTN "
                  "--speculative-draft-model-path $R/train/nextn --speculative-num-steps 3 "
                  "--speculative-num-draft-tokens 4 --speculative-token-map $R/train/token_map.pt --per-domain 3 "
                  "--max-new-tokens 128 --gsm8k $TMP/gsm8k/test.jsonl --name domains_nextn_token_map",
                  "for a in none DSPARK NEXTN; do baton generate 'Write a short story about a robot who learns to "
                  "paint.' --max-new-tokens 128 --speculative-algorithm $a; done > $R/train/story.log 2>&1"),
        gpus=1, limit_s=1500, needs=("gguf", "gsm8k"), background=True,
        # round 2 (the drafts shipped at 9670557 came from round 1: NUM_PROMPTS 600, SAMPLES 1, DATA_SEED 0, 747 s):
        # the next 600 GSM8K prompts, two samples per prompt at T 0.7 and a new sampling seed, so the data is new
        # but for the general set's greedy answers; the split's seed stays 0 (--holdout-seed)
        env={"GSM8K": "$TMP/gsm8k", "GPUS": "cuda:0", "FROM_SHIPPED": "1", "SHIP": "1", "NUM_PROMPTS": "600",
             "SKIP_PROMPTS": "600", "SAMPLES": "2", "DATA_SEED": "1",
             "EPOCHS": "3", "DATA_BUDGET": "260", "TRAIN_BUDGET": "300", "MAX_NEW": "320",
             "REPORT_QUESTIONS": "16"},
        outputs=("train/nextn", "train/dspark", "train/drafts_gsm8k_*", "train/domains_*", "train/story.log",
                 "train/token_map.pt",
                 "train/data/*.summary.json", "train/*.log")),
    Job("train-dspark-more", "the shipped DSpark drafter trained further over both GPUs on more GSM8K data "
                             "(benchmarks/train_more_dspark.sh MODE=dp NEW_DATA=1), then STS and its GSM8K report",
        commands=("mkdir -p $R/train && tar xzf $TMP/traindata.tgz -C $R/train && "
                  "bash benchmarks/train_more_dspark.sh $R/train",),
        gpus=2, limit_s=1500, needs=("gguf", "gsm8k", "traindata"), background=True,
        env={"GSM8K": "$TMP/gsm8k", "GPUS": "cuda:0,cuda:1", "MODE": "dp", "NEW_DATA": "1", "DATA_BUDGET": "150",
             "TRAIN_BUDGET": "800", "PROFILE_STEPS": "5"},
        outputs=("train/dspark_*", "train/drafts_gsm8k_*", "train/data/more_*.jsonl", "train/*.log")),
]
