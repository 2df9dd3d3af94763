#!/usr/bin/env python3
"""Offline tile-config tuning on the GPU; writes titan_megamoe/kernels/tuned_configs.json.

Times every candidate of every kernel in isolation on one shape with random top-k routing
(triton.testing.do_bench, median), keeps the fastest, and merges it into the shipped table keyed by
"DxH". Run it in small batches (--kernels) inside a time limit: each candidate compiles once.

    python scripts/tune_kernels.py --shape 2048 768 128 8 16384 --write
    python scripts/tune_kernels.py --precision fp8 --shape 2048 768 128 8 16384 --write   # block FP8
    python scripts/tune_kernels.py --merge docs/results/tune_4096x1536_*.json   # table from a recorded run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from dataclasses import replace

import torch
import triton
import triton.testing

from titan_megamoe.ab.environment import git_commit
from titan_megamoe.kernels import configs
from titan_megamoe.kernels.configs import TileConfig, override_tile_config
from titan_megamoe.kernels.dgrad_swiglu import dgrad_swiglu
from titan_megamoe.kernels.gemm1_swiglu import gemm1_swiglu
from titan_megamoe.kernels.grouped_gemm import expert_down_proj, expert_h_grad, expert_input_grad
from titan_megamoe.kernels.quantize import quantize_sorted_rows, quantize_token_tiles, quantize_weight_pair
from titan_megamoe.kernels.routing_meta import build_routing_plan
from titan_megamoe.kernels.wgrad import expert_wgrad_w2, expert_wgrad_w2_fp8, expert_wgrad_w13, expert_wgrad_w13_fp8

M = configs.ROW_BLOCK_M
T_ = dict(tma=True)
SPLIT = dict(split=True)
WS = dict(tma=True, warp_specialize=True)
C = TileConfig
CANDIDATES = {
    "gemm1_swiglu": [C(M, 64, 64, 4, 4), C(M, 64, 64, 8, 4), C(M, 128, 64, 8, 3), C(M, 128, 64, 8, 4),
                     C(M, 128, 32, 8, 4), C(M, 128, 64, 8, 5),
                     C(M, 128, 64, 8, 3, **T_), C(M, 128, 64, 8, 4, **T_), C(M, 128, 32, 8, 4, **T_)],
    "gemm2": [C(M, 128, 64, 8, 3), C(M, 128, 64, 8, 4), C(M, 256, 64, 8, 3), C(M, 128, 64, 4, 4),
              C(M, 64, 64, 4, 4), C(M, 256, 32, 8, 4),
              C(M, 256, 64, 8, 3, **T_), C(M, 256, 64, 8, 4, **T_), C(M, 128, 64, 8, 4, **T_),
              C(M, 256, 64, 8, 3, **WS), C(M, 128, 64, 8, 4, **WS)],
    # dgrad's BLOCK_N is per accumulator (two accumulators: a program covers 2*BLOCK_N columns). 16 warps
    # (four warpgroups) halve the registers each thread holds for 2 x [128, 128] accumulators plus the
    # dSwiGLU epilogue, where 8 warps spill; split: the GEMM stores q and an elementwise pass does the
    # dSwiGLU, so GEMM1-sized tiles fit
    "dgrad_swiglu": [C(M, 64, 64, 8, 4), C(M, 64, 64, 8, 3), C(M, 128, 64, 16, 3), C(M, 128, 64, 16, 4),
                     C(M, 128, 32, 16, 4), C(M, 64, 64, 16, 4),
                     C(M, 128, 64, 8, 3, **SPLIT), C(M, 128, 64, 8, 4, **SPLIT), C(M, 128, 32, 8, 4, **SPLIT)],
    # weight gradients: the gathered row index costs the pipeliner a stage, so 5 stages give 3 data
    # buffers; tma: the expert-sorted operand (s*h for w2, dg/du for w13) through TMA
    "wgrad_w2": [C(128, 128, 64, 8, 3), C(128, 128, 64, 8, 5), C(128, 128, 32, 8, 5), C(128, 256, 64, 8, 4),
                 C(64, 256, 64, 8, 5), C(128, 128, 32, 8, 6), C(128, 128, 32, 8, 4), C(128, 256, 32, 8, 5),
                 C(256, 128, 32, 8, 5), C(128, 256, 32, 8, 5, **T_), C(128, 128, 32, 8, 5, **T_),
                 C(128, 128, 32, 8, 6, **T_), C(128, 128, 64, 8, 4, **T_)],
}
# dx: GEMM2's pointer-load candidates, then its own TMA and warp-specialised ones
CANDIDATES["dx"] = CANDIDATES["gemm2"][:6] + [C(M, 256, 32, 8, 4, **T_), C(M, 256, 64, 8, 3, **T_),
                                              C(M, 128, 64, 8, 4, **T_), C(M, 256, 64, 8, 3, **WS),
                                              C(M, 256, 32, 8, 4, **WS)]
CANDIDATES["wgrad_w13"] = CANDIDATES["wgrad_w2"]

# block FP8: BLOCK_K is one 128-wide scale block. The block-scaled main loop waits for each K block's MMA
# before scaling it into the accumulator, so a program's tensor cores idle during that step; programs of
# one warpgroup (64 rows, 4 warps) hold half the registers, and several of them per multiprocessor cover
# each other's scaling steps. Row kernels: 64-row halves of the plan's tiles against whole 128-row tiles.
# GEMM1 always covers 2 x 64 columns (one scale block of h); dgrad_swiglu is its GEMM (q, stored sorted)
F = configs.FP8_BLOCK
# (the row kernels' weight tiles stay inside one 128-column scale block: BLOCK_N <= 128)
_FP8_ROWS = [C(64, 128, F, 4, 3, **T_), C(64, 128, F, 4, 4, **T_), C(64, 128, F, 4, 5, **T_), C(M, 128, F, 8, 3, **T_),
             C(M, 128, F, 8, 4, **T_)]
_FP8_WGRAD = [C(64, 128, F, 4, 3, **T_), C(64, 128, F, 4, 4, **T_), C(64, 128, F, 4, 5, **T_), C(64, 256, F, 8, 3, **T_),
              C(128, 128, F, 8, 3, **T_), C(128, 128, F, 8, 4, **T_)]
CANDIDATES_FP8 = {
    "gemm1_swiglu": [C(64, 64, F, 4, 3, **T_), C(64, 64, F, 4, 4, **T_), C(64, 64, F, 4, 5, **T_),
                     C(M, 64, F, 8, 3, **T_), C(M, 64, F, 8, 4, **T_)],
    # warp specialisation of the 64-row, 4-warp loops stops Triton 3.6 with an internal assertion
    # (TaskIdPropagation.cpp, docs/results/tune_logs/2026-12-04_fp8_tune_2048x768_a.log): 128 rows only
    "gemm2": _FP8_ROWS + [C(M, 128, F, 8, 3, **WS)],
    "dgrad_swiglu": [replace(c, split=True) for c in _FP8_ROWS],
    "dx": _FP8_ROWS + [C(M, 128, F, 8, 3, **WS)],
    "wgrad_w2": _FP8_WGRAD,
    "wgrad_w13": _FP8_WGRAD,
}


def make_problem(D, H, E, K, T, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")
    bf = torch.bfloat16
    x = torch.randn(T, D, generator=g, dtype=bf, **dev)
    ids = torch.argsort(torch.rand(T, E, generator=g, **dev), dim=1)[:, :K]
    scores = torch.softmax(torch.randn(T, K, generator=g, **dev), dim=1)
    w = lambda *s: (torch.randn(*s, generator=g, **dev) * 0.02).to(bf)  # noqa: E731
    w1, w3, w2 = w(E, H, D), w(E, H, D), w(E, D, H)
    plan = build_routing_plan(ids, E, M)
    g_, u, h = gemm1_swiglu(x, w1, w3, plan, bf, "bf16")
    dout = torch.randn_like(x)
    dg, du, hs, _ = dgrad_swiglu(dout, w2, g_, u, scores.reshape(-1), plan, "bf16")
    return dict(x=x, w1=w1, w2=w2, w3=w3, plan=plan, g=g_, u=u, h=h, dout=dout, dg=dg, du=du, hs=hs,
                s=scores.reshape(-1))


def make_problem_fp8(D, H, E, K, T, seed=0):
    """The block-FP8 operands of every kernel, made by the kernels that make them in training."""
    p = make_problem(D, H, E, K, T, seed)
    plan, bf = p["plan"], torch.bfloat16
    w1q, w2q, w3q = (quantize_weight_pair(p[n]) for n in ("w1", "w2", "w3"))
    x_rows = quantize_sorted_rows(p["x"], plan)
    _, _, h = gemm1_swiglu(x_rows, w1q[0], w3q[0], plan, bf, "fp8", sorted_rows=True)
    dout_rows, dout_tiles = quantize_sorted_rows(p["dout"], plan, with_tiles=True)
    dg, du, (dg_t, du_t, hs_t), _ = dgrad_swiglu(dout_rows, w2q[1], p["g"], p["u"], p["s"], plan, "fp8")
    return dict(plan=plan, w1=w1q, w2=w2q, w3=w3q, x_rows=x_rows, h=h, dout_rows=dout_rows, dg=dg, du=du,
                dout_tiles=dout_tiles, dg_tiles=dg_t, du_tiles=du_t, hs_tiles=hs_t,
                x_tiles=quantize_token_tiles(p["x"], plan))


def kernel_call_fp8(kernel, p):
    plan, bf = p["plan"], torch.bfloat16
    return {
        "gemm1_swiglu": lambda: gemm1_swiglu(p["x_rows"], p["w1"][0], p["w3"][0], plan, bf, "fp8", sorted_rows=True),
        "gemm2": lambda: expert_down_proj(p["h"], p["w2"][0], plan, bf, "fp8"),
        "dgrad_swiglu": lambda: expert_h_grad(p["dout_rows"], p["w2"][1], plan, bf, "fp8"),
        "dx": lambda: expert_input_grad(p["dg"], p["du"], p["w1"][1], p["w3"][1], plan, bf, "fp8"),
        "wgrad_w2": lambda: expert_wgrad_w2_fp8(p["dout_tiles"], p["hs_tiles"], plan, bf),
        "wgrad_w13": lambda: expert_wgrad_w13_fp8(p["dg_tiles"], p["du_tiles"], p["x_tiles"], plan, bf),
    }[kernel]


def kernel_call(kernel, p):
    plan, bf = p["plan"], torch.bfloat16
    return {
        "gemm1_swiglu": lambda: gemm1_swiglu(p["x"], p["w1"], p["w3"], plan, bf, "bf16"),
        "gemm2": lambda: expert_down_proj(p["h"], p["w2"], plan, bf, "bf16"),
        "dgrad_swiglu": lambda: dgrad_swiglu(p["dout"], p["w2"], p["g"], p["u"], p["s"], plan, "bf16"),
        "dx": lambda: expert_input_grad(p["dg"], p["du"], p["w1"], p["w3"], plan, bf, "bf16"),
        "wgrad_w2": lambda: expert_wgrad_w2(p["dout"], p["hs"], plan, bf),
        "wgrad_w13": lambda: expert_wgrad_w13(p["dg"], p["du"], p["x"], plan, bf),
    }[kernel]


FLOPS_PER_NDH = {"gemm1_swiglu": 4, "gemm2": 2, "dgrad_swiglu": 2, "dx": 4, "wgrad_w2": 2, "wgrad_w13": 4}


def bench(fn):
    """(median ms, the outputs of the first call): a candidate is only timed with its result kept."""
    out = fn()  # compiles
    torch.cuda.synchronize()
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), outs


# candidates differ in summation order only: more than this relative L2 difference from the kernel's
# first candidate means a wrong kernel, which must not win on speed
MAX_REL_DIFF = 1e-2


def rel_diff(got, ref) -> float:
    return max(((g.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item() for g, r in zip(got, ref))


def merge_run(run: dict) -> None:
    """Write the fastest config of each kernel in a recorded run (this script's every-candidate JSON)
    into tuned_configs.json: the table is always derived from a committed measurement."""
    D, H, E, K, T = run["shape"]
    key = f"{D}x{H}"
    precision = run.get("precision", "bf16")
    table = json.loads(configs.TABLE_PATH.read_text()) if configs.TABLE_PATH.exists() else {"configs": {}, "measured": {}}
    winners = table["configs"].setdefault(precision, {}).setdefault(key, {})
    log = table["measured"].setdefault(precision, {}).setdefault(key, {})
    for kernel in dict.fromkeys(r["kernel"] for r in run["runs"]):
        best = min((r for r in run["runs"] if r["kernel"] == kernel), key=lambda r: r["ms"])
        winners[kernel] = TileConfig.from_record(best["config"]).to_record()
        log[kernel] = {"ms": best["ms"], "tflops": best["tflops"], "T": T, "E": E, "K": K, "gpu": run["gpu"],
                       "date": run["date"][:10], "commit": run.get("commit")}
        print(f"table {precision} {key} {kernel}: {winners[kernel]} ({best['ms']:.3f} ms)")
    configs.TABLE_PATH.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {configs.TABLE_PATH}")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", nargs=5, type=int, metavar=("D", "H", "E", "K", "T"), default=[2048, 768, 128, 8, 16384])
    ap.add_argument("--kernels", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp8"],
                    help="the kernels' operand precision (fp8: block FP8, its own candidates and table entries)")
    ap.add_argument("--write", action="store_true", help="merge the winners into tuned_configs.json")
    ap.add_argument("--merge", nargs="+", metavar="RUN_JSON",
                    help="no GPU work: rebuild table entries from recorded runs (docs/results/tune_*.json)")
    a = ap.parse_args()
    if a.merge:
        for path in a.merge:
            merge_run(json.loads(open(path).read()))
        return
    D, H, E, K, T = a.shape
    fp8 = a.precision == "fp8"
    p = (make_problem_fp8 if fp8 else make_problem)(D, H, E, K, T)
    candidates, call = (CANDIDATES_FP8, kernel_call_fp8) if fp8 else (CANDIDATES, kernel_call)
    nflop = T * K * D * H
    key = f"{D}x{H}"
    commit = git_commit()
    every = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
             "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "shape": a.shape,
             "precision": a.precision, "commit": commit and commit["commit"], "runs": []}
    for kernel in a.kernels:
        results = []
        first_outs = None
        for cfg in candidates[kernel]:
            cand = cfg.to_record()
            t0 = time.time()
            try:
                with override_tile_config(kernel, cfg):
                    ms, outs = bench(call(kernel, p))
            except Exception as e:  # a config can exceed shared memory or registers: skip it, say so
                print(f"  {kernel} {cand}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                continue
            first_outs = first_outs or outs
            if (diff := rel_diff(outs, first_outs)) > MAX_REL_DIFF:
                print(f"  {kernel} {cand}: failed (result differs from the first candidate's, rel. L2 {diff:.1e})",
                      flush=True)
                continue
            tf = FLOPS_PER_NDH[kernel] * nflop / ms / 1e9
            results.append((ms, cand))
            every["runs"].append({"kernel": kernel, "config": cand, "ms": ms, "tflops": tf})
            print(f"  {kernel:<13} {str(tuple(cand.values())):<60} {ms:7.3f} ms {tf:6.0f} TFLOP/s ({time.time() - t0:.0f}s)", flush=True)
        if results:
            ms, best = min(results, key=lambda r: r[0])
            print(f"best {kernel}: {best} {ms:.3f} ms", flush=True)
    if a.write:
        merge_run(every)
        os.makedirs("docs/results", exist_ok=True)
        tag = key if not fp8 else f"{key}_fp8"
        path = f"docs/results/tune_{tag}_{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S')}.json"
        with open(path, "w") as f:
            json.dump(every, f, indent=1)
        print(f"wrote {path} (every candidate)")


if __name__ == "__main__":
    main()
