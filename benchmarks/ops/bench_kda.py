"""Timing of the fused KDA recurrence (and the short conv) on CUDA at Ling-3.0-flash shapes, inside CUDA graphs.

``python -m benchmarks.ops.bench_kda [all|kda|conv|fused]`` (on the GPU machine) prints, for each T and mode:

- ``decode``: T=1, state read + written in place (2 MiB + 2 MiB per layer at H=32, K=V=128);
- ``verify``: T>1, state only read, every position's post-state staged (2 MiB + T x 2 MiB);
- ``final``: T>1, state read, final state written in place (what fla's public wrapper does);

the µs per call and the achieved GB/s on those state bytes for each (BV, num_warps), against fla-core's
``fused_recurrent_kda`` when ``fla`` imports (public wrapper: allocates a fresh final state, no staging; and the
lower-level ``fused_recurrent_kda_fwd`` with per-token ``ssm_state_indices`` staging when its signature fits).

Timing: R calls on R distinct buffer sets (enough bytes to overflow L2, so every call starts cold, as layer
after layer does in the model) are captured into one CUDA graph, replayed ``reps`` times back to back; time /
(reps * R) (``benchmarks.ops.timing``).
The graph-node gap (~1 µs without PDL) is included, as it is in the real step. ``BATON_PDL=0`` turns PDL off.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from baton.env import use_pdl
from benchmarks.ops.timing import MiB, cold_copies, graph_time_us, l2_bytes


def _graph_us(fns: list[Callable[[], Any]], reps: int = 20) -> float:
    """Per-call µs of ``fns`` (each one launch sequence) captured back to back in one CUDA graph."""
    return graph_time_us(fns, reps, stat="mean")


def _rotation(bytes_per_call: int, min_sets: int = 4) -> int:
    return cold_copies(bytes_per_call, 3 * l2_bytes(), min_sets)


def _kda_inputs(T: int, H: int, K: int, V: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """One buffer set laid out as in the layer: q|k|v views of the conv output, f|g|b views of the projection."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    P = H * K

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen)

    qkv = randn(T, 2 * P + H * V).to(dtype)  # [T, 2P + H*V]
    fgb = randn(T, P + H * V + H).to(dtype)  # [T, P + H*V + H]
    return dict(
        q=qkv[:, :P].view(T, H, K), k=qkv[:, P : 2 * P].view(T, H, K), v=qkv[:, 2 * P :].view(T, H, V),
        f=fgb[:, :P].view(T, H, K), gate=fgb[:, P : P + H * V].view(T, H, V), b=fgb[:, P + H * V :],
        A_log=torch.rand(H, device="cuda", generator=gen).mul(15).add(1).log(), dt_bias=0.5 * randn(H * K),
        w=torch.ones(V, device="cuda", dtype=dtype), state=0.1 * randn(H, K, V),
        out_states=torch.empty(T, H, K, V, device="cuda"), o=torch.empty(T, H, V, device="cuda", dtype=dtype),
    )


def _kda_state_bytes(T: int, H: int, K: int, V: int, mode: str) -> int:
    s = H * K * V * 4
    return s + (T * s if mode == "verify" else s)


def _fla() -> Any:
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None, None
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # noqa: BLE001
        fused_recurrent_kda_fwd = None
    return fused_recurrent_kda, fused_recurrent_kda_fwd


def _fla_call(fn: Callable[..., Any], d: dict[str, torch.Tensor], lower_bound: float, scale: float) -> Any:
    """The public wrapper with everything in-kernel (gate, beta sigmoid, l2norm); batch dim added."""
    return fn(d["q"][None], d["k"][None], d["v"][None], d["f"][None], d["b"][None], A_log=d["A_log"],
              dt_bias=d["dt_bias"], scale=scale, initial_state=d["state"][None], output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=lower_bound)


