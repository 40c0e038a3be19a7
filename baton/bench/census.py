"""``baton census``: where the GPU time of one decode step goes, as the seed's Figure 10 splits it.

The step (plain decode, or draft + verify + extend) is replayed from its CUDA graphs after a prefill of
``--input-len`` tokens. Unprofiled: CUDA events around many replays give the true step time. Profiled: a
torch.profiler trace of a few replays gives each kernel's time, classified by name into MoE GEMM, router /
activation / glue, all-reduce, dense GEMM, KDA, MLA (or GQA attention), and idle (the step time the trace
shows no kernel running). The profiled-vs-unprofiled ratio is printed beside it: profiling inflates host
work, so host-side conclusions need that calibration first. The floor is the bytes one step must touch
over the measured copy bandwidth (4.2 TB/s on the project's H200).

Time is attributed exclusively: under PDL a kernel is launched while its predecessor still runs and waits for
it, so its raw duration also counts the predecessor's work (the raw sums of a step can exceed the step's wall time
by half, and a kernel can look several times slower than it is alone; docs/performance.md). Each stretch
of wall time goes to the kernel that started first among those running (``exclusive_times``), so the
categories and idle add up to the traced step; the raw sums stay in ``census_us_inclusive``, and the kernels
taking the most exclusive time are listed by name.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch

H200_BANDWIDTH = 4.2e12  # bytes/s, device-to-device copy measured on the project's H200 (perf-anchors.md)

CATEGORIES = [
    ("all-reduce", re.compile(r"allreduce|all_reduce|nccl|one_shot|two_shot|symm", re.I)),
    ("MoE GEMM", re.compile(r"moe|expert", re.I)),
    ("router / activation / glue", re.compile(r"topk|router|grouped|argmax|softmax|sigmoid", re.I)),
    ("KDA", re.compile(r"kda|recurrent|short_conv|gated_rms|delta", re.I)),
    ("MLA", re.compile(r"mla", re.I)),
    ("attention", re.compile(r"attention|attn|flash|rope", re.I)),
    ("dense GEMM", re.compile(r"gemv|gemm|linear|matmul|cutlass|xmma|cublas|splitk|sm90|nvjet", re.I)),
]


def classify(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "router / activation / glue"


def prepare(engine, input_len: int, seed: int = 0) -> None:
    """Prefill a random prompt and load the relay, as a request would."""
    from baton.types import Request, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(engine.model_config.vocab_size, 32000), (input_len,), generator=gen).tolist()
    req = Request(ids, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    engine.start_steps(req)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(engine, num_steps: int) -> list[float]:
    """Per-step wall time (ms) of back-to-back graph replays, CUDA events around each step."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_steps)]
    for i in range(num_steps):
        starts[i].record()
        for replay in engine.program.replays:
            replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def exclusive_times(intervals: list[tuple[float, float]]) -> list[float]:
    """Each interval's exclusive share of wall time, in input order: sorted by start, an interval owns
    [max(start, frontier), end] where frontier is the latest end among the intervals that started before it
    (an interval inside an earlier one owns nothing). The shares add up to the union's length."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    out = [0.0] * len(intervals)
    frontier = float("-inf")
    for i in order:
        s, e = intervals[i]
        out[i] = max(0.0, e - max(s, frontier))
        frontier = max(frontier, e)
    return out


def attribute(kernels: list[tuple[str, float, float]], num_steps: int, top: int = 12) -> dict:
    """(name, start, end) kernel records of ``num_steps`` steps -> per-step µs: exclusive time per category
    (with idle: the span not covered), the raw (inclusive) sums per category, the span, and the ``top`` kernel
    names by exclusive time."""
    steps = max(num_steps, 1)
    shares = exclusive_times([(s, e) for _, s, e in kernels])
    per_cat: dict[str, float] = {}
    inclusive: dict[str, float] = {}
    per_name: dict[str, float] = {}
    count_cat: dict[str, float] = {}
    count_name: dict[str, float] = {}
    for (name, s, e), x in zip(kernels, shares, strict=True):
        label = classify(name)
        per_cat[label] = per_cat.get(label, 0.0) + x / steps
        inclusive[label] = inclusive.get(label, 0.0) + (e - s) / steps
        per_name[name] = per_name.get(name, 0.0) + x / steps
        count_cat[label] = count_cat.get(label, 0.0) + 1 / steps
        count_name[name] = count_name.get(name, 0.0) + 1 / steps
    span = (max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) / steps if kernels else 0.0
    per_cat["idle"] = max(span - sum(shares) / steps, 0.0)
    top_names = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    most = sorted(count_name.items(), key=lambda kv: (-kv[1], kv[0]))[:2 * top]
    return {"per_cat": per_cat, "inclusive": inclusive, "span": span,
            "top_kernels": [(name[:120], round(us, 2)) for name, us in top_names],
            "count_by_category": {k: round(v, 2) for k, v in sorted(count_cat.items(), key=lambda kv: -kv[1])},
            "most_launched": [(name[:120], round(n, 2), round(per_name[name], 2)) for name, n in most]}


def profile_steps(engine, num_steps: int) -> tuple[dict, float, int]:
    """``attribute``'s dict for a trace of ``num_steps`` replays, the traced step time (µs), kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            for replay in engine.program.replays:
                replay()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    att = attribute(kernels, num_steps)
    return att, att["span"], len(kernels) // max(num_steps, 1)


