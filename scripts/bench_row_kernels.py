#!/usr/bin/env python3
"""The bandwidth-bound row kernels of the backward, alone, on the GPU (needs CUDA).

1. Sorted copies (`kernels.sorted_rows`, one read of each source row) against the gather they replaced
   (`RoutingPlan.sorted_source_rows`, one `index_select`): equal results asserted, then timed.
2. dgrad's elementwise dSwiGLU (`_dswiglu_rows_kernel`) over a grid of row/column blocks and warps; every
   variant's dg, du, s*h asserted bitwise equal to the first one's (ds partial sums are split by the
   column block, so only their totals are compared, to fp32 rounding).
3. Block FP8 dgrad's elementwise half (`dgrad_swiglu._dswiglu_fp8`) at Qwen3-30B-A3B T=16384: the single
   kernel against the split pair (rows kernel + token-tile kernel) for each setting of its knobs, and each
   kernel of the pair alone; every variant checked bitwise against the single kernel (real rows and real
   tiles, outputs poisoned; "WRONG" and not timed otherwise). Times with and without CUDA graphs (the
   launcher's host work between the timing events). Also the one-kernel Gluon version
   (`dswiglu_fp8_gluon`) per (warps, exact cast); `--quick`: that, the single kernel and the shipped pair.
4. The weight quantizer (`quantize.quantize_weight_pair`: W and W^T in e4m3 from one read of each 128x128
   block) at the Qwen3 and Mixtral expert shapes, bf16 and fp32 weights, for each launch shape (warps,
   blocks per program: `_WEIGHT_LAUNCH`); every variant's four outputs checked
   bitwise against `quant.quantize_weight` first, outputs poisoned ("WRONG" and not timed otherwise). Then the Gluon
   quantizer (`quantize_gluon`, the GPU default; one pass for both dtypes) per (warps, exact cast), checked
   the same way (W^T also without W: `quantize_weight_transposed`).
5. The token-tile quantizers (x's tiles for dW1/dW3; dout's sorted rows and tiles for dgrad and dW2) at the
   Qwen3 shapes: the shipped Triton kernel, then the Gluon variants checked bitwise against it.

Times are `triton.testing.do_bench` medians in microseconds. Writes JSON (environment, rows) to --out.

    python scripts/bench_row_kernels.py --out docs/results
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import environment, result_path  # noqa: E402

COPY_SHAPES = [(16384, 2048, 128, 8), (16384, 4096, 128, 8), (8192, 4096, 8, 2), (512, 2048, 128, 8)]  # T, D, E, K
WEIGHT_SHAPES = [("30b w1", 128, 768, 2048), ("30b w2", 128, 2048, 768), ("235b w1", 128, 1536, 4096),
                 ("235b w2", 128, 4096, 1536), ("mixtral w1", 8, 14336, 4096)]  # name, E, R, C
WEIGHT_VARIANTS = [(4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 1), (16, 2)]  # warps, blocks per program
WEIGHT_GLUON_VARIANTS = [(8, False), (4, True), (8, True), (4, False), (16, False)]  # warps, exact cast
DSWIGLU_SHAPES = [(131072, 768), (131072, 1536), (16384, 14336), (4096, 768)]  # N, H


def bench_copies(do_bench):
    from titan_megamoe.kernels.routing_meta import build_routing_plan
    from titan_megamoe.kernels.sorted_rows import sorted_rows

    rows = []
    for T, D, E, K in COPY_SHAPES:
        ids = torch.randn(T, E, device="cuda").topk(K, dim=1).indices
        plan = build_routing_plan(ids, E, 128)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(plan.sorted_source_rows(x), sorted_rows(x, plan))
        gather_us = do_bench(lambda: plan.sorted_source_rows(x), warmup=10, rep=100) * 1e3
        copy_us = do_bench(lambda: sorted_rows(x, plan), warmup=10, rep=100) * 1e3
        gb = (T * K * D + T * D) * 2 / 1e9  # one read of x, one write of the copy
        rows.append({"T": T, "D": D, "E": E, "K": K, "index_select_us": gather_us, "sorted_rows_us": copy_us,
                     "sorted_rows_gb_per_s": gb / (copy_us * 1e-6)})
        print(f"sorted copy T={T} D={D} E={E} K={K}: index_select {gather_us:.1f} us, sorted_rows {copy_us:.1f} us "
              f"({rows[-1]['sorted_rows_gb_per_s']:.0f} GB/s)", flush=True)
    return rows


def bench_dswiglu_rows(do_bench):
    import triton

    from titan_megamoe.kernels.dgrad_swiglu import _ROWS_BLOCK_M, _ROWS_BLOCK_N, _dswiglu_rows_kernel

    rows = []
    for N, H in DSWIGLU_SHAPES:
        q = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
        g, u = torch.randn_like(q), torch.randn_like(q)
        s = torch.rand(N, device="cuda")
        order = torch.randperm(N, device="cuda", dtype=torch.int32)
        ref, times = None, {}
        for bm, bn, nw in itertools.product((32, 64, 128), (64, 128, 256), (4, 8)):
            if bm * bn > 128 * 128:
                continue
            num_n = triton.cdiv(H, bn)
            dg, du, hs = (torch.empty_like(q) for _ in range(3))
            ds = torch.empty(N, num_n, device="cuda")

            def run():
                dg.copy_(q)  # the kernel reads q from dg's buffer and overwrites it
                _dswiglu_rows_kernel[(triton.cdiv(N, bm) * num_n,)](dg, g, u, s, order, dg, du, hs, ds, N, H,
                                                                    BLOCK_M=bm, BLOCK_N=bn, INTERPRET=False,
                                                                    num_warps=nw)
            run()
            out = (dg.clone(), du.clone(), hs.clone(), ds.sum(1))
            if ref is None:
                ref = out
            assert all(torch.equal(a, b) for a, b in zip(out[:3], ref[:3])), (bm, bn, nw)
            torch.testing.assert_close(out[3], ref[3], rtol=1e-4, atol=1e-3)
            copy_ms = do_bench(lambda: dg.copy_(q), warmup=5, rep=50)
            times[f"{bm}x{bn}w{nw}"] = (do_bench(run, warmup=5, rep=50) - copy_ms) * 1e3
        gb = 6 * N * H * 2 / 1e9  # q, g, u read; dg, du, s*h written
        best = min(times, key=times.get)
        shipped = f"{_ROWS_BLOCK_M}x{_ROWS_BLOCK_N}w8"  # the launcher runs 8 warps
        rows.append({"N": N, "H": H, "us": times, "best": best, "shipped": shipped,
                     "shipped_gb_per_s": gb / (times[shipped] * 1e-6)})
        print(f"dswiglu rows N={N} H={H}: shipped {shipped} {times[shipped]:.1f} us "
              f"({rows[-1]['shipped_gb_per_s']:.0f} GB/s), 64x128w8 {times['64x128w8']:.1f}, "
              f"best {best} {times[best]:.1f}", flush=True)
    return rows


def bench_fp8_dswiglu(do_bench, quick: bool = False):
    import triton

    from titan_megamoe.kernels import dgrad_swiglu as m
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    T, K, E, H = 16384, 8, 128, 768
    N = T * K
    knobs = ("_FP8_DSWIGLU_SPLIT", "_FP8_ROWS_BLOCK_M", "_FP8_ROWS_WARPS", "_FP8_TILES_WARPS",
             "_FP8_TILES_COL_BLOCKS", "_FP8_TILES_BLOCK_N", "_FP8_DSWIGLU_GLUON")
    defaults = {k: getattr(m, k) for k in knobs}
    row_keys = ("dg", "dg_scale", "du", "du_scale", "ds_part")
    tile_keys = tuple(f"{n}{k}" for n in ("dgT", "duT", "hsT") for k in ("", "_scale"))
    os.environ.pop("TITAN_MEGAMOE_POISON", None)  # NaN fills would be timed with the kernels
    ids = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :K]
    plan = build_routing_plan(ids, E, 128)
    q, g, u = (torch.randn(N, H, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scores = torch.rand(N, device="cuda")
    real = int(plan.tile_expert.ge(0).sum())  # tiles past the real count are written by neither path
    P = real * 128
    # bytes moved: q, g, u read (bf16); e4m3 outputs, fp32 scales and ds_part written
    rows_bytes = N * H * (3 * 2 + 2) + 3 * N * (H // 128) * 4
    tiles_bytes = N * H * 3 * 2 + 3 * H * P + 3 * H * (P // 128) * 4
    single_bytes = N * H * 3 * 2 + 2 * N * H + 3 * H * P + 3 * N * (H // 128) * 4 + 3 * H * (P // 128) * 4
    real_launch = m.launch

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)

    def set_knobs(k):
        for name in knobs:
            setattr(m, name, k.get(name, defaults[name]))

    def run():
        return m._dswiglu_fp8(q, g, u, scores, plan)

    def outputs(k):
        set_knobs(k)
        os.environ["TITAN_MEGAMOE_POISON"] = "1"  # an element a variant skips is NaN, not a stale right value
        try:
            dg, du, tiles, ds_part = run()
        finally:
            os.environ.pop("TITAN_MEGAMOE_POISON")
        out = dict(zip(row_keys, (dg.data, dg.scale, du.data, du.scale, ds_part)))
        for name, t in zip(("dgT", "duT", "hsT"), tiles):
            out[name], out[name + "_scale"] = t.data[:, :P], t.scale[:, :real]
        return out

    triton_knobs = dict(_FP8_DSWIGLU_GLUON=None)  # the Triton kernels (the Gluon one is the GPU default)
    variants = [("single kernel", dict(triton_knobs, _FP8_DSWIGLU_SPLIT=False), None, row_keys + tile_keys,
                 single_bytes)]
    variants += [(f"gluon single kernel {w}w {'exact' if e else 'hardware'} cast{' persistent' if p else ''}",
                  dict(_FP8_DSWIGLU_GLUON=(w, e, p)), None, row_keys + tile_keys, single_bytes)
                 for w, e, p in [(16, False, True), (8, False, True), (16, False, False), (8, False, False),
                                 (16, True, False), (4, False, False)]]
    if quick:
        variants.append(("split, shipped knobs", triton_knobs, None, row_keys + tile_keys, rows_bytes + tiles_bytes))
    for bm, tw, cb in itertools.product((32, 64), (4, 8), (1, 2)) if not quick else ():
        variants.append((f"split: rows {bm}x128 8w, tiles {tw}w {cb}x128",
                         dict(triton_knobs, _FP8_DSWIGLU_SPLIT=True, _FP8_ROWS_BLOCK_M=bm, _FP8_ROWS_WARPS=8,
                              _FP8_TILES_WARPS=tw, _FP8_TILES_COL_BLOCKS=cb), None, row_keys + tile_keys,
                         rows_bytes + tiles_bytes))
    for bm, rw in itertools.product((32, 64), (4, 8)) if not quick else ():
        variants.append((f"rows kernel alone {bm}x128 {rw}w",
                         dict(triton_knobs, _FP8_DSWIGLU_SPLIT=True, _FP8_ROWS_BLOCK_M=bm, _FP8_ROWS_WARPS=rw),
                         m._dswiglu_fp8_rows_kernel, row_keys, rows_bytes))
    for tw, cb, step in itertools.product((4, 8), (1, 2), (32, 64, 128)) if not quick else ():
        variants.append((f"tiles kernel alone {tw}w {cb}x128 step {step}",
                         dict(triton_knobs, _FP8_DSWIGLU_SPLIT=True, _FP8_TILES_WARPS=tw, _FP8_TILES_COL_BLOCKS=cb,
                              _FP8_TILES_BLOCK_N=step), m._dswiglu_fp8_tiles_kernel, tile_keys, tiles_bytes))
    ref = outputs(dict(triton_knobs, _FP8_DSWIGLU_SPLIT=False))
    rows = []
    for name, k, kernel, keys, nbytes in variants:
        r = {"variant": name, "knobs": k, "bytes": nbytes}
        # one kernel of the pair alone: the other's launch skipped
        m.launch = (lambda fn, *a, _only=kernel, **kw: real_launch(fn, *a, **kw) if fn is _only else None) \
            if kernel is not None else real_launch
        try:
            got = outputs(k)
            bad = [key for key in keys if not torch.equal(bits(got[key]), bits(ref[key]))]
            if "ds_part" in bad:  # fp32 sums over a row's 128 columns: another summation order may round differently
                diff = (got["ds_part"] - ref["ds_part"]).abs().max().item()
                r["ds_part_max_abs_diff"], r["ds_part_max_abs"] = diff, ref["ds_part"].abs().max().item()
                if diff <= 1e-5 * r["ds_part_max_abs"]:
                    bad.remove("ds_part")
            del got
            if bad:
                r.update(status="WRONG", mismatched=bad)
            else:
                set_knobs(k)
                r.update(status="ok", us=do_bench(run, warmup=25, rep=200) * 1e3)
                r["gb_per_s"] = nbytes / (r["us"] * 1e-6) / 1e9
                r["graph_us"] = triton.testing.do_bench_cudagraph(run, rep=20) * 1e3
        except Exception as e:  # noqa: BLE001 (one variant's compile failure must not stop the others)
            r["status"] = f"error {type(e).__name__}: {str(e)[:300]}"
        finally:
            m.launch = real_launch
            set_knobs({})
        rows.append(r)
        timing = (f"{r['us']:.1f} us ({r['gb_per_s']:.0f} GB/s), graph {r['graph_us']:.1f} us" if "us" in r
                  else r["status"])
        print(f"fp8 dswiglu {name}: {timing}", flush=True)
    return rows


def bench_weight_quant(do_bench, quick: bool = False):
    from titan_megamoe import quant
    from titan_megamoe.kernels import quantize as m

    defaults = dict(m._WEIGHT_LAUNCH), dict(m._WEIGHT_GLUON)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, E, R, C in WEIGHT_SHAPES:
            # per-block magnitudes spread over 2^-20 .. 2^12, so the scales differ block to block
            w = (torch.randn(E, R, C, device="cuda") *
                 torch.exp2(torch.randint(-20, 12, (E, R // 128, 1, C // 128, 1), device="cuda").float())
                 .expand(E, R // 128, 128, C // 128, 128).reshape(E, R, C)).to(dtype)
            ref = quant.quantize_weight(w), quant.quantize_weight(w.transpose(-2, -1).contiguous())
            nbytes = E * R * C * (w.element_size() + 2) + 2 * E * (R // 128) * (C // 128) * 4
            triton_variants = [defaults[0][dtype]] if quick else WEIGHT_VARIANTS
            variants = ([("triton", warps, cb) for warps, cb in triton_variants] +
                        [("gluon", warps, exact) for warps, exact in WEIGHT_GLUON_VARIANTS])
            for kernel, warps, knob in variants:
                r = {"weight": name, "E": E, "R": R, "C": C, "dtype": str(dtype).replace("torch.", ""),
                     "kernel": kernel, "warps": warps, "bytes": nbytes}
                if kernel == "triton":
                    r["col_blocks"] = knob
                    m._WEIGHT_LAUNCH, m._WEIGHT_GLUON = {dtype: (warps, knob)}, {}
                else:
                    r["exact_cast"] = knob
                    m._WEIGHT_GLUON = {dtype: (warps, knob)}
                try:
                    os.environ["TITAN_MEGAMOE_POISON"] = "1"  # an element the kernel skips is NaN, not stale bits
                    try:
                        got = m.quantize_weight_pair(w)
                        alone = m.quantize_weight_transposed(w)  # W^T without W: does the W store matter?
                    finally:
                        os.environ.pop("TITAN_MEGAMOE_POISON")
                    bad = [f"{which}.{part}" for which, g, want in zip(("W", "Wt", "Wt alone"), (*got, alone),
                                                                       (*ref, ref[1]))
                           for part in ("data", "scale")
                           if not torch.equal(getattr(g, part).view(torch.uint8),
                                              getattr(want, part).view(torch.uint8))]
                    if bad:
                        diff = got[1].data.view(torch.uint8) != ref[1].data.view(torch.uint8)
                        r["wt_bytes_wrong"] = int(diff.sum())
                        if r["wt_bytes_wrong"]:
                            e, c, rr = (int(i) for i in diff.nonzero()[0])
                            r["wt_first_wrong"] = dict(index=[e, c, rr],
                                                       got=int(got[1].data.view(torch.uint8)[e, c, rr]),
                                                       want=int(ref[1].data.view(torch.uint8)[e, c, rr]),
                                                       w_code_there=int(got[0].data.view(torch.uint8)[e, rr, c]))
                    del got, alone
                    if bad:
                        r.update(status="WRONG", mismatched=bad)
                    else:
                        run = functools.partial(m.quantize_weight_pair, w)
                        r.update(status="ok", us=do_bench(run, warmup=10, rep=100) * 1e3)
                        r["gb_per_s"] = nbytes / (r["us"] * 1e-6) / 1e9
                except Exception as e:  # noqa: BLE001 (one variant's compile failure must not stop the others)
                    r["status"] = f"error {type(e).__name__}: {str(e)[:300]}"
                finally:
                    m._WEIGHT_LAUNCH, m._WEIGHT_GLUON = dict(defaults[0]), dict(defaults[1])
                rows.append(r)
                timing = f"{r['us']:.1f} us ({r['gb_per_s']:.0f} GB/s)" if "us" in r else r["status"]
                knob_name = f"x{knob}" if kernel == "triton" else ("exact cast" if knob else "hardware cast")
                if "wt_bytes_wrong" in r:
                    knob_name += f" ({r['wt_bytes_wrong']} W^T bytes wrong, first {r.get('wt_first_wrong')})"
                print(f"weight quant {name} {r['dtype']} {kernel} {warps}w {knob_name}: {timing}", flush=True)
            del w, ref
    return rows


TOKEN_TILE_SHAPES = [("30b", 16384, 2048, 128, 8), ("235b", 16384, 4096, 128, 8)]  # name, T, D, E, K
TOKEN_TILE_GLUON_VARIANTS = [(4, True), (8, True), (4, False), (8, False)]  # warps, exact cast


def bench_token_tiles(do_bench):
    """x's (and dout's) token tiles (`quantize_token_tiles`, gathered), and dout's sorted rows (`quantize_sorted_rows`:
    each token quantized once, its e4m3 row gathered) then its tiles, as the FP8 backward makes them: the Triton
    kernel, then each Gluon variant checked bitwise against it (outputs poisoned; the Triton kernel is quant.py's
    bits by tests/test_quant_kernels.py) and timed. (Until 2026-12-06 dout's rows and tiles came from one pass of
    the token-tile kernel; `bench_row_kernels_20261206T063144.json` timed both ways.)"""
    from titan_megamoe.kernels import quantize as m
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    default = m._TOKEN_TILE_GLUON
    rows = []
    for name, T, D, E, K in TOKEN_TILE_SHAPES:
        ids = torch.randn(T, E, device="cuda").topk(K, dim=1).indices
        plan = build_routing_plan(ids, E, 128)
        src = torch.randn(T, D, device="cuda", dtype=torch.bfloat16) * torch.exp2(
            torch.randint(-8, 8, (T, 1), device="cuda").float()).to(torch.bfloat16)
        P = plan.layout.num_tiles * 128
        for op, fn, nbytes in [("x tiles", lambda: (m.quantize_token_tiles(src, plan),), T * K * D * 2 + D * P),
                               ("dout rows, then tiles", lambda: (m.quantize_sorted_rows(src, plan),
                                                                   m.quantize_token_tiles(src, plan)),
                                T * K * D * 3 + D * P)]:  # bf16 rows read, e4m3 rows (+ tiles) written
            ref = None
            for kernel, warps, exact in [("triton", m._TOKEN_TILE_WARPS, True)] + [  # the Triton kernel: the reference
                    ("gluon", w, e) for w, e in TOKEN_TILE_GLUON_VARIANTS]:
                r = {"shape": name, "T": T, "D": D, "E": E, "K": K, "op": op, "kernel": kernel, "warps": warps,
                     "exact_cast": exact, "bytes": nbytes}
                m._TOKEN_TILE_GLUON = None if kernel == "triton" else (warps, exact)
                try:
                    os.environ["TITAN_MEGAMOE_POISON"] = "1"  # an element the kernel skips is NaN, not stale bits
                    try:
                        got = [t for q in fn() for t in (q.data, q.scale)]
                    finally:
                        os.environ.pop("TITAN_MEGAMOE_POISON")
                    if ref is None:
                        ref = got
                    bad = [i for i, (g, w) in enumerate(zip(got, ref)) if not torch.equal(g.view(torch.uint8),
                                                                                          w.view(torch.uint8))]
                    del got
                    if bad:
                        r.update(status="WRONG", mismatched_outputs=bad)
                    else:
                        r.update(status="ok", us=do_bench(fn, warmup=10, rep=100) * 1e3)
                        r["gb_per_s"] = nbytes / (r["us"] * 1e-6) / 1e9
                except Exception as e:  # noqa: BLE001 (one variant's compile failure must not stop the others)
                    r["status"] = f"error {type(e).__name__}: {str(e)[:300]}"
                finally:
                    m._TOKEN_TILE_GLUON = default
                rows.append(r)
                timing = f"{r['us']:.1f} us ({r['gb_per_s']:.0f} GB/s)" if "us" in r else r["status"]
                cast = "exact cast" if exact else "hardware cast"
                print(f"token tiles {name} {op} {kernel} {warps}w {cast}: {timing}", flush=True)
            del ref
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--quick", action="store_true",
                    help="weight_quant, fp8_dswiglu: the Triton kernels at their shipped settings only, beside every "
                         "Gluon variant")
    ap.add_argument("--sections", nargs="+", default=["copies", "dswiglu_rows", "fp8_dswiglu"],
                    choices=["copies", "dswiglu_rows", "fp8_dswiglu", "weight_quant", "token_tiles"])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_row_kernels.py needs a CUDA GPU")
    from triton.testing import do_bench

    torch.manual_seed(0)
    sections = {"copies": ("sorted_copies", bench_copies), "dswiglu_rows": ("dswiglu_rows", bench_dswiglu_rows),
                "fp8_dswiglu": ("fp8_dswiglu", functools.partial(bench_fp8_dswiglu, quick=a.quick)),
                "weight_quant": ("weight_quant", functools.partial(bench_weight_quant, quick=a.quick)),
                "token_tiles": ("token_tiles", bench_token_tiles)}
    result = {"environment": environment()}
    for name in a.sections:
        key, fn = sections[name]
        result[key] = fn(do_bench)
    path = result_path(a.out, "bench_row_kernels")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
