#!/usr/bin/env python3
"""bf16 row GEMMs: the persistent warp-specialised Gluon kernel (`kernels.bf16_rows_ws_gluon`) against the
Triton kernels the package runs today (`kernels.grouped_gemm` at the shipped tile table), same operands, same
process (needs a Hopper GPU).

GEMM2 (y = h W2^T, scattered to routed rows), dgrad's q (q = dout W2, sorted rows) and dx (dg W1 + du W3,
scattered) at Qwen3-30B-A3B and 235B-A22B shapes, T=16384, K=8, random top-k routing, fresh random bf16
operands. Outputs are allocated NaN-filled (TITAN_MEGAMOE_POISON=1) for the checks, which compare each Gluon
variant with the Triton kernel (bitwise-equal fraction, max relative difference) and both with a float64
product on the rows of three experts; a variant whose error against float64 exceeds the Triton kernel's by
more than 1% (or with a NaN) is reported "WRONG" and not timed. Times are `triton.testing.do_bench` medians
(us); TFLOP/s = 2*N*KD*ND per pair. Writes JSON (environment, rows) to --out after every kernel.

    python scripts/bench_bf16_gluon.py --out docs/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import environment, result_path  # noqa: E402

SHAPES = {"30b": (16384, 8, 128, 2048, 768), "235b": (16384, 8, 128, 4096, 1536)}  # T, K, E, D, H
# block_n, stages, group_m
VARIANTS = [(256, 3, 1), (256, 4, 1), (128, 4, 1), (256, 3, 8), (256, 4, 8)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--kernels", nargs="+", default=["gemm2", "dgrad_q", "dx"], choices=["gemm2", "dgrad_q", "dx"])
    ap.add_argument("--variants", nargs="+", type=int, default=None, help="indices into VARIANTS (default: all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_bf16_gluon.py needs a CUDA GPU")
    from triton.testing import do_bench

    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels.bf16_rows_ws_gluon import bf16_row_gemm_ws
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    torch.manual_seed(0)
    rows_out = []
    path = result_path(a.out, "bench_bf16_gluon")

    def save():  # after every kernel: a run cut short by a time limit keeps what it measured
        with open(path, "w") as f:
            json.dump({"environment": environment(), "variants_fields": "block_n, stages, group_m",
                       "rows": rows_out}, f, indent=1)
    for shape in a.shapes:
        T, K, E, D, H = SHAPES[shape]
        N = T * K
        ids = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :K]
        plan = build_routing_plan(ids, E, 128)
        off = plan.offsets_E1.tolist()
        order = plan.order_N.long()
        check = (0, E // 2, E - 1)
        check_rows = torch.cat([torch.arange(off[e], off[e + 1], device="cuda") for e in check])
        w1, w3 = (torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
        w2 = torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16) * 0.02
        dout, h, dg, du = (torch.randn(N, c, device="cuda", dtype=torch.bfloat16) for c in (D, H, H, H))
        bf = torch.bfloat16
        cases = {
            # name: (triton call, gluon kwargs, pairs [(A, B as [E, KD, ND])], ND, sorted)
            "gemm2": (lambda: gg.expert_down_proj(h, w2, plan, bf, "bf16"),
                      dict(a1=h, b1=w2, nd=D, b_trans=True), [(h, w2.transpose(1, 2))], D, False),
            "dgrad_q": (lambda: gg.expert_h_grad(dout, w2, plan, bf, "bf16"),
                        dict(a1=dout, b1=w2, nd=H, b_trans=False, sorted_out=True), [(dout, w2)], H, True),
            "dx": (lambda: gg.expert_input_grad(dg, du, w1, w3, plan, bf, "bf16"),
                   dict(a1=dg, b1=w1, a2=du, b2=w3, nd=D, b_trans=False), [(dg, w1), (du, w3)], D, False),
        }
        for name in a.kernels:
            triton_call, gkw, pairs, nd, sorted_out = cases[name]
            kd = pairs[0][0].shape[1]
            flop = 2 * N * kd * nd * len(pairs)
            out_rows = check_rows if sorted_out else order[check_rows]
            exact = torch.zeros(len(check_rows), nd, dtype=torch.float64, device="cuda")
            for A, B in pairs:
                for e in check:
                    sel = (check_rows >= off[e]) & (check_rows < off[e + 1])
                    exact[sel] += A[off[e]:off[e + 1]].double() @ B[e].double()

            def err(out):
                return float((out[out_rows].double() - exact).norm() / exact.norm())

            os.environ["TITAN_MEGAMOE_POISON"] = "1"
            ref = triton_call()
            torch.cuda.synchronize()
            os.environ.pop("TITAN_MEGAMOE_POISON")
            row = {"shape": shape, "kernel": name, "N": N, "KD": kd, "ND": nd, "pairs": len(pairs),
                   "triton_rel_err_vs_fp64": err(ref), "triton_nan": bool(ref.isnan().any())}
            t_us = do_bench(triton_call, warmup=10, rep=200) * 1e3
            row.update(triton_us=t_us, triton_tflops=flop / (t_us * 1e-6) / 1e12)
            print(f"{shape} {name}: triton {t_us:.1f} us ({row['triton_tflops']:.0f} TFLOP/s), "
                  f"err {row['triton_rel_err_vs_fp64']:.2e}", flush=True)
            row["gluon"] = []
            for bn, stages, gm in (VARIANTS if a.variants is None else [VARIANTS[i] for i in a.variants]):
                rec = {"block_n": bn, "stages": stages, "group_m": gm}
                label = f"  gluon ws {bn} cols, {stages} stages, group_m {gm}"
                try:
                    def call():
                        return bf16_row_gemm_ws(plan=plan, **gkw, block_n=bn, stages=stages, group_m=gm)

                    os.environ["TITAN_MEGAMOE_POISON"] = "1"
                    out = call()
                    torch.cuda.synchronize()
                    os.environ.pop("TITAN_MEGAMOE_POISON")
                    rec["nan"] = bool(out.isnan().any())
                    same = out.view(torch.int16) == ref.view(torch.int16)
                    rec["bitwise_equal_fraction"] = float(same.float().mean())
                    diff = (out.float() - ref.float()).abs()
                    rec["max_rel_diff_vs_triton"] = float((diff / ref.float().abs().clamp_min(1e-3)).max())
                    rec["rel_err_vs_fp64"] = err(out)
                    rec["ok"] = ok = not rec["nan"] and rec["rel_err_vs_fp64"] <= 1.01 * row["triton_rel_err_vs_fp64"]
                    if ok:
                        us = do_bench(call, warmup=10, rep=200) * 1e3
                        rec.update(us=us, tflops=flop / (us * 1e-6) / 1e12, speedup_vs_triton=t_us / us)
                        timing = f"{us:.1f} us ({rec['tflops']:.0f} TFLOP/s, {rec['speedup_vs_triton']:.2f}x)"
                    else:
                        timing = "WRONG, not timed"
                    print(f"{label}: {timing}; bitwise {rec['bitwise_equal_fraction']:.4f}, max rel diff "
                          f"{rec['max_rel_diff_vs_triton']:.2e}, err {rec['rel_err_vs_fp64']:.2e}", flush=True)
                except Exception as e:  # a variant that fails to compile or launch is reported, the rest still run
                    os.environ.pop("TITAN_MEGAMOE_POISON", None)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{label}: {rec['error']}", flush=True)
                row["gluon"].append(rec)
            rows_out.append(row)
            save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
