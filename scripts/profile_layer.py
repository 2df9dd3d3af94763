#!/usr/bin/env python3
"""Where the time goes: per-kernel CUDA time of the stock and fused MoE layers (torch.profiler).

Builds the same layers as scripts/bench_layer.py, profiles --iters calls of forward and of
forward+backward for each arm, and prints per-kernel totals (ms per call) sorted by time, the host time to
enqueue one call (no sync), and the GPU's idle gaps inside one call with the kernels around them, so
launch-bound stretches show up as such.

    python scripts/profile_layer.py --cases 30b-16k 30b-4k
    python scripts/profile_layer.py --cases 30b-16k --precision bf16,fp8 --no-stock

`--ncu`: no torch.profiler (it and Nsight Compute both want the GPU's counters): per arm two warm-up
forward+backward calls, then one between cudaProfilerStart and Stop (`--iters` is ignored), for
`scripts/ncu_layer.py` to profile kernel by kernel.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import CASES, build_layers, run_fwd_bwd  # noqa: E402


def kernel_table(fn, iters: int, top: int) -> str:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(ev.name, [0.0, 0])
            t[0] += ev.device_time_total / 1e3 / iters
            t[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in totals.values())
    lines = [f"  GPU busy {total:.3f} ms/call over {len(rows)} kernels"]
    for name, (ms, n) in rows[:top]:
        lines.append(f"  {ms:8.3f} ms  x{n // iters:<3d} {name[:110]}")
    return "\n".join(lines)


def gap_report(fn, top: int = 6, min_us: float = 10.0, timeline: bool = False) -> str:
    """GPU idle time inside one call: gaps between consecutive kernels, biggest first, with neighbours."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                      if ev.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    if not kernels:
        return "  (no kernels)"
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(kernels, kernels[1:]) if b[0] - a[1] > min_us]
    span = kernels[-1][1] - kernels[0][0]
    lines = [f"  span {span / 1e3:.3f} ms, idle {sum(g[0] for g in gaps) / 1e3:.3f} ms in {len(gaps)} gaps > {min_us:g} us"]
    for us, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {us:8.1f} us idle  after {before[:50]!r}  before {after[:50]!r}")
    if timeline:
        lines.append("  timeline (idle before, kernel time, kernel):")
        prev_end = kernels[0][0]
        for start, end, name in kernels:
            lines.append(f"    {start - prev_end:7.1f} us {end - start:8.1f} us  {name[:90]}")
            prev_end = end
    return "\n".join(lines)


def host_enqueue_ms(fn, iters: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3 / iters, (t2 - t0) * 1e3 / iters


def ncu_call(fn, label: str) -> None:
    """Two warm-up calls (compiles, caches), then the call Nsight Compute is meant to read, between
    cudaProfilerStart and Stop (ncu --profile-from-start off). The window is process-wide, so the backward's
    kernels, launched from autograd's own thread, are in it; an NVTX range of the main thread missed them."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"== {label}: one call under Nsight Compute", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["30b-16k"], choices=list(CASES))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeline", action="store_true", help="list every kernel of one call in launch order")
    ap.add_argument("--precision", default="bf16", help="comma-separated precisions of the fused arm")
    ap.add_argument("--no-stock", action="store_true", help="profile the fused arms only")
    ap.add_argument("--ncu", action="store_true",
                    help="one forward+backward call per arm inside cudaProfilerStart/Stop, for Nsight Compute")
    a = ap.parse_args()
    for name in a.cases:
        stock, fused, x = build_layers(*CASES[name])
        dout = torch.randn_like(x)
        x_req = x.detach().requires_grad_(True)
        arms = [] if a.no_stock else [("stock", stock)]
        for p in a.precision.split(","):
            layer = copy.deepcopy(fused)
            layer.experts.precision = p
            arms.append((f"fused {p}", layer))
        for arm, layer in arms:
            for kind, fn in (("fwd", lambda: layer(x_req)), ("fwd+bwd", lambda: run_fwd_bwd(layer, x, dout))):
                if a.ncu:  # one window per arm: forward+backward (its forward is the forward's kernels)
                    if kind == "fwd+bwd":
                        ncu_call(fn, f"{name} {arm} {kind}")
                    continue
                enq, wall = host_enqueue_ms(fn, 10)
                print(f"== {name} {arm} {kind}: host enqueue {enq:.3f} ms/call, wall {wall:.3f} ms/call")
                print(kernel_table(fn, a.iters, a.top), flush=True)
                print(gap_report(fn, timeline=a.timeline), flush=True)


if __name__ == "__main__":
    main()
