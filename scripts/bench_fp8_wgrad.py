#!/usr/bin/env python3
"""Block-FP8 expert weight gradients: the persistent warp-specialised Gluon kernel's variants
(`kernels.fp8_wgrad_ws_gluon`: ring stages, DUAL or separate dW1/dW3 items, the tiles stored by the consumers
or through shared memory and TMA) against the Triton kernel, same operands, same process (needs CUDA).

dW2 = dout^T (s*h) and dW1, dW3 = dg^T x, du^T x per expert at Qwen3-30B-A3B and 235B-A22B shapes, T=16384,
K=8, random top-k routing, on token tiles made by the package's own kernels (`tune.problem.make_problem_fp8`).
Outputs are bf16, allocated NaN-filled; each Gluon variant is compared with the Triton kernel's output (bit
for bit, and the largest relative difference): one with NaN left or off by more than bf16 rounding is
reported "WRONG" and not timed. Times are `triton.testing.do_bench` medians (us); TFLOP/s =
2*N*D*H per gradient. Writes JSON (environment, rows) to --out.

    python scripts/bench_fp8_wgrad.py --out docs/results
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

SHAPES = {"30b": (2048, 768, 128, 8, 16384), "235b": (4096, 1536, 128, 8, 16384)}  # D, H, E, K, T
# (name, dual, stages, tma_store); dW2 takes the non-DUAL ones
VARIANTS = [("ws s4", False, 4, False), ("ws s4 tma-store", False, 4, True), ("ws s5 tma-store", False, 5, True),
            ("dual s3", True, 3, False), ("dual s3 tma-store", True, 3, True), ("dual s4", True, 4, False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", type=int, default=None, help="indices into VARIANTS (default: all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_wgrad.py needs a CUDA GPU")
    from triton.testing import do_bench

    from titan_megamoe.kernels.configs import TileConfig, override_tile_config
    from titan_megamoe.kernels.fp8_wgrad_ws_gluon import fp8_wgrad_ws
    from titan_megamoe.kernels.wgrad import expert_wgrad_w2_fp8, expert_wgrad_w13_fp8
    from titan_megamoe.tune.problem import make_problem_fp8

    # the Triton kernel at the config the table ships for dW1/dW3 (2026-12-06) for both gradients
    triton_cfg = TileConfig(128, 128, 128, 8, 3, tma=True)
    variants = VARIANTS if a.variants is None else [VARIANTS[i] for i in a.variants]
    rows_out = []
    path = result_path(a.out, "bench_fp8_wgrad")

    def save():
        with open(path, "w") as f:
            json.dump({"environment": environment(), "triton_config": triton_cfg.to_record(), "rows": rows_out}, f,
                      indent=1)

    for shape in a.shapes:
        D, H, E, K, T = SHAPES[shape]
        p = make_problem_fp8(D, H, E, K, T)
        plan, bf = p["plan"], torch.bfloat16
        N = T * K
        grads = {
            "dW2": (lambda: [expert_wgrad_w2_fp8(p["dout_tiles"], p["hs_tiles"], plan, bf)],
                    (p["dout_tiles"], None, p["hs_tiles"]), (D, H), 1),
            "dW1/dW3": (lambda: list(expert_wgrad_w13_fp8(p["dg_tiles"], p["du_tiles"], p["x_tiles"], plan, bf)),
                        (p["dg_tiles"], p["du_tiles"], p["x_tiles"]), (H, D), 2),
        }
        for name, (triton_call, (A, A2, B), (M, Nc), n_grads) in grads.items():
            flop = 2 * N * M * Nc * n_grads

            def run_triton():
                with override_tile_config("wgrad_w2" if A2 is None else "wgrad_w13", triton_cfg):
                    return triton_call()
            os.environ["TITAN_MEGAMOE_POISON"] = "1"
            ref = run_triton()
            os.environ.pop("TITAN_MEGAMOE_POISON")
            torch.cuda.synchronize()
            t_us = do_bench(run_triton, warmup=10, rep=200) * 1e3
            row = {"shape": shape, "gradient": name, "N": N, "M": M, "Ncols": Nc, "triton_us": t_us,
                   "triton_tflops": flop / (t_us * 1e-6) / 1e12, "triton_nan": any(bool(r.isnan().any()) for r in ref),
                   "gluon": []}
            print(f"{shape} {name}: triton {t_us:.1f} us ({row['triton_tflops']:.0f} TFLOP/s)", flush=True)
            for vname, dual, stages, tma_store in variants:
                if A2 is None and dual:
                    continue
                rec = {"variant": vname, "dual": dual, "stages": stages, "tma_store": tma_store}
                outs = [torch.full((E, M, Nc), float("nan"), dtype=bf, device="cuda") for _ in range(n_grads)]

                def call(outs=outs, dual=dual, kw=dict(stages=stages, tma_store=tma_store)):
                    if A2 is None or dual:
                        fp8_wgrad_ws(A, A2, B, plan, outs, **kw)
                    else:  # dW1 and dW3 as separate launches, each over x's tiles
                        for a_, o in zip((A, A2), outs):
                            fp8_wgrad_ws(a_, None, B, plan, [o], **kw)
                try:
                    call()
                    torch.cuda.synchronize()
                    rec["bitwise_equal"] = all(torch.equal(o.view(torch.int16), r.view(torch.int16))
                                               for o, r in zip(outs, ref))
                    rec["nan"] = any(bool(o.isnan().any()) for o in outs)
                    rec["max_rel_diff_vs_triton"] = max(
                        float(((o.float() - r.float()).abs() / r.float().abs().clamp_min(1e-3)).max())
                        for o, r in zip(outs, ref))
                    if not rec["nan"] and rec["max_rel_diff_vs_triton"] < 2 ** -7:  # within bf16 rounding
                        msg = f"{time_against_triton(rec, call, do_bench, flop, t_us)}, bitwise {rec['bitwise_equal']}"
                    else:
                        msg = "WRONG, not timed"
                except Exception as e:  # a variant that fails is reported, the rest still run
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    msg = rec["error"]
                print(f"  {vname}: {msg}", flush=True)
                row["gluon"].append(rec)
            rows_out.append(row)
            save()
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
