"""Ling-3.0-flash layer shapes with dummy weights on one H200 (as many layers as fit in bf16): for each mode the
TPOT and TTFT at 8192 input / 1024 output tokens, batch 1, greedy, the graph times and the census of its step
(kernels, floor, where the time goes), all modes in one process and one JSON:

- plain: one token a step;
- nextn: NEXTN (5, 1, 6) at simulated accept length 3.25 (the seed's NEXTN configuration);
- dspark: a random DSpark draft of block 16 and 2 layers (``baton convert random-draft``) at simulated accept
  length 9.95 (the seed's DSpark headline configuration): a 17-row verify.

    python benchmarks/bench_ling_flash.py [--num-layers 18] [--input-len 8192] [--output-len 1024]
        [--modes plain,nextn,dspark] [--nextn-accept 3.25] [--dspark-accept 9.95] [--dspark-block-size 16]
    python benchmarks/bench_ling_flash.py --num-layers 42 --quantization fp8     # the whole model on one H200
    python benchmarks/bench_ling_flash.py ... --quantization fp8-experts         # fp8 experts, bf16 dense layers
    python benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2            # the whole model, bf16, TP2
    python benchmarks/bench_ling_flash.py ... --enable-fp8-draft-lm-head         # drafts' lm_head in fp8

The floor of each step is printed by the census: bytes touched (dense weights once, each distinct expert once,
KDA states read and written, the MLA latent cache read, the draft's reads) over 4.2 TB/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
from importlib import resources
from pathlib import Path

import torch

from benchmarks.common import env_card, save, summarize, timed_request


def flash_dir() -> str:
    d = Path(tempfile.mkdtemp(prefix="ling-flash-"))
    text = resources.files("baton.data").joinpath("ling-3.0-flash.config.json").read_text()
    (d / "config.json").write_text(text)
    return str(d)


def random_dspark_draft(path: str, args) -> str:
    """A random DSpark draft (Markov and confidence heads) for the dummy target at ``path``: the DSpark-shaped
    mode's drafter, whose accept length is simulated."""
    from baton.config import load_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft

    target = load_model_config(path, json.dumps({"num_hidden_layers": args.num_layers}))
    out = str(Path(path) / "dspark-draft")
    write_random_dspark_draft(target, out, seed=0, block_size=args.dspark_block_size, num_layers=args.dspark_layers)
    return out


def graph_times(engine, repeats: int = 50) -> dict[str, float]:
    """Median µs of each captured graph of the step, replayed back to back."""
    names = ["draft", "verify", "extend"] if engine.drafter is not None else ["decode"]
    out = {}
    for name, replay in zip(names, engine.program.replays, strict=True):
        times = []
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            replay()
            e.record()
            e.synchronize()
            times.append(1e3 * s.elapsed_time(e))
        out[name] = statistics.median(times)
    return out


def _prompt(args) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 150000, (args.input_len,), generator=gen).tolist()


def _timed_runs(engine, args) -> list[dict]:
    prompt = _prompt(args)
    timed_request(engine, prompt, 16)  # warm, at the timed input length: a first 8192-token prefill compiles (~11 s)
    print("warm-up request done", flush=True)
    runs = []
    for i in range(args.num_requests):
        runs.append(timed_request(engine, prompt, args.output_len))
        print(f"request {i}: {json.dumps(runs[-1])}", flush=True)
    return runs


def _summary(spec: dict, runs: list[dict]) -> dict:
    return {"spec": spec, "tpot_ms": summarize(runs, "tpot_ms"), "ttft_ms": summarize(runs, "ttft_ms"),
            "accept_length": summarize(runs, "accept_length")}


def _census_rank(engine, input_len: int) -> dict:
    """Every rank at once (TPEngine.call_all): the census of its own step, whose collectives pair up with the
    other ranks' replays, and the graph times. The floor is this rank's bytes (its weight shards) / 4.2 TB/s."""
    from baton.bench.census import format_census, prepare, run_census

    census = run_census(engine, input_len, num_steps=50, profile_steps_n=10)
    prepare(engine, input_len)
    return {"census": census, "graph_us": graph_times(engine), "text": format_census(census)}


