#!/usr/bin/env python3
"""Where the fused layer's host time goes at small T: inside our Triton launches or around them (CUDA GPU).

`scripts/host_overhead.py` says whether a layer call is host- or GPU-bound; this script splits the host
time of one fused layer forward+backward (30B-A3B shape, `--case`, TorchTitan layer with the fused router):

  split:    wall time per call over --calls back-to-back calls, and the part of it spent inside
            `kernels.launch.launch` per kernel; then the same calls with every launch of ours stubbed out
            (nothing launched, the call synchronised after each one so no queue builds up): the host
            time of everything else (torch ops, allocations, autograd, the harness). The stubbed calls
            reuse the previous calls' buffers, so the torch ops around the kernels see valid routing.
  segments: per launch, the time in `_FastLaunch._key` (the specialization summary) and in the rest of
            `_FastLaunch.__call__` (the argument list, and `compiled.run`: Triton's launcher, with TMA
            descriptor encoding, argument packing and cuLaunchKernelEx).

    python scripts/host_launches.py --precision bf16,fp8
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import CASES, build_layers, run_fwd_bwd  # noqa: E402
from host_python import launching_modules  # noqa: E402

from titan_megamoe.kernels import launch as launch_module  # noqa: E402

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

    modules = launching_modules()
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
    real_call, real_key = fast.__call__, fast._key
    acc = collections.defaultdict(lambda: [0.0, 0.0, 0])  # per kernel: in _key, in the whole call, launches

    def key(self, device, args, kwargs):
        t = time.perf_counter()
        try:
            return real_key(self, device, args, kwargs)
        finally:
            acc[self.kernel.fn.__name__][0] += time.perf_counter() - t

    def call(self, grid, args, kwargs):
        t = time.perf_counter()
        real_call(self, grid, args, kwargs)
        a = acc[self.kernel.fn.__name__]
        a[1] += time.perf_counter() - t
        a[2] += 1

    fast.__call__, fast._key = call, key
    try:
        for _ in range(10):
            run_fwd_bwd(layer, x, dout)
        torch.cuda.synchronize()
        acc.clear()
        for _ in range(calls):
            run_fwd_bwd(layer, x, dout)
        torch.cuda.synchronize()
    finally:
        fast.__call__, fast._key = real_call, real_key
    print("  us per launch: _key, the rest of the launch (argument list, stream, compiled.run)")
    for name, (k, whole, c) in sorted(acc.items(), key=lambda kv: -kv[1][1] / kv[1][2]):
        print(f"    {k / c * 1e6:6.1f} {(whole - k) / c * 1e6:6.1f}  x{c // calls}  {name}")


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