def distinct_experts(engine, num_tokens: int) -> float:
    """Mean number of distinct routed experts a verify of ``num_tokens`` tokens touches per MoE layer,
    measured on the router of the loaded weights (eager forward over random ids). A fused shared expert (every
    row's last column) is not a routed expert and is not counted: ``step_bytes`` adds it per layer."""
    from baton.layers.moe import SparseMoE

    counts: list[int] = []
    moes = [m for m in engine.model.modules() if isinstance(m, SparseMoE)]
    if not moes:
        return 0.0
    handles = [_wrap_route(m, counts, m.shared_id) for m in moes]
    try:
        x = torch.randn(num_tokens, engine.model_config.hidden_size, device=engine.device, dtype=engine.dtype)
        with torch.inference_mode():
            for m in moes:
                m.route(x)
    finally:
        for restore in handles:
            restore()
    return statistics.mean(counts) if counts else 0.0


def _wrap_route(module, counts: list[int], shared_id: int | None = None):
    original = module.route

    def route(x):
        ids, weights = original(x)
        routed = ids if shared_id is None else ids[ids != shared_id]
        counts.append(int(torch.unique(routed).numel()))
        return ids, weights

    module.route = route
    return lambda: setattr(module, "route", original)


def _is_expert_weight(name: str) -> bool:
    return name.endswith("experts.w13") or name.endswith("experts.w2")


def _bytes_per_expert(experts) -> float:
    """One expert's weights (w13 + w2; fp8 weights count their byte each)."""
    return (experts.w13.nbytes + experts.w2.nbytes) / experts.w13.shape[0]


def _fused_shared(experts) -> int:
    """1 when the stack holds a fused shared expert (read by every step, once per layer), else 0."""
    return int(getattr(experts, "shared_id", None) is not None)


def step_bytes(engine, input_len: int, num_verify: int, experts_per_layer: float) -> dict[str, float]:
    """Bytes one step must move at least once: weights touched (dense once, each distinct expert once, the
    lm_head per row set), linear-attention states read and written, the attention cache read. A fused shared
    expert (stacked with the routed ones) counts once per layer among the expert bytes; unfused, its MLP is among
    the dense weights: the total is the same. Every weight counts
    its stored bytes: under ``--quantization fp8`` the dense projections' and experts' one byte a weight plus their
    fp32 block scales (``weight_scale_inv``), the lm_head, router and norms their model dtype."""
    from baton.cache.kv import KVCache, MLACache
    from baton.cache.state import KDAState
    from baton.layers.moe import Experts

    model, k = engine.model, num_verify
    expert_bytes = 0.0
    dense = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or "embed" in name or "word_embeddings" in name:
            continue
        if _is_expert_weight(name):
            continue
        dense += p.nbytes
    lm_head = model.lm_head_weight.nbytes
    if getattr(model.config, "tie_word_embeddings", False):
        dense += lm_head
    experts = [m for n, m in model.named_modules() if isinstance(m, Experts) and not n.startswith("mtp.")]
    if experts:
        per_layer = experts_per_layer + _fused_shared(experts[0])
        expert_bytes = len(experts) * per_layer * _bytes_per_expert(experts[0])
    state = 0
    cache_read = 0
    ctx = input_len
    for c in engine.runner.cache.layers.values():
        if isinstance(c, KDAState):
            state += 2 * c.recurrent.nbytes + 2 * c.conv.nbytes + (k - 1) * c.recurrent.nbytes * (k > 1)
        elif isinstance(c, MLACache):
            cache_read += ctx * c.latent.shape[1] * c.latent.element_size()
        elif isinstance(c, KVCache):
            cache_read += _kv_bytes(c, ctx)
    out = {"dense_weights": float(dense), "experts": expert_bytes, "state": float(state), "cache": float(cache_read)}
    drafter = engine.drafter
    draft_lm_head = model.draft_lm_head_bytes()  # a drafts' lm_head pass (fp8 under --enable-fp8-draft-lm-head)
    if drafter is not None and hasattr(drafter, "head"):
        # num_steps - 1 chain forwards plus the extend, each reading the head's dense weights, the experts one
        # token routes to (an MTP head with a MoE touches top-k of them, not all) and one lm_head pass.
        out["draft"] = float(drafter.num_steps * (draft_head_bytes(drafter.head) + draft_lm_head))
    elif drafter is not None and hasattr(drafter, "caches"):
        out["draft"] = block_draft_bytes(drafter, ctx, draft_lm_head)
    out["total"] = sum(out.values())
    return out


