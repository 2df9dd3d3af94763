#!/usr/bin/env python3
"""The bf16 GEMM2 (y = h W2^T, scattered to routed rows): the persistent warp-specialised Gluon kernel
(`kernels.bf16_rows_ws_gluon`) against the Triton kernel at the config the table ships for the shape
(`grouped_gemm`), same operands, same process (needs CUDA). The question: does the structure that won
1.08-1.24x for the block-FP8 row GEMMs help bf16 too?

At Qwen3-30B-A3B and 235B-A22B (T=16384, K=8, E=128) and Mixtral-like (T=8192, K=2, E=8, D=4096,
H=14336), random top-k routing, fresh random bf16 operands. Outputs are NaN-filled first
(TITAN_MEGAMOE_POISON=1) for the checks: each Gluon variant against the Triton kernel (bitwise-equal
fraction) and both against an fp32 product on the rows of three experts (every element within one bf16
rounding, plus fp32 summation slack); a variant that fails is reported "WRONG" and not timed. Times are
`triton.testing.do_bench` medians (us), TFLOP/s = 2*N*H*D; `cublas_dense_*` is one dense [N, H] x [H, D]
matmul of the same FLOPs (torch, cuBLAS): a ceiling, no grouping. Writes JSON (environment, rows) to --out.

    python scripts/bench_bf16_gluon.py --out docs/results     # under a minute on an H100, compiles included
    python scripts/bench_bf16_gluon.py --shapes 30b --variants 0 2         # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8_gluon import time_against_triton  # noqa: E402
from bench_layer import environment, result_path  # noqa: E402

from titan_megamoe.kernels import grouped_gemm as gg  # noqa: E402
from titan_megamoe.kernels.configs import TileConfig, override_tile_config, tile_config  # noqa: E402
from titan_megamoe.kernels.routing_meta import build_routing_plan  # noqa: E402

SHAPES = {"30b": (16384, 8, 128, 2048, 768), "235b": (16384, 8, 128, 4096, 1536),
          "mixtral": (8192, 2, 8, 4096, 14336)}  # T, K, E, D, H
VARIANTS = [(256, 4), (256, 3), (128, 4), (128, 3)]  # block_n, stages (block_m 128: two consumers of 64 rows)


def within_bf16_rounding(out: torch.Tensor, exact: torch.Tensor) -> bool:
    """Every element of a bf16 output within half a bf16 ulp (2^-8 relative) of the fp32 product, plus
    slack for fp32 sums taken in another order."""
    return bool(((out.float() - exact).abs() <= 2**-8 * exact.abs() + 1e-5 * exact.abs().max()).all())


def bench_shape(shape, a, do_bench, rows_out, save):
    T, K, E, D, H = SHAPES[shape]
    N = T * K
    ids = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :K]
    plan = build_routing_plan(ids, E, 128)
    off = plan.offsets_E1.tolist()
    order = plan.order_N.long()
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16) / H**0.5
    flop = 2 * N * H * D

    # fp32 oracle on three experts' rows, in routed-row order
    experts = sorted({0, E // 2, E - 1})
    sorted_rows = torch.cat([torch.arange(off[e], off[e + 1], device="cuda") for e in experts])
    exact = torch.cat([h[off[e]:off[e + 1]].float() @ w2[e].float().T for e in experts])
    out_rows = order[sorted_rows]

    shipped = tile_config("gemm2", D, H, "bf16")
    assert not shipped.gluon, f"the table now ships the Gluon kernel for {shape}; pin the Triton config here"

    def triton_call():
        with override_tile_config("gemm2", shipped):
            return gg.expert_down_proj(h, w2, plan, torch.bfloat16, "bf16")

    os.environ["TITAN_MEGAMOE_POISON"] = "1"
    ref = triton_call()
    torch.cuda.synchronize()
    os.environ.pop("TITAN_MEGAMOE_POISON")
    row = {"shape": shape, "kernel": "gemm2", "T": T, "K": K, "E": E, "D": D, "H": H, "N": N,
           "triton_config": shipped.to_record(), "triton_nan": bool(ref.isnan().any()),
           "triton_within_bf16_rounding": within_bf16_rounding(ref[out_rows], exact)}
    t_us = do_bench(triton_call, warmup=10, rep=200) * 1e3
    row.update(triton_us=t_us, triton_tflops=flop / (t_us * 1e-6) / 1e12)
    dense_a, dense_b = h, w2[0]
    c_us = do_bench(lambda: dense_a @ dense_b.T, warmup=10, rep=200) * 1e3
    row.update(cublas_dense_us=c_us, cublas_dense_tflops=flop / (c_us * 1e-6) / 1e12)
    print(f"{shape} gemm2 bf16: triton {t_us:.1f} us ({row['triton_tflops']:.0f} TFLOP/s, block_n {shipped.block_n}, "
          f"{shipped.num_stages} stages, group_m {shipped.group_m}); cuBLAS dense {c_us:.1f} us "
          f"({row['cublas_dense_tflops']:.0f} TFLOP/s)", flush=True)
    row["gluon"] = []
    group_m = shipped.group_m if a.group_m is None else a.group_m
    for block_n, stages in (VARIANTS if a.variants is None else [VARIANTS[i] for i in a.variants]):
        rec = {"block_n": block_n, "stages": stages, "group_m": group_m}
        cfg = TileConfig(128, block_n, 64, 8, stages, tma=True, warp_specialize=True, gluon=True, group_m=group_m)
        name = f"  gluon n{block_n} s{stages} g{group_m}"
        try:
            def call(cfg=cfg):
                with override_tile_config("gemm2", cfg):
                    return gg.expert_down_proj(h, w2, plan, torch.bfloat16, "bf16")

            os.environ["TITAN_MEGAMOE_POISON"] = "1"
            try:
                out = call()
                torch.cuda.synchronize()
            finally:
                os.environ.pop("TITAN_MEGAMOE_POISON")
            rec["nan"] = bool(out.isnan().any())
            rec["bitwise_equal_fraction"] = float((out.view(torch.int16) == ref.view(torch.int16)).float().mean())
            rec["max_abs_diff_vs_triton"] = float((out.float() - ref.float()).abs().max())
            rec["within_bf16_rounding"] = within_bf16_rounding(out[out_rows], exact)
            rec["ok"] = ok = not rec["nan"] and rec["within_bf16_rounding"]
            timing = time_against_triton(rec, call, do_bench, flop, t_us) if ok else "WRONG, not timed"
            print(f"{name}: {timing}; bitwise {rec['bitwise_equal_fraction']:.4f}, max abs diff "
                  f"{rec['max_abs_diff_vs_triton']:.2e}", flush=True)
        except Exception as e:  # a variant that fails to compile or launch is reported, the rest still run
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{name}: {rec['error']}", flush=True)
        row["gluon"].append(rec)
    rows_out.append(row)
    save()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", type=int, default=None,
                    help=f"indices into VARIANTS (block_n, stages) {VARIANTS} (default: all)")
    ap.add_argument("--group-m", type=int, default=None,
                    help="the Gluon kernel's item groups down each column block (default: the Triton config's)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_bf16_gluon.py needs a CUDA GPU")
    from triton.testing import do_bench

    torch.manual_seed(0)
    rows_out = []
    path = result_path(a.out, "bench_bf16_gluon")

    def save():  # after every shape: a run cut short by a time limit keeps what it measured
        with open(path, "w") as f:
            json.dump({"environment": environment(), "rows": rows_out}, f, indent=1)
    for shape in a.shapes:
        bench_shape(shape, a, do_bench, rows_out, save)
        torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
