#!/usr/bin/env python3
"""Block-FP8 GEMMs: the Gluon kernels with the promotion overlapped (`kernels.fp8_rows_gluon`,
`kernels.fp8_gemm1_gluon`, and the persistent warp-specialised `*_ws_gluon`) against the Triton kernels
(`kernels.grouped_gemm`, `gemm1_swiglu`) at the configs the table shipped for them (`_triton_reference`),
same operands, same process (needs CUDA).

For GEMM2 (y = h W2^T, scattered), dgrad's q (q = dout W2, sorted) and dx (dg W1 + du W3, scattered) at
Qwen3-30B-A3B and 235B-A22B shapes, T=16384, K=8, random top-k routing: operands quantized by the
package's own quantizers from fresh random bf16 tensors; outputs allocated NaN-filled
(TITAN_MEGAMOE_POISON=1) for the checks, which compare every Gluon variant with the Triton kernel
(bitwise-equal fraction, max relative difference) and both with a float64 product of the dequantized
operands on the rows of three experts; a variant off the Triton kernel by more than bf16 rounding is
reported "WRONG" and not timed. Times are `triton.testing.do_bench` medians (us), TFLOP/s = 2*N*KD*ND
per pair. GEMM1 (`bench_gemm1`): g, u and h against the Triton kernel's, g against float64. Writes JSON
(environment, rows) to --out.

    python scripts/bench_fp8_gluon.py --out docs/results
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


def _triton_reference():
    """The Triton kernels' configs the table shipped for these shapes before the Gluon kernels won
    (2026-12-06), pinned so that the reference stays the Triton kernel whatever the table picks now."""
    from titan_megamoe.kernels.configs import TileConfig

    kw = dict(block_k=128, tma=True)
    rows = dict(block_m=64, block_n=128, num_warps=4, num_stages=3, **kw)
    dx = TileConfig(128, 128, num_warps=8, num_stages=3, persistent=1, pairs_in_one_loop=True, **kw)
    gemm1 = TileConfig(64, 64, num_warps=4, num_stages=3, **kw)
    return {
        "30b": {"gemm1_swiglu": gemm1, "gemm2": TileConfig(persistent=2, **rows), "dx": dx,
                "dgrad_swiglu": TileConfig(split=True, persistent=2, **rows)},
        "235b": {"gemm1_swiglu": gemm1, "gemm2": TileConfig(**rows), "dx": dx,
                 "dgrad_swiglu": TileConfig(128, 128, num_warps=8, num_stages=3, split=True, persistent=1, **kw)},
    }


def time_against_triton(rec: dict, call, do_bench, flop: float, triton_us: float) -> str:
    """Time a checked variant into `rec` (us: `do_bench` median; TFLOP/s; speedup over the Triton kernel's
    `triton_us`) and return the line printed for it."""
    us = do_bench(call, warmup=10, rep=200) * 1e3
    rec.update(us=us, tflops=flop / (us * 1e-6) / 1e12, speedup_vs_triton=triton_us / us)
    return f"{us:.1f} us ({rec['tflops']:.0f} TFLOP/s, {rec['speedup_vs_triton']:.2f}x)"


def pinned(shape: str, kernel: str, call):
    """`call` with the Triton reference config of `kernel` at `shape` in force."""
    from titan_megamoe.kernels.configs import override_tile_config

    def run():
        with override_tile_config(kernel, _triton_reference()[shape][kernel]):
            return call()
    return run
# block_m, block_n, warps, stages, warp-specialised (`fp8_rows_ws_gluon`: persistent, a producer warp and two
# consumer warpgroups of 64 rows; block_m and warps are then the kernel's own, 128 and 4 + 4)
VARIANTS = [
    (64, 128, 4, 3, False), (64, 128, 4, 4, False), (128, 128, 8, 3, False), (128, 128, 8, 4, False),
    (128, 128, 8, 3, True), (128, 128, 8, 4, True), (128, 128, 8, 5, True),
    (128, 256, 8, 3, True), (128, 256, 8, 4, True),  # 256 columns: two 128-column sub-tiles per consumer
    # a sixth field: the row scales staged by the producer (`fp8_row_gemm_ws`'s staged_scales)
    (128, 128, 8, 4, True, True), (128, 256, 8, 3, True, True), (128, 256, 8, 4, True, True)]
# block_m, block_n (64: 64-column halves; 128: one pass, warp-specialised only), warps, stages,
# warp-specialised (`fp8_gemm1_ws_gluon`, persistent)
GEMM1_VARIANTS = [(64, 64, 4, 3, False), (64, 64, 4, 4, False), (128, 64, 8, 3, False), (128, 64, 8, 3, True),
                  (128, 64, 8, 4, True), (128, 64, 8, 5, True), (128, 128, 8, 3, True), (128, 128, 8, 4, True)]


def bench_gemm1(shape, plan, E, D, H, check_rows, rows_of, off, do_bench, rows_out, save, variants=None):
    """GEMM1 (gate, up, SwiGLU, h in e4m3): `fp8_gemm1_gluon` against `gemm1_swiglu`'s Triton kernel on the
    same sorted e4m3 rows of x, outputs poisoned: g and u compared with the Triton kernel's (within bf16
    rounding) and g with a float64 product on three experts' rows; h dequantized against the Triton h."""
    from titan_megamoe.kernels.fp8_gemm1_gluon import fp8_gemm1
    from titan_megamoe.kernels.fp8_gemm1_ws_gluon import fp8_gemm1_ws
    from titan_megamoe.kernels.gemm1_swiglu import gemm1_swiglu
    from titan_megamoe.kernels.quantize import quantize_sorted_rows, quantize_weight_pair
    from titan_megamoe.precision import BlockScaled
    from titan_megamoe.quant import dequantize

    T = plan.num_rows // plan.rows_per_token
    N = plan.num_rows
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w1q, w3q = (quantize_weight_pair(torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16) * 0.02)[0]
                for _ in range(2))
    xq = quantize_sorted_rows(x, plan)
    flop = 2 * N * D * H * 2

    triton_call = pinned(shape, "gemm1_swiglu",
                         lambda: gemm1_swiglu(xq, w1q, w3q, plan, torch.bfloat16, "fp8", sorted_rows=True))

    exact = torch.zeros(len(check_rows), H, dtype=torch.float64, device="cuda")
    for e in (0, E // 2, E - 1):
        r = rows_of(e)
        sel = (check_rows >= off[e]) & (check_rows < off[e + 1])
        exact[sel] = (dequantize(BlockScaled(xq.data[r], xq.scale[r], xq.block)).double() @
                      dequantize(BlockScaled(w1q.data[e], w1q.scale[e], w1q.block)).double().T)

    def err(g):
        return float((g[check_rows].double() - exact).norm() / exact.norm())

    os.environ["TITAN_MEGAMOE_POISON"] = "1"
    ref = triton_call()
    torch.cuda.synchronize()
    os.environ.pop("TITAN_MEGAMOE_POISON")
    row = {"shape": shape, "kernel": "gemm1", "N": N, "KD": D, "ND": H, "pairs": 2,
           "triton_rel_err_vs_fp64": err(ref[0]), "triton_nan": bool(ref[0].isnan().any() or ref[1].isnan().any())}
    t_us = do_bench(triton_call, warmup=10, rep=200) * 1e3
    row.update(triton_us=t_us, triton_tflops=flop / (t_us * 1e-6) / 1e12, gluon=[])
    print(f"{shape} gemm1: triton {t_us:.1f} us ({row['triton_tflops']:.0f} TFLOP/s), "
          f"err {row['triton_rel_err_vs_fp64']:.2e}", flush=True)
    h_ref = dequantize(ref[2]).float()
    for bm, bn, warps, stages, ws in (GEMM1_VARIANTS if variants is None else [GEMM1_VARIANTS[i] for i in variants]):
        rec = {"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "warp_specialize": ws}
        try:
            def call():
                if ws:
                    return fp8_gemm1_ws(xq, w1q, w3q, plan, stages=stages, block_n=bn)
                return fp8_gemm1(xq, w1q, w3q, plan, block_m=bm, num_warps=warps, stages=stages)

            os.environ["TITAN_MEGAMOE_POISON"] = "1"
            try:
                out = call()
                torch.cuda.synchronize()
            finally:
                os.environ.pop("TITAN_MEGAMOE_POISON")
            rec["nan"] = any(bool(t.float().isnan().any()) for t in (out[0], out[1], out[2].data, out[2].scale))
            rel = [float(((o.float() - r.float()).abs() / r.float().abs().clamp_min(1e-3)).max())
                   for o, r in ((out[0], ref[0]), (out[1], ref[1]))]
            rec["max_rel_diff_vs_triton"] = max(rel)
            rec["bitwise_equal_fraction"] = float((out[0].view(torch.int16) == ref[0].view(torch.int16)).float().mean())
            rec["h_bitwise_equal_fraction"] = float((out[2].data.view(torch.uint8) == ref[2].data.view(torch.uint8))
                                                    .float().mean())
            rec["h_rel_l2_vs_triton"] = float((dequantize(out[2]).float() - h_ref).norm() / h_ref.norm())
            rec["rel_err_vs_fp64"] = err(out[0])
            ok = (not rec["nan"] and rec["rel_err_vs_fp64"] <= 1.01 * row["triton_rel_err_vs_fp64"] + 1e-6
                  and rec["max_rel_diff_vs_triton"] < 2 ** -7 and rec["h_rel_l2_vs_triton"] < 1e-2)
            rec["ok"] = ok
            timing = time_against_triton(rec, call, do_bench, flop, t_us) if ok else "WRONG, not timed"
            print(f"  gluon gemm1 {bm}x{bn} w{warps} s{stages}{' ws' * ws}: {timing}; "
                  f"g bitwise {rec['bitwise_equal_fraction']:.4f}, "
                  f"h bitwise {rec['h_bitwise_equal_fraction']:.4f}, max rel diff {rec['max_rel_diff_vs_triton']:.2e}, "
                  f"h rel {rec['h_rel_l2_vs_triton']:.1e}, err {rec['rel_err_vs_fp64']:.2e}", flush=True)
        except Exception as e:  # a variant that fails to compile or launch is reported, the rest still run
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  gluon gemm1 {bm}x{bn} w{warps} s{stages}{' ws' * ws}: {rec['error']}", flush=True)
        row["gluon"].append(rec)
    rows_out.append(row)
    save()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--kernels", nargs="+", default=["dgrad_q", "gemm2", "dx", "gemm1"],
                    choices=["dgrad_q", "gemm2", "dx", "gemm1"])
    ap.add_argument("--variants", nargs="+", type=int, default=None,
                    help="indices into VARIANTS to run (default: all)")
    ap.add_argument("--gemm1-variants", nargs="+", type=int, default=None,
                    help="indices into GEMM1_VARIANTS to run (default: all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gluon.py needs a CUDA GPU")
    from triton.testing import do_bench

    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.precision import BlockScaled
    from titan_megamoe.quant import dequantize
    from titan_megamoe.kernels.fp8_rows_gluon import fp8_row_gemm
    from titan_megamoe.kernels.fp8_rows_ws_gluon import fp8_row_gemm_ws
    from titan_megamoe.kernels.quantize import quantize_rows, quantize_weight_pair
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    torch.manual_seed(0)
    rows_out = []
    path = result_path(a.out, "bench_fp8_gluon")

    def save():  # after every kernel: a run cut short by a time limit keeps what it measured
        with open(path, "w") as f:
            json.dump({"environment": environment(), "rows": rows_out}, f, indent=1)
    for shape in a.shapes:
        T, K, E, D, H = SHAPES[shape]
        N = T * K
        ids = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :K]
        plan = build_routing_plan(ids, E, 128)
        off = plan.offsets_E1.tolist()

        def rows_of(*experts):
            return torch.cat([torch.arange(off[e], off[e + 1], device="cuda") for e in experts])

        check_rows = rows_of(0, E // 2, E - 1)
        order = plan.order_N.long()
        w1, w3 = (torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
        w2 = torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16) * 0.02
        (w1q, w1t), (w3q, w3t), (w2q, w2t) = (quantize_weight_pair(w) for w in (w1, w3, w2))
        del w1q, w3q
        dout, h, dg, du = (quantize_rows(torch.randn(N, c, device="cuda", dtype=torch.bfloat16))
                           for c in (D, H, H, H))
        cases = {
            # name: (triton call, gluon kwargs, pairs [(A, B)], ND, sorted)
            "dgrad_q": (lambda: gg.expert_h_grad(dout, w2t, plan, torch.bfloat16, "fp8"),
                        dict(a1=dout, b1=w2t, nd=H, sorted_out=True), [(dout, w2t)], H, True),
            "gemm2": (lambda: gg.expert_down_proj(h, w2q, plan, torch.bfloat16, "fp8"),
                      dict(a1=h, b1=w2q, nd=D), [(h, w2q)], D, False),
            "dx": (lambda: gg.expert_input_grad(dg, du, w1t, w3t, plan, torch.bfloat16, "fp8"),
                   dict(a1=dg, b1=w1t, a2=du, b2=w3t, nd=D), [(dg, w1t), (du, w3t)], D, False),
        }
        for name in a.kernels:
            if name == "gemm1":
                bench_gemm1(shape, plan, E, D, H, check_rows, rows_of, off, do_bench, rows_out, save, a.gemm1_variants)
                continue
            triton_call, gkw, pairs, nd, sorted_out = cases[name]
            triton_call = pinned(shape, {"dgrad_q": "dgrad_swiglu"}.get(name, name), triton_call)
            kd = pairs[0][0].data.shape[1]
            flop = 2 * N * kd * nd * len(pairs)
            os.environ["TITAN_MEGAMOE_POISON"] = "1"
            ref = triton_call()
            torch.cuda.synchronize()
            # float64 oracle on three experts' rows (in the output's row order)
            out_rows = check_rows if sorted_out else order[check_rows]
            exact = torch.zeros(len(check_rows), nd, dtype=torch.float64, device="cuda")
            for A, B in pairs:
                for e in (0, E // 2, E - 1):
                    r = rows_of(e)
                    sel = (check_rows >= off[e]) & (check_rows < off[e + 1])
                    # quant.dequantize is exact (power-of-two scales), so float64 of it is too
                    rows_q = BlockScaled(A.data[r], A.scale[r], A.block)
                    w_q = BlockScaled(B.data[e], B.scale[e], B.block)
                    exact[sel] += dequantize(rows_q).double() @ dequantize(w_q).double().T

            def err(out):
                o = out[out_rows].double()
                return float((o - exact).norm() / exact.norm())

            row = {"shape": shape, "kernel": name, "N": N, "KD": kd, "ND": nd, "pairs": len(pairs),
                   "triton_rel_err_vs_fp64": err(ref), "triton_nan": bool(ref.isnan().any())}
            os.environ.pop("TITAN_MEGAMOE_POISON")
            t_us = do_bench(triton_call, warmup=10, rep=200) * 1e3
            row["triton_us"] = t_us
            row["triton_tflops"] = flop / (t_us * 1e-6) / 1e12
            print(f"{shape} {name}: triton {t_us:.1f} us ({row['triton_tflops']:.0f} TFLOP/s), "
                  f"err {row['triton_rel_err_vs_fp64']:.2e}", flush=True)
            row["gluon"] = []
            for bm, bn, warps, stages, ws, *staged in (VARIANTS if a.variants is None
                                                       else [VARIANTS[i] for i in a.variants]):
                staged = bool(staged and staged[0])
                knobs = dict(block_n=bn, stages=stages, staged_scales=staged) if ws else dict(
                    block_m=bm, block_n=bn, num_warps=warps, stages=stages)
                gemm = fp8_row_gemm_ws if ws else fp8_row_gemm
                rec = {"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "warp_specialize": ws,
                       "staged_scales": staged}
                try:
                    os.environ["TITAN_MEGAMOE_POISON"] = "1"

                    def call():
                        return gemm(plan=plan, **gkw, **knobs)

                    out = call()
                    torch.cuda.synchronize()
                    os.environ.pop("TITAN_MEGAMOE_POISON")
                    diff = (out.float() - ref.float()).abs()
                    rec["nan"] = bool(out.isnan().any())
                    same_bits = out.view(torch.int16) == ref.view(torch.int16)
                    rec["bitwise_equal_fraction"] = float(same_bits.float().mean())
                    rec["max_rel_diff_vs_triton"] = float((diff / ref.float().abs().clamp_min(1e-3)).max())
                    rec["rel_err_vs_fp64"] = err(out)
                    ok = not rec["nan"] and rec["rel_err_vs_fp64"] <= 1.01 * row["triton_rel_err_vs_fp64"] + 1e-6 \
                        and rec["max_rel_diff_vs_triton"] < 2 ** -7
                    rec["ok"] = ok
                    timing = time_against_triton(rec, call, do_bench, flop, t_us) if ok else "WRONG, not timed"
                    print(f"  gluon {bm}x{bn} w{warps} s{stages}{' ws' * ws}{' staged' * staged}: {timing}; bitwise "
                          f"{rec['bitwise_equal_fraction']:.4f}, max rel diff {rec['max_rel_diff_vs_triton']:.2e}, "
                          f"err {rec['rel_err_vs_fp64']:.2e}", flush=True)
                except Exception as e:  # a variant that fails to compile or launch is reported, the rest still run
                    os.environ.pop("TITAN_MEGAMOE_POISON", None)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"  gluon {bm}x{bn} w{warps} s{stages}{' ws' * ws}{' staged' * staged}: {rec['error']}", flush=True)
                row["gluon"].append(rec)
            rows_out.append(row)
            save()
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
