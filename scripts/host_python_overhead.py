#!/usr/bin/env python3
"""The Python time of one `titan_megamoe.moe` forward (no grad) on CPU, with every Triton launch stubbed out.

On a GPU host the time before GEMM1 starts is host time, but timing it there mixes in the GPU and the
machine's clock drift (scripts/host_overhead.py saw +-30% between runs of unchanged code). Here the
kernels are Triton-interpreter functions whose launch returns at once and the device assert is a no-op,
so what is timed is only the package's Python (validation, recipe, routing-plan bookkeeping, launcher
argument handling) plus the torch ops it issues on CPU (the sort, allocations). Compare revisions by
running it with each on PYTHONPATH:

    PYTHONPATH=old_checkout python3 scripts/host_python_overhead.py --out DIR
    python3 scripts/host_python_overhead.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels become stub-able Python

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=5, type=int, metavar=("T", "D", "H", "E", "K"), default=[256, 2048, 768, 128, 8])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="docs/results")
    a = ap.parse_args()
    interp.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)
    torch._assert_async = lambda *args, **kwargs: None  # the stubbed routing kernel writes no ids-ok flag
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import titan_megamoe
    from moe_cases import make_case

    from titan_megamoe.ab.environment import git_commit

    inputs = make_case(*a.shape, "random").inputs()

    def call():
        with torch.no_grad():
            titan_megamoe.moe(*inputs, backend="triton")

    for _ in range(20):
        call()
    blocks = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            call()
        blocks.append((time.perf_counter() - t0) / a.calls * 1e6)
    commit = git_commit() or {}
    res = {"package": os.path.dirname(titan_megamoe.__file__), "commit": commit.get("commit"),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "shape_TDHEK": a.shape,
           "torch": torch.__version__, "us_per_call_median": statistics.median(blocks), "us_per_call_blocks": blocks}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"host_python_{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}\n{res['package']} (commit {res['commit']}): {res['us_per_call_median']:.1f} us/call")


if __name__ == "__main__":
    main()