def _tp_leader(engine, args) -> dict:
    """Rank 0 under --tp-size > 1: the timed requests (mirrored on every rank by TPEngine), then the census on
    every rank at once (rank 0's is returned)."""
    runs = _timed_runs(engine, args)
    census = engine.call_all(_census_rank, args.input_len)
    print(census.pop("text"), flush=True)
    return {"runs": runs, "gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9, **census}


def run_mode(args, path: str, spec: dict) -> dict:
    from baton.bench.census import format_census, prepare, run_census
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine

    server_args = ServerArgs(model_path=path, load_format="dummy", device="cuda", dtype="bfloat16",
                             json_model_override_args=json.dumps({"num_hidden_layers": args.num_layers}),
                             context_length=args.input_len + args.output_len + 64, spec=SpecConfig(**spec),
                             quantization=args.quantization, fp8_activation_scheme=args.fp8_activation_scheme,
                             tp_size=args.tp_size,
                             enable_fp8_draft_lm_head=args.enable_fp8_draft_lm_head,
                             disable_shared_experts_fusion=args.disable_shared_experts_fusion)
    if args.kda_fused_conv_max_tokens is not None:  # an A/B of the fused KDA conv (class default otherwise)
        from baton.layers.kda import KimiDeltaAttention

        KimiDeltaAttention.fused_conv_max_tokens = args.kda_fused_conv_max_tokens
    if args.tp_size > 1:
        from baton.engine.tp import run_tp
        from benchmarks.bench_ling_flash import _tp_leader as leader  # by module name: spawned ranks import it

        # every rank a child: this process holds no NCCL group, so the next mode can start a fresh one
        out = run_tp(server_args, leader, (args,), rank0_in_caller=False)
        return {**_summary(spec, out["runs"]), "tp_size": args.tp_size, "gpu_mem_gb_rank0": out["gpu_mem_gb"],
                "graph_us": out["graph_us"], "census": out["census"], "runs": out["runs"]}
    engine = Engine(server_args)
    runs = _timed_runs(engine, args)
    census = run_census(engine, args.input_len, num_steps=50, profile_steps_n=10)
    print(format_census(census))
    prepare(engine, args.input_len)
    record = {**_summary(spec, runs), "graph_us": graph_times(engine), "census": census,
              "gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9, "runs": runs}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=18)
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--num-requests", type=int, default=2)
    p.add_argument("--modes", default="plain,nextn,dspark", help="comma list of plain, nextn, dspark")
    p.add_argument("--tp-size", type=int, default=1, help="ranks (one GPU each); the census is rank 0's")
    p.add_argument("--quantization", default=None, choices=["fp8", "fp8-experts"],
                   help="fp8: experts and dense projections in fp8; fp8-experts: the experts only (the whole 42-layer "
                        "model + MTP fits one H200 either way: about 133 GB with fp8 experts and bf16 dense layers)")
    p.add_argument("--fp8-activation-scheme", default=None, choices=["dynamic", "none"],
                   help="fp8 weights: dynamic = w8a8 (activations quantised per token and 128 channels), none = "
                        "w8a16 (default: none, as baton serve for an at-load quantised checkpoint)")
    p.add_argument("--enable-fp8-draft-lm-head", action="store_true",
                   help="NEXTN drafts take their logits from an fp8 copy of the lm_head (the verify's unchanged)")
    p.add_argument("--disable-shared-experts-fusion", action="store_true",
                   help="the MoE shared expert as its own MLP (baton serve's flag; for an A/B of the fusion)")
    p.add_argument("--kda-fused-conv-max-tokens", type=int, default=None,
                   help="KimiDeltaAttention.fused_conv_max_tokens for this run (default: the class's, 1): the rows up "
                        "to which the KDA short conv runs inside the recurrence kernel (an A/B)")
    p.add_argument("--tag", default="", help="appended to the result file's name (A/B runs of one configuration)")
    p.add_argument("--nextn-accept", type=float, default=3.25, help="nextn: simulated accept length")
    p.add_argument("--dspark-accept", type=float, default=9.95, help="dspark: simulated accept length")
    p.add_argument("--dspark-block-size", type=int, default=16, help="dspark: the random draft's block (gamma)")
    p.add_argument("--dspark-layers", type=int, default=2, help="dspark: the random draft's layers")
    args = p.parse_args()
    if args.kda_fused_conv_max_tokens is not None and args.tp_size > 1:
        p.error("--kda-fused-conv-max-tokens sets a class attribute in this process; the TP ranks would not see it")
    path = flash_dir()
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(names) - {"plain", "nextn", "dspark"})
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)} (plain, nextn, dspark)")
    modes = {"plain": {}, "nextn": {"algorithm": "NEXTN", "num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6,
                                     "simulate_accept_len": args.nextn_accept}}
    if "dspark" in names:
        modes["dspark"] = {"algorithm": "DSPARK", "draft_model_path": random_dspark_draft(path, args),
                           "simulate_accept_len": args.dspark_accept}
    record = {"benchmark": "ling_flash_layers", "env": env_card(), "num_layers": args.num_layers,
              "input_len": args.input_len, "output_len": args.output_len}
    for name in names:
        record[name] = run_mode(args, path, modes[name])
        print(name, json.dumps({k: v for k, v in record[name].items() if k not in ("runs", "census")}))
    record["quantization"] = args.quantization
    record["fp8_activation_scheme"] = args.fp8_activation_scheme
    record["tp_size"] = args.tp_size
    record["fp8_draft_lm_head"] = args.enable_fp8_draft_lm_head
    record["shared_experts_fusion"] = not args.disable_shared_experts_fusion
    record["kda_fused_conv_max_tokens"] = args.kda_fused_conv_max_tokens
    tp = f"_tp{args.tp_size}" if args.tp_size > 1 else ""
    tp += "_fp8head" if args.enable_fp8_draft_lm_head else ""
    modes = "" if names == ["plain", "nextn", "dspark"] else "_" + "-".join(names)
    quant = {None: "", "fp8": "_fp8", "fp8-experts": "_fp8experts"}[args.quantization]
    quant += "_w8a8" if args.fp8_activation_scheme == "dynamic" else ""
    tag = f"_{args.tag}" if args.tag else ""
    save(f"ling_flash_{args.num_layers}l{quant}{tp}{modes}{tag}", record)


if __name__ == "__main__":
    main()
