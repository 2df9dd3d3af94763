#!/usr/bin/env python3
"""Host time per call of each stage of the MoE layer forward, stock and fused (needs a CUDA GPU).

A synchronised layer call cannot start its first long kernel before the host has issued everything in
front of it, so host time before GEMM1 shows up as GPU idle time (scripts/profile_layer.py finds it).
This script measures that host time directly: wall time per call over a block of calls is the host's
cost where the GPU keeps up with the host. Where it does not, the launch queue fills, the host waits for
the GPU, and the wall time is the GPU's: so each stage's GPU time is measured too (`gpu_us`: calls queued
behind a sleep kernel, then run back to back), and the larger of the two is what the wall time shows.
At 30B-A3B T=512 the weights alone (read forward and backward, gradients written: ~3.6 GB) take ~1.1 ms
at an H100's bandwidth, so the forward+backward rows there need the GPU column to be read.
Stages are timed alone, then the whole layer, forward and forward+backward, in each --precision (the
fused layer's; "stock" rows are bf16). Prints microseconds per call (median of --repeats blocks of
--calls calls; GPU: of --gpu-calls) and writes JSON.

Why forward+backward and FP8: at 30B-A3B T=512 the layer is host-bound (an H100, 2026-12-06: bf16 0.98x
stock back-to-back, fp8 0.64x our bf16), and the backward's host time had not been measured.

    python scripts/host_overhead.py --tokens 256
    python scripts/host_overhead.py --tokens 512 --precision bf16,fp8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import build_layers, environment, parse_precisions, result_path, run_fwd_bwd  # noqa: E402


def host_us(fn, calls, repeats):
    fn()
    torch.cuda.synchronize()
    blocks = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        blocks.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(blocks)


def gpu_us(fn, calls, repeats):
    """GPU time per call with no host gaps between kernels, or None where it cannot be told apart from the host's.

    The calls are queued behind a sleep kernel, so once it ends the GPU runs them back to back; timed with CUDA
    events. If the GPU had already reached the start event when the host finished queuing (a call that waits
    for the GPU, or a sleep too short), the sleep is made longer and the block rerun; a call that still gets
    there (it synchronises with the device) gives None. Few calls per block: a queue of more launches than the
    driver holds would make the host wait for the GPU."""
    fn()
    torch.cuda.synchronize()
    times, cycles = [], 50_000_000  # ~25-30 ms at Hopper clocks
    for _ in range(repeats):
        for _attempt in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            late = start.query()  # True: the GPU was idle or waiting before everything was queued
            torch.cuda.synchronize()
            if not late:
                times.append(start.elapsed_time(end) * 1e3 / calls)
                break
            cycles *= 4
        else:
            return None
    return statistics.median(times)


def stages(stock, fused, x):
    import triton
    import triton.language as tl

    from titan_megamoe.kernels.combine import combine
    from titan_megamoe.kernels.configs import row_block_m
    from titan_megamoe.kernels.gemm1_swiglu import gemm1_swiglu
    from titan_megamoe.kernels.grouped_gemm import expert_down_proj
    from titan_megamoe.kernels.routing_meta import build_routing_plan
    bf = torch.bfloat16
    from titan_megamoe.ops import moe
    from titan_megamoe.router import topk_route

    @triton.jit
    def _empty_kernel(p, n, BLOCK: tl.constexpr):
        tl.store(p + tl.arange(0, BLOCK), 0, mask=tl.arange(0, BLOCK) < n)

    T, D = x.shape[-2:]
    x2 = x.view(-1, D)
    scores, ids, _ = stock.router(x2, stock.expert_bias)
    E = stock.experts.w1.shape[0]
    K = ids.shape[1]
    w1, w2, w3 = (p.data for p in (fused.experts.w1, fused.experts.w2, fused.experts.w3))
    plan = build_routing_plan(ids, E, row_block_m())
    g, u, h = gemm1_swiglu(x2, w1, w3, plan, bf, "bf16")
    y = expert_down_proj(h, w2, plan, bf, "bf16")
    s32 = scores.float()
    scratch = torch.empty(16, device=x.device, dtype=torch.int32)
    x_req = x.detach().requires_grad_(True)
    xs_req = x2.detach().requires_grad_(True)
    dout = torch.randn_like(x)
    return {
        "torch.empty (reference point)": lambda: torch.empty(16, device=x.device),
        "empty Triton kernel launch": lambda: _empty_kernel[(1,)](scratch, 16, BLOCK=16),
        "stock router": lambda: stock.router(x2, stock.expert_bias),
        "fused router (gate + topk_route)": lambda: topk_route(stock.router.gate(x2), stock.expert_bias, K),
        "routing plan (build_routing_plan)": lambda: build_routing_plan(ids, E, row_block_m()),
        "gemm1_swiglu launch": lambda: gemm1_swiglu(x2, w1, w3, plan, bf, "bf16"),
        "gemm2 launch": lambda: expert_down_proj(h, w2, plan, bf, "bf16"),
        "combine launch": lambda: combine(y, s32, K, torch.bfloat16),
        "titan_megamoe.moe, no grad": lambda: _no_grad(moe, x2, ids, scores, w1, w2, w3),
        "titan_megamoe.moe, autograd": lambda: moe(xs_req, ids, scores, w1, w2, w3),
        "stock MoE layer forward": lambda: stock(x_req),
        "stock MoE layer forward+backward": lambda: run_fwd_bwd(stock, x, dout),
    }


def layer_stages(fused, x, precisions):
    """The fused layer's forward and forward+backward in each precision (a copy per precision, as
    bench_layer.py makes them), and titan_megamoe.moe's forward+backward alone (the stock router's choice)."""
    import copy

    from titan_megamoe.ops import moe

    D = x.shape[-1]
    x2 = x.view(-1, D)
    scores, ids, _ = fused.router(x2, fused.expert_bias)  # TorchTitan's router module (kept beside the fused one)
    x_req = x.detach().requires_grad_(True)
    dout = torch.randn_like(x)
    rows = {}
    for p in precisions:
        layer = copy.deepcopy(fused)
        layer.experts.precision = p
        w1, w2, w3 = (w.detach().requires_grad_(True) for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3))
        xs_req, s_req = x2.detach().requires_grad_(True), scores.detach().requires_grad_(True)

        def op_fwd_bwd(p=p, w=(w1, w2, w3), xs=xs_req, s=s_req):  # every input's gradient, as in training
            for t in (xs, s, *w):
                t.grad = None
            moe(xs, ids, s, *w, precision=p).backward(dout.view(-1, D))

        rows[f"titan_megamoe.moe forward+backward [{p}]"] = op_fwd_bwd
        rows[f"fused MoE layer forward [{p}]"] = lambda layer=layer: layer(x_req)
        rows[f"fused MoE layer forward+backward [{p}]"] = lambda layer=layer: run_fwd_bwd(layer, x, dout)
    return rows


def _us(value):
    return "-" if value is None else f"{value:.1f}"


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--shape", nargs=4, type=int, metavar=("D", "H", "E", "K"), default=[2048, 768, 128, 8])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--gpu-calls", type=int, default=5,
                    help="calls per block of the GPU-time measurement (queued behind a sleep kernel)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--precision", default="bf16",
                    help="comma-separated precisions of the fused layer's rows (e.g. bf16,fp8); default bf16")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--cprofile", type=int, default=0, metavar="ROWS",
                    help="also profile the fused layer forward's Python with cProfile, print ROWS functions")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead.py needs a CUDA GPU")
    D, H, E, K = a.shape
    precisions = parse_precisions(a.precision, ap)
    stock, fused, x = build_layers(a.tokens, D, H, E, K, "softmax")
    timed = {**stages(stock, fused, x), **layer_stages(fused, x, precisions)}
    rows, gpu_rows = {}, {}
    for name, fn in timed.items():
        rows[name] = host_us(fn, a.calls, a.repeats)
        gpu_rows[name] = gpu_us(fn, a.gpu_calls, a.repeats) if x.is_cuda else None
        print(f"  {name}: {rows[name]:.1f} us/call, GPU {_us(gpu_rows[name])}", flush=True)  # progress: FP8 compiles
    env = environment()
    path = result_path(a.out, "host_overhead")
    with open(path, "w") as f:
        json.dump({"environment": env, "tokens": a.tokens, "shape": a.shape, "precisions": precisions,
                   "host_us_per_call": rows, "gpu_us_per_call": gpu_rows}, f, indent=1)
    print(f"wrote {path}\n{env['gpu']}  torch {env['torch']}  commit {env['commit']}  T={a.tokens} D,H,E,K={a.shape}")
    print(f"{'':<44}{'wall':>9}{'GPU':>9}  us per call; wall = max(host, GPU) once the launch queue fills")
    for name, us in rows.items():
        print(f"{name:<44}{us:>9.1f}{_us(gpu_rows[name]):>9}")
    if a.cprofile:
        import cProfile
        import pstats

        x_req = x.detach().requires_grad_(True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fused(x_req)
        prof.disable()
        torch.cuda.synchronize()
        print(f"\ncProfile of {a.calls} fused layer forwards (tottime = time in the function itself):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
