#!/usr/bin/env python3
"""The fused pipeline's host time with every kernel launch stubbed out, on any machine (no GPU needed).

At small T the fused layer is host-bound (docs/kernels.md, 30B-A3B T=512): what the host spends around
the launches (allocations, descriptors, tile configs, plans) is on the step's critical path. This script
runs `pipeline.fused_moe_forward` + `fused_moe_backward` on CPU tensors with the GPU kernels' host code
(the table's tile configs and, for block FP8, the Gluon paths: no TRITON_INTERPRET) and every
`launch` replaced by a counter, so it measures that host code alone: nothing is computed, the outputs
are garbage, the device-side id check and the kernels' CUDA-only input checks are switched off. Times
are this machine's, not a GPU host's: use them to compare two versions of the code, and
`scripts/host_launches.py` on a GPU for the real split.

    env -u TRITON_INTERPRET python scripts/host_python.py --precision bf16,fp8 --cprofile 25
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import sys
import time

import torch


def launching_modules() -> list:
    """Every kernel module that launches through `kernels.launch.launch` (each imported the name, so a
    stand-in must be put into each of them)."""
    import titan_megamoe.kernels as kernels
    from titan_megamoe.kernels import launch as launch_module

    modules = [importlib.import_module(f"titan_megamoe.kernels.{name[:-3]}")
               for name in sorted(os.listdir(os.path.dirname(kernels.__file__))) if name.endswith(".py")]
    return [m for m in modules if m is not launch_module and getattr(m, "launch", None) is launch_module.launch]


def stub_launches() -> list[int]:
    """Replace `launch` in every kernel module with a counter; the returned list holds the count."""
    count = [0]

    def counted(kernel, grid, *args, **kwargs):
        count[0] += 1

    for module in launching_modules():
        module.launch = counted
    return count


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=5, type=int, metavar=("T", "D", "H", "E", "K"), default=[512, 2048, 768, 16, 8],
                    help="tokens, dim, hidden, experts, top-k (E barely matters to host time; 16 keeps memory low)")
    ap.add_argument("--precision", default="bf16,fp8")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--cprofile", type=int, default=0, metavar="ROWS", help="also print ROWS functions by own time")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("host_python.py measures the GPU kernels' host code: run it without TRITON_INTERPRET=1")
    from titan_megamoe.kernels import quantize
    from titan_megamoe.pipeline import fused_moe_backward, fused_moe_forward
    from titan_megamoe.precision import recipe_for

    count = stub_launches()
    quantize._check_input = lambda *args, **kwargs: None  # its CUDA-only check: the tensors here are CPU ones
    torch._assert_async = lambda *args, **kwargs: None  # the plan's id flag is never written here
    T, D, H, E, K = a.shape
    gen = torch.Generator().manual_seed(0)
    x, dout = (torch.randn(T, D, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    scores = torch.rand(T, K, generator=gen)
    w1, w3 = (torch.randn(E, H, D, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    w2 = torch.randn(E, D, H, generator=gen, dtype=torch.bfloat16)
    print(f"T, D, H, E, K = {a.shape}; torch {torch.__version__}; launches stubbed")
    for precision in a.precision.split(","):
        recipe = recipe_for(precision)

        def call():
            out, residuals = fused_moe_forward(x, ids, scores, w1, w2, w3, recipe)
            return fused_moe_backward(dout, x, ids, scores, w1, w2, w3, residuals, recipe)

        for _ in range(3):
            call()
        count[0] = 0
        t = time.perf_counter()
        for _ in range(a.calls):
            call()
        us = (time.perf_counter() - t) / a.calls * 1e6
        print(f"{precision}: {us:.0f} us of host time per forward+backward, {count[0] // a.calls} launches")
        if a.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                call()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