def _fla_staged_call(fn: Callable[..., Any], d: dict[str, torch.Tensor], pool: torch.Tensor, idx: torch.Tensor,
                     lower_bound: float, scale: float) -> Any:
    """fla's lower-level spec-decode form: reads slot idx[0, 0], writes token t's state to slot idx[0, t]."""
    kw = dict(q=d["q"][None], k=d["k"][None], v=d["v"][None], g=d["f"][None], beta=d["b"][None], scale=scale,
              initial_state=pool, inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
              A_log=d["A_log"], dt_bias=d["dt_bias"], lower_bound=lower_bound, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True)
    return fn(**kw)


def _fla_staged_ok(fn: Callable[..., Any] | None) -> bool:
    if fn is None:
        return False
    params = inspect.signature(fn).parameters
    need = ("ssm_state_indices", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "A_log", "dt_bias",
            "lower_bound", "inplace_final_state")
    return all(p in params for p in need)


def bench_kda(
    Ts: tuple[int, ...] = (1, 6, 8, 16),
    block_vs: tuple[int, ...] = (4, 8, 16, 32, 64, 128),
    warps: tuple[int, ...] = (1, 2, 4, 8),
    H: int = 32,
    K: int = 128,
    V: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    lower_bound: float = -5.0,
    reps: int = 20,
    verbose: bool = True,
) -> list[dict[str, Any]]:
    """Sweeps (BV, num_warps) of ``kda_recurrent_fused`` per (T, mode), then times the best config with the
    output gated RMSNorm (inline when BV == V, else by each head's last V-block), and fla-core's kernels if present.
    Returns one dict per measurement (name, T, mode, bv, num_warps, us, state_bytes, gbps, err)."""
    from baton.ops.kda import naive
    from baton.ops.kda import triton as tk

    assert torch.cuda.is_available(), "bench_kda needs CUDA"
    scale = K**-0.5
    fla_pub, fla_fwd = _fla()
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        if verbose:
            extra = f"  err={row['err']:.2e}" if row.get("err") is not None else ""
            print(f"{row['name']:<22} T={row['T']:<3} {row['mode']:<7} BV={row['bv']!s:<4} nw={row['num_warps']!s:<2} "
                  f"{row['us']:8.2f} us  {row['gbps']:7.1f} GB/s (state {row['state_bytes'] / MiB:.0f} MiB){extra}",
                  flush=True)

    if verbose:
        print(f"# bench_kda on {torch.cuda.get_device_name()}  H={H} K={K} V={V} {dtype}  PDL={use_pdl()}  "
              f"fla={'yes' if fla_pub else 'no'}", flush=True)
    for T in Ts:
        for mode in ("decode",) if T == 1 else ("verify", "final"):
            nbytes = _kda_state_bytes(T, H, K, V, mode)
            R = _rotation(nbytes)
            sets = [_kda_inputs(T, H, K, V, dtype, seed=i) for i in range(R)]
            stage = mode == "verify"

            def ours(d: dict[str, torch.Tensor], bv: int, nw: int, norm: bool, stage: bool = stage) -> None:
                tk.kda_recurrent_fused(d["q"], d["k"], d["v"], d["f"], d["b"], d["A_log"], d["dt_bias"], lower_bound,
                                       d["state"], scale, d["out_states"] if stage else None, not stage,
                                       d["w"] if norm else None, d["gate"] if norm else None, out=d["o"],
                                       block_v=bv, num_warps=nw)

            # correctness against the reference once per case (state copies: the timing mutates states)
            d0 = sets[0]
            s_ref, s_tri = d0["state"].clone(), d0["state"].clone()
            os_ref = torch.zeros_like(d0["out_states"])
            os_tri = torch.zeros_like(d0["out_states"])
            o_ref = naive.kda_recurrent_fused(d0["q"], d0["k"], d0["v"], d0["f"], d0["b"], d0["A_log"], d0["dt_bias"],
                                              lower_bound, s_ref, scale, os_ref, True)
            o_tri = tk.kda_recurrent_fused(d0["q"], d0["k"], d0["v"], d0["f"], d0["b"], d0["A_log"], d0["dt_bias"],
                                           lower_bound, s_tri, scale, os_tri, True)
            err = max((o_ref.float() - o_tri.float()).abs().max().item(), (s_ref - s_tri).abs().max().item(),
                      (os_ref - os_tri).abs().max().item())

            best: tuple[float, int, int] | None = None
            for bv in block_vs:
                if bv > triton_next_pow2(V):
                    continue
                for nw in warps:
                    if bv * triton_next_pow2(K) < 32 * nw:  # fewer elements than threads
                        continue
                    us = _graph_us([lambda d=d, bv=bv, nw=nw: ours(d, bv, nw, False) for d in sets], reps)
                    emit(dict(name="baton", T=T, mode=mode, bv=bv, num_warps=nw, us=us, state_bytes=nbytes,
                              gbps=nbytes / us / 1e3, err=err))
                    if best is None or us < best[0]:
                        best = (us, bv, nw)
            assert best is not None
            _, bbv, bnw = best
            for bv, nw in {(bbv, bnw), (V, max(4, bnw))}:
                us = _graph_us([lambda d=d, bv=bv, nw=nw: ours(d, bv, nw, True) for d in sets], reps)
                emit(dict(name="baton+norm" + ("(inline)" if bv >= V else "(last V-block)"), T=T, mode=mode, bv=bv,
                          num_warps=nw, us=us, state_bytes=nbytes, gbps=nbytes / us / 1e3, err=None))

            if fla_pub is not None and mode in ("decode", "final"):
                try:
                    s_fla = d0["state"].clone()
                    o_f, st_f = _fla_call(fla_pub, {**d0, "state": s_fla}, lower_bound, scale)
                    s_chk = d0["state"].clone()
                    o_c = tk.kda_recurrent_fused(d0["q"], d0["k"], d0["v"], d0["f"], d0["b"], d0["A_log"],
                                                 d0["dt_bias"], lower_bound, s_chk, scale)
                    ferr = max((o_f[0].float() - o_c.float()).abs().max().item(), (st_f[0] - s_chk).abs().max().item())
                    us = _graph_us([lambda d=d: _fla_call(fla_pub, d, lower_bound, scale) for d in sets], reps)
                    emit(dict(name="fla fused_recurrent", T=T, mode=mode + "*", bv=32, num_warps="-", us=us,
                              state_bytes=nbytes, gbps=nbytes / us / 1e3, err=ferr))
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"fla fused_recurrent_kda T={T}: {type(e).__name__}: {e}", flush=True)
            if _fla_staged_ok(fla_fwd) and mode in ("decode", "verify"):
                try:
                    pools = [torch.empty(T + 1, H, K, V, device="cuda") for _ in sets]
                    for p, d in zip(pools, sets, strict=True):
                        p[1].copy_(d["state"])
                    idx = torch.arange(1, T + 1, device="cuda", dtype=torch.int32)[None]  # [1, T]
                    us = _graph_us([lambda d=d, p=p, idx=idx: _fla_staged_call(fla_fwd, d, p, idx, lower_bound, scale)
                                    for d, p in zip(sets, pools, strict=True)], reps)
                    emit(dict(name="fla fwd (staged)", T=T, mode=mode, bv="-", num_warps="-", us=us,
                              state_bytes=nbytes, gbps=nbytes / us / 1e3, err=None))
                except Exception as e:  # noqa: BLE001
                    print(f"fla fused_recurrent_kda_fwd T={T}: {type(e).__name__}: {e}", flush=True)
            if verbose:
                print(f"  best T={T} {mode}: BV={bbv} num_warps={bnw} {best[0]:.2f} us  (rotation over {R} sets)",
                      flush=True)
            del sets
    return rows


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bench_short_conv(
    Ts: tuple[int, ...] = (1, 6, 8, 16),
    block_ds: tuple[int, ...] = (64, 128, 256, 512),
    warps: tuple[int, ...] = (1, 2, 4, 8),
    D: int = 3 * 32 * 128,
    W: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = 20,
    verbose: bool = True,
) -> list[dict[str, Any]]:
    """Sweeps (BD, num_warps) of ``short_conv_update`` at the fused q|k|v width (3P = 12288) per (T, mode):
    ``decode`` (window updated in place) / ``verify`` (every window staged, state untouched)."""
    from baton.ops.short_conv import naive
    from baton.ops.short_conv import triton as ts

    rows: list[dict[str, Any]] = []
    if verbose:
        print(f"# bench_short_conv on {torch.cuda.get_device_name()}  D={D} W={W} {dtype}  PDL={use_pdl()}", flush=True)
    es = torch.tensor([], dtype=dtype).element_size()
    for T in Ts:
        for mode in ("decode",) if T == 1 else ("verify", "decode"):
            stage = mode == "verify"
            nbytes = es * (2 * T * D + D * (W - 1) + (T * D * (W - 1) if stage else D * (W - 1)))
            R = _rotation(nbytes, min_sets=64)
            sets = [dict(x=torch.randn(T, D, device="cuda", dtype=dtype), w=torch.randn(D, W, device="cuda"),
                         s=torch.randn(D, W - 1, device="cuda", dtype=dtype),
                         win=torch.empty(T, D, W - 1, device="cuda", dtype=dtype),
                         y=torch.empty(T, D, device="cuda", dtype=dtype)) for _ in range(R)]
            d0 = sets[0]
            s_ref, s_tri = d0["s"].clone(), d0["s"].clone()
            w_ref, w_tri = torch.zeros_like(d0["win"]), torch.zeros_like(d0["win"])
            y_ref = naive.short_conv_update(d0["x"], d0["w"], s_ref, w_ref)
            y_tri = ts.short_conv_update(d0["x"], d0["w"], s_tri, w_tri)
            err = max((y_ref.float() - y_tri.float()).abs().max().item(), (s_ref - s_tri).abs().max().item(),
                      (w_ref - w_tri).abs().max().item())
            best: tuple[float, int, int] | None = None
            for bd in block_ds:
                for nw in warps:
                    us = _graph_us([lambda d=d, bd=bd, nw=nw, stage=stage: ts.short_conv_update(
                        d["x"], d["w"], d["s"], d["win"] if stage else None, not stage, out=d["y"], block_d=bd,
                        num_warps=nw) for d in sets], reps)
                    rows.append(dict(name="short_conv", T=T, mode=mode, bd=bd, num_warps=nw, us=us, bytes=nbytes,
                                     gbps=nbytes / us / 1e3, err=err))
                    if verbose:
                        print(f"short_conv T={T:<3} {mode:<7} BD={bd:<4} nw={nw:<2} {us:8.2f} us "
                              f"{nbytes / us / 1e3:7.1f} GB/s  err={err:.2e}", flush=True)
                    if best is None or us < best[0]:
                        best = (us, bd, nw)
            if verbose and best is not None:
                print(f"  best T={T} {mode}: BD={best[1]} num_warps={best[2]} {best[0]:.2f} us", flush=True)
    return rows


