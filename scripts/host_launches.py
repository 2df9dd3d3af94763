#!/usr/bin/env python3
"""Where the fused layer's host time goes at small T: inside our Triton launches or around them (CUDA GPU).

`scripts/host_overhead.py` says whether a layer call is host- or GPU-bound; this script splits the host
time of one fused layer forward+backward (30B-A3B shape, `--case`, TorchTitan layer with the fused router):

  split:    wall time per call over --calls back-to-back calls, and the part of it spent inside
            `kernels.launch.launch` per kernel; then the same calls with every launch of ours stubbed out
            (nothing launched, the call synchronised after each one so no queue builds up): the host
            time of everything else (torch ops, allocations, autograd, the harness). The stubbed calls
            reuse the previous calls' buffers, so the torch ops around the kernels see valid routing.
  segments: per launch, the time in `_FastLaunch._key` (the specialization summary), in building the
            argument list, and in `compiled.run` (Triton's launcher: TMA descriptor encoding, argument
            packing, cuLaunchKernelEx).

    python scripts/host_launches.py --precision bf16,fp8
"""

from __future__ import annotations

import argparse
import collections
import copy
import importlib
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import CASES, build_layers, run_fwd_bwd  # noqa: E402

from titan_megamoe.kernels import launch as launch_module  # noqa: E402

# every module that launches through `launch` (each imported the name, so each is patched)
_LAUNCHING_MODULES = ("wgrad", "grouped_gemm", "gemm1_swiglu", "dgrad_swiglu", "dswiglu_fp8_gluon", "quantize",
                      "fp8_rows_gluon", "fp8_rows_ws_gluon", "routing_meta", "router_topk", "sorted_rows",
                      "fp8_gemm1_gluon", "combine", "quantize_gluon")


def split(layer, x, dout, calls: int) -> None:
    real = launch_module.launch
    spent, count = collections.defaultdict(float), collections.Counter()
    stub = [False]

    def timed(kernel, grid, *args, **kwargs):
        t = time.perf_counter()
        if not stub[0]:
            real(kernel, grid, *args, **kwargs)
        spent[kernel.fn.__name__] += time.perf_counter() - t
        count[kernel.fn.__name__] += 1

    modules = [importlib.import_module(f"titan_megamoe.kernels.{m}") for m in _LAUNCHING_MODULES]
    for m in modules:
        m.launch = timed
    try:
        for _ in range(10):
            run_fwd_bwd(layer, x, dout)
        torch.cuda.synchronize()
        for stubbed in (False, True):
            stub[0] = stubbed
            spent.clear()
            count.clear()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                run_fwd_bwd(layer, x, dout)
                if stubbed:
                    torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / calls * 1e6
            torch.cuda.synchronize()
            label = "launches stubbed" if stubbed else "launching"
            print(f"  {label}: {wall:.0f} us/call wall, inside launch() {sum(spent.values()) / calls * 1e6:.0f} us")
            for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
                print(f"    {s / calls * 1e6:7.1f} us  x{count[name] // calls}  {name}")
    finally:
        for m in modules:
            m.launch = real


def segments(layer, x, dout, calls: int) -> None:
    fast = launch_module._FastLaunch
    real_call = fast.__call__
    acc = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])

    def call(self, grid, args, kwargs):  # _FastLaunch.__call__'s fast path, timed in three parts
        kernel = self.kernel
        t0 = time.perf_counter()
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        key = self._key(device, args, kwargs)
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = kernel[grid](*args, **kwargs)
            return
        t1 = time.perf_counter()
        values = list(args)
        for name in self.names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        stream = driver.get_current_stream(device)
        t2 = time.perf_counter()
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, None, None, None, *values)
        t3 = time.perf_counter()
        a = acc[kernel.fn.__name__]
        a[0] += t1 - t0
        a[1] += t2 - t1
        a[2] += t3 - t2
        a[3] += 1

    fast.__call__ = call
    try:
        for _ in range(10):
            run_fwd_bwd(layer, x, dout)
        torch.cuda.synchronize()
        acc.clear()
        for _ in range(calls):
            run_fwd_bwd(layer, x, dout)
        torch.cuda.synchronize()
    finally:
        fast.__call__ = real_call
    print("  us per launch: _key, argument list + stream, compiled.run")
    for name, (k, v, r, c) in sorted(acc.items(), key=lambda kv: -sum(kv[1][:3]) / kv[1][3]):
        print(f"    {k / c * 1e6:6.1f} {v / c * 1e6:6.1f} {r / c * 1e6:6.1f}  x{c // calls}  {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="30b-512", choices=list(CASES))
    ap.add_argument("--precision", default="bf16", help="comma-separated precisions of the fused layer")
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_launches.py measures CUDA launches: run it on a GPU host")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"commit {os.environ.get('TITAN_MEGAMOE_COMMIT', '?')}  case {a.case}")
    _, fused, x = build_layers(*CASES[a.case])
    dout = torch.randn_like(x)
    for p in a.precision.split(","):
        layer = copy.deepcopy(fused)
        layer.experts.precision = p
        print(f"== {p}: split")
        split(layer, x, dout, a.calls)
        print(f"== {p}: segments")
        segments(layer, x, dout, a.calls)


if __name__ == "__main__":
    main()