def block_draft_bytes(drafter, ctx: int, lm_head: int) -> float:
    """Bytes one step of a block drafter (DSpark / DFlash) reads: its weights once (the layers, the context
    projection, the Markov and confidence heads; the block and the verified rows' context go through them
    together), its layers' context cache at ``ctx`` positions, and one lm_head pass for the block's logits."""
    from baton.cache.kv import KVCache

    weights = sum(p.nbytes for n, p in drafter.model.named_parameters() if "embed" not in n)
    cache = sum(_kv_bytes(c, ctx) for c in drafter.caches if isinstance(c, KVCache))
    return float(weights + cache + lm_head)


def _kv_bytes(cache, ctx: int) -> int:
    """Bytes an attention read of a GQA KV cache over ``ctx`` positions moves (K and V rows)."""
    return ctx * (cache.k[0].nbytes + cache.v[0].nbytes)


def draft_head_bytes(head) -> float:
    """Bytes one T=1 forward of a NEXTN head reads: its dense weights, plus top-k experts (and a fused shared
    expert) when it has a MoE."""
    from baton.layers.moe import Experts

    dense = sum(p.nbytes for n, p in head.named_parameters() if not _is_expert_weight(n) and "embed" not in n)
    top_k = max((getattr(m, "top_k", 0) for m in head.modules()), default=0)
    routed = sum((top_k + _fused_shared(m)) * _bytes_per_expert(m) for m in head.modules() if isinstance(m, Experts))
    return float(dense) + routed