def bench_conv_kda(
    Ts: tuple[int, ...] = (1, 6, 17),
    configs: tuple[tuple[int, int], ...] = ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4)),
    H: int = 32,
    K: int = 128,
    V: int = 128,
    W: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    lower_bound: float = -5.0,
    reps: int = 20,
    verbose: bool = True,
) -> list[dict[str, Any]]:
    """The layer's non-prefill KDA core as it was (``short_conv_update``, then ``kda_recurrent_fused`` with the output
    norm: 2 launches) against the fused form (``kda_recurrent_fused`` with ``conv_weight``: 1 launch), per T
    (T = 1 decode: persistent state and window updated; T > 1 verify: both staged per position) and (BV, warps)."""
    from baton.ops.kda import naive
    from baton.ops.kda import triton as tk
    from baton.ops.short_conv import triton as ts

    assert torch.cuda.is_available(), "bench_conv_kda needs CUDA"
    rows: list[dict[str, Any]] = []
    D = 2 * H * K + H * V
    if verbose:
        print(f"# bench_conv_kda on {torch.cuda.get_device_name()}  H={H} K={K} V={V} W={W} {dtype}  PDL={use_pdl()}",
              flush=True)
    for T in Ts:
        stage = T > 1
        mode = "verify" if stage else "decode"
        nbytes = _kda_state_bytes(T, H, K, V, mode)
        sets = []
        for i in range(_rotation(nbytes)):
            d = _kda_inputs(T, H, K, V, dtype, seed=i)
            d.update(cw=0.5 * torch.randn(D, W, device="cuda").to(dtype),
                     cs=torch.randn(D, W - 1, device="cuda").to(dtype),
                     win=torch.empty(T, D, W - 1, device="cuda", dtype=dtype),
                     y=torch.empty(T, D, device="cuda", dtype=dtype))
            d["qkv"] = torch.cat([d["q"].reshape(T, -1), d["k"].reshape(T, -1), d["v"].reshape(T, -1)], -1)
            sets.append(d)

        def call(d: dict[str, torch.Tensor], bv: int, nw: int, fused: bool, ref: bool = False, T: int = T,
                 stage: bool = stage) -> torch.Tensor:
            rec = naive.kda_recurrent_fused if ref else tk.kda_recurrent_fused
            kw = {} if ref else dict(block_v=bv, num_warps=nw)
            os_, win = (d["out_states"], d["win"]) if stage else (None, None)
            if fused:
                q, k, v = d["q"], d["k"], d["v"]
                kw.update(conv_weight=d["cw"], conv_state=d["cs"], conv_windows=win)
            else:
                y = ts.short_conv_update(d["qkv"], d["cw"], d["cs"], win, not stage, out=d["y"])
                q, k, v = (z.view(T, H, -1) for z in y.split([H * K, H * K, H * V], -1))
            return rec(q, k, v, d["f"], d["b"], d["A_log"], d["dt_bias"], lower_bound, d["state"], None, os_,
                       not stage, d["w"], d["gate"], out=d["o"], **kw)

        d0 = sets[0]
        keep = {n: d0[n].clone() for n in ("state", "cs")}
        o_ref = call({**d0, "state": keep["state"].clone(), "cs": keep["cs"].clone(), "o": d0["o"].clone(),
                      "out_states": d0["out_states"].clone(), "win": d0["win"].clone()}, 0, 0, True, ref=True).clone()
        for bv, nw in configs:
            o_f = call({**d0, "state": keep["state"].clone(), "cs": keep["cs"].clone()}, bv, nw, True).clone()
            err = (o_f.float() - o_ref.float()).abs().max().item()
            for fused in (False, True):
                us = _graph_us([lambda d=d, bv=bv, nw=nw, fused=fused: call(d, bv, nw, fused) for d in sets], reps)
                name = "fused conv+kda+norm" if fused else "short_conv | kda+norm"
                rows.append(dict(name=name, T=T, mode=mode, bv=bv, num_warps=nw, us=us, err=err))
                if verbose:
                    print(f"{name:<22} T={T:<3} {mode:<7} BV={bv:<4} nw={nw:<2} {us:8.2f} us  err={err:.2e}",
                          flush=True)
        del sets
    return rows


if __name__ == "__main__":
    import sys

    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("all", "kda"):
        bench_kda()
    if which in ("all", "conv"):
        bench_short_conv()
    if which in ("all", "fused"):
        bench_conv_kda()