def run_census(engine, input_len: int = 8192, num_steps: int = 50, profile_steps_n: int = 10) -> dict:
    if not engine.program.capture:
        raise ValueError("census needs the captured step program (a CUDA device, no --disable-cuda-graph)")
    prepare(engine, input_len)
    time_steps(engine, 5)  # warm
    prepare(engine, input_len)
    times = time_steps(engine, num_steps)
    step_ms = statistics.median(times)
    prepare(engine, input_len)
    att, traced_us, kernels = profile_steps(engine, profile_steps_n)
    per_cat = att["per_cat"]
    k = engine.num_draft_tokens
    experts = distinct_experts(engine, k)
    nbytes = step_bytes(engine, input_len, k, experts)
    floor_ms = nbytes["total"] / H200_BANDWIDTH * 1e3
    return {
        "step_ms_unprofiled": step_ms,
        "step_ms_unprofiled_p10_p90": [_pct(times, 10), _pct(times, 90)],
        "step_ms_profiled": traced_us / 1e3,
        "profiled_over_unprofiled": traced_us / 1e3 / step_ms if step_ms else None,
        "kernels_per_step": kernels,
        "census_us": {k_: round(v, 2) for k_, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "census_us_inclusive": {k_: round(v, 2) for k_, v in sorted(att["inclusive"].items(), key=lambda kv: -kv[1])},
        "top_kernels_us": att["top_kernels"],
        "kernels_by_category": att["count_by_category"],
        "most_launched_kernels": att["most_launched"],
        "num_layers": engine.model_config.num_hidden_layers,
        "distinct_experts_per_layer": experts,
        "bytes_per_step": nbytes,
        "floor_ms": floor_ms,
        "step_over_floor": step_ms / floor_ms if floor_ms else None,
        "verify_tokens": k,
        "input_len": input_len,
    }


def run_prefill_census(engine, input_len: int = 8192, repeats: int = 3) -> dict:
    """Where a prompt's prefill goes (TTFT without the first step): ``repeats`` prefills of a random
    ``input_len``-token prompt timed unprofiled (the median; each after ``flush_cache``, so the prefix cache never
    hits), then one traced. On CUDA its kernels by category (exclusive, as the step census) and by name, with the
    host's top ops by self time (a host-bound prefill shows there); on the CPU the ops alone (no kernel trace)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"

    def prefill() -> None:
        engine.flush_cache()
        prepare(engine, input_len)

    prefill()  # warm: compiles the prefill kernels at this length
    times = []
    for _ in range(repeats):
        engine.flush_cache()
        t0 = _now(cuda)
        prepare(engine, input_len)
        times.append(1e3 * (_now(cuda) - t0))
    engine.flush_cache()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        prepare(engine, input_len)
        if cuda:
            torch.cuda.synchronize()
    out = {"input_len": input_len, "prefill_ms": statistics.median(times), "prefill_ms_runs": times}
    if cuda:
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
        att = attribute(kernels, 1, top=20)
        out.update(traced_ms=att["span"] / 1e3, kernels=len(kernels),
                   census_us={k: round(v, 1) for k, v in sorted(att["per_cat"].items(), key=lambda kv: -kv[1])},
                   top_kernels_us=att["top_kernels"], kernels_by_category=att["count_by_category"])
    ops = prof.key_averages()
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:20]
    out["host_top_ops_ms"] = [(e.key[:100], round(e.self_cpu_time_total / 1e3, 2), e.count) for e in top]
    return out


def _now(cuda: bool) -> float:
    import time

    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def format_prefill_census(result: dict) -> str:
    lines = [f"prefill of {result['input_len']} tokens   {result['prefill_ms']:.1f} ms (median, unprofiled)"]
    if "census_us" in result:
        lines.append(f"traced: {result['traced_ms']:.1f} ms of GPU span, {result['kernels']} kernels")
        total = sum(result["census_us"].values()) or 1.0
        lines += [f"  {label:<28}{us / 1e3:9.2f} ms  {100 * us / total:5.1f}%"
                  for label, us in result["census_us"].items()]
        lines.append("top kernels (exclusive ms):")
        lines += [f"  {us / 1e3:9.2f}  {name}" for name, us in result["top_kernels_us"]]
    lines.append("host: top ops by self time (ms, calls):")
    lines += [f"  {ms:9.2f}  {n:6d}  {name}" for name, ms, n in result["host_top_ops_ms"]]
    return "\n".join(lines)


def _pct(values: list[float], q: int) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q / 100))]


def format_census(result: dict) -> str:
    lines = [f"step (unprofiled, median)   {result['step_ms_unprofiled']:.3f} ms",
             f"step (profiled trace)       {result['step_ms_profiled']:.3f} ms  "
             f"(x{result['profiled_over_unprofiled']:.2f} of unprofiled)",
             f"kernels per step            {result['kernels_per_step']}",
             f"floor (bytes / 4.2 TB/s)    {result['floor_ms']:.3f} ms  "
             f"(step = {result['step_over_floor']:.2f} x floor)"]
    total = sum(result["census_us"].values())
    for label, us in result["census_us"].items():
        lines.append(f"  {label:<28}{us:9.1f} µs  {100 * us / total:5.1f}%")
    if result.get("top_kernels_us"):
        lines.append("top kernels (exclusive µs per step):")
        lines += [f"  {us:9.1f}  {name}" for name, us in result["top_kernels_us"]]
    if result.get("kernels_by_category"):
        lines.append("kernels per step by category: " + ", ".join(
            f"{label} {n:g}" for label, n in result["kernels_by_category"].items()))
    if result.get("most_launched_kernels"):
        layers = result.get("num_layers") or 0
        per_layer = f" (per layer of {layers})" if layers else ""
        lines.append(f"most launched kernels (per step{per_layer}, exclusive µs per step):")
        lines += [f"  {n:7g}" + (f" ({n / layers:5.2f})" if layers else "") + f"  {us:9.1f}  {name}"
                  for name, n, us in result["most_launched_kernels"]]
    return "\n".join(lines)


def add_census_args(p: argparse.ArgumentParser) -> None:
    from baton.args import add_engine_args

    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=8192, help="prompt length prefilled before the census")
    p.add_argument("--num-steps", type=int, default=50, help="unprofiled steps timed")
    p.add_argument("--profile-steps", type=int, default=10, help="steps traced by the profiler")
    p.add_argument("--output-file", default=None, help="append the result as one JSON line")
    p.add_argument("--prefill", action="store_true",
                   help="the census of a prefill of --input-len tokens instead of a decode step (TTFT: kernels by "
                        "category on CUDA, the host's top ops everywhere)")


def main(ns: argparse.Namespace) -> int:
    from baton.args import server_args_from
    from baton.engine.engine import Engine

    args = server_args_from(ns)
    if args.context_length is None:
        args.context_length = ns.input_len + 64 * max(args.spec.num_draft_tokens or 1, 1) + 64
    engine = Engine(args)
    if ns.prefill:
        result = run_prefill_census(engine, ns.input_len)
        print(format_prefill_census(result))
    else:
        result = run_census(engine, ns.input_len, ns.num_steps, ns.profile_steps)
        print(format_census(result))
    if ns.output_file:
        with open(ns.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0
