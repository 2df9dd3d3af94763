"""Quantizer variants on the H200: bitwise against the shipped kernels (GPU-verified against quant.py), then timed."""
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from titan_megamoe.kernels.common import INTERPRET, e4m3_scale, to_e4m3
from titan_megamoe.kernels.quantize import (_fp32, quantize_rows, quantize_sorted_rows, quantize_token_tiles,
                                            quantize_weight_pair)
from titan_megamoe.kernels.routing_meta import build_routing_plan
from titan_megamoe import quant


@triton.jit
def _tiles_v(src_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, data_ptr, data_desc, scale_ptr,
             rows_ptr, rows_scale_ptr, C, num_tiles, rows_per_token, stride_r, stride_c,
             BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, WITH_ROWS: tl.constexpr, TMA: tl.constexpr,
             COL_LOOP: tl.constexpr, INTERPRET: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    end = tl.where(expert >= 0, tl.load(offsets_ptr + tl.maximum(expert, 0) + 1), 0)
    i = tl.arange(0, BLOCK_M)
    rows = row0 + i
    row_ok = rows < end
    src = (tl.load(order_ptr + rows, mask=row_ok, other=0) // rows_per_token).to(tl.int64)
    for cb in tl.range(tl.program_id(1) * COL_LOOP, (tl.program_id(1) + 1) * COL_LOOP):
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        x = _fp32(tl.load(src_ptr + src[:, None] * stride_r + cols[None, :] * stride_c,
                          mask=row_ok[:, None], other=0.0), INTERPRET)
        if WITH_ROWS:
            row_scale, row_inv = e4m3_scale(tl.max(tl.abs(x), axis=1))
            qr = to_e4m3(x, row_inv[:, None], INTERPRET)
            tl.store(rows_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], qr, mask=row_ok[:, None])
            tl.store(rows_scale_ptr + rows.to(tl.int64) * (C // BLOCK_C) + cb, row_scale, mask=row_ok)
        scale, inv = e4m3_scale(tl.max(tl.abs(x), axis=0))
        q = to_e4m3(x, inv[None, :], INTERPRET)
        if TMA:
            data_desc.store([cb * BLOCK_C, tile * BLOCK_M], tl.trans(q))
        else:
            P = num_tiles * BLOCK_M
            tl.store(data_ptr + cols.to(tl.int64)[:, None] * P + tile * BLOCK_M + i[None, :], tl.trans(q))
        tl.store(scale_ptr + cols.to(tl.int64) * num_tiles + tile, scale)


def tiles_v(src, plan, with_rows, tma, warps, col_loop=1):
    C = src.shape[1]
    nt = plan.layout.num_tiles
    data = torch.empty((C, nt * 128), dtype=quant.E4M3, device=src.device)
    scale = torch.empty((C, nt), dtype=torch.float32, device=src.device)
    N = plan.num_rows
    rows = torch.empty((N, C), dtype=quant.E4M3, device=src.device) if with_rows else data
    rs = torch.empty((N, C // 128), dtype=torch.float32, device=src.device) if with_rows else scale
    desc = TensorDescriptor.from_tensor(data, [128, 128]) if tma else data
    _tiles_v[(nt, C // 128 // col_loop)](src, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1, data,
                                        desc, scale, rows, rs, C, nt, plan.rows_per_token, src.stride(0),
                                        src.stride(1), BLOCK_M=128, BLOCK_C=128, WITH_ROWS=with_rows, TMA=tma,
                                        COL_LOOP=col_loop, INTERPRET=INTERPRET, num_warps=warps)
    return (rows, rs, data, scale) if with_rows else (data, scale)


@triton.jit
def _wpair_v(w_ptr, d_desc, s_ptr, dt_desc, st_ptr, R, C, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    col_block = tl.program_id(0)
    row_block = tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)
    rows = row_block * BLOCK + tl.arange(0, BLOCK)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    w = _fp32(tl.load(w_ptr + expert * R * C + rows[:, None] * C + cols[None, :]), INTERPRET)
    scale, inv = e4m3_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    q = to_e4m3(w, inv, INTERPRET)
    nrb = R // BLOCK
    ncb = C // BLOCK
    blocks = expert * nrb * ncb
    d_desc.store([(expert * R + row_block * BLOCK).to(tl.int32), col_block * BLOCK], q)
    tl.store(s_ptr + blocks + row_block * ncb + col_block, scale)
    dt_desc.store([(expert * C + col_block * BLOCK).to(tl.int32), row_block * BLOCK], tl.trans(q))
    tl.store(st_ptr + blocks + col_block * nrb + row_block, scale)


def wpair_v(w, warps):
    E, R, C = w.shape
    d = torch.empty((E, R, C), dtype=quant.E4M3, device=w.device)
    dt = torch.empty((E, C, R), dtype=quant.E4M3, device=w.device)
    s = torch.empty((E, R // 128, C // 128), dtype=torch.float32, device=w.device)
    st = torch.empty((E, C // 128, R // 128), dtype=torch.float32, device=w.device)
    dd = TensorDescriptor.from_tensor(d.view(E * R, C), [128, 128])
    dtd = TensorDescriptor.from_tensor(dt.view(E * C, R), [128, 128])
    _wpair_v[(C // 128, R // 128, E)](w, dd, s, dtd, st, R, C, BLOCK=128, INTERPRET=INTERPRET, num_warps=warps)
    return d, s, dt, st


@triton.jit
def _gather_rows_v(q_ptr, qs_ptr, order_ptr, out_ptr, outs_ptr, N, C, rows_per_token,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    p = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = p < N
    src = (tl.load(order_ptr + p, mask=ok, other=0) // rows_per_token).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    v = tl.load(q_ptr + src[:, None] * C + cols[None, :], mask=ok[:, None])
    tl.store(out_ptr + p.to(tl.int64)[:, None] * C + cols[None, :], v, mask=ok[:, None])
    nsb = C // 128
    sc = tl.arange(0, BLOCK_C // 128) + tl.program_id(1) * (BLOCK_C // 128)
    s = tl.load(qs_ptr + src[:, None] * nsb + sc[None, :], mask=ok[:, None])
    tl.store(outs_ptr + p.to(tl.int64)[:, None] * nsb + sc[None, :], s, mask=ok[:, None])


def sorted_rows_v(x, plan, block_r, block_c, warps):
    q = quantize_rows(x)
    N, C = plan.num_rows, x.shape[1]
    out = torch.empty((N, C), dtype=quant.E4M3, device=x.device)
    outs = torch.empty((N, C // 128), dtype=torch.float32, device=x.device)
    _gather_rows_v[(triton.cdiv(N, block_r), C // block_c)](q.data, q.scale, plan.order_N, out, outs, N, C,
                                                           plan.rows_per_token, BLOCK_R=block_r, BLOCK_C=block_c,
                                                           num_warps=warps)
    return out, outs


def bench(fn, n=50):
    return triton.testing.do_bench(fn, warmup=10, rep=n, return_mode="median")


def main():
    torch.manual_seed(0)
    res = {}
    small = os.environ.get("SMALL") == "1"
    dev = "cpu" if small else "cuda"
    shapes = {"small": (256, 256, 4, 2, 200)} if small else {"30b": (2048, 768, 128, 8, 16384)}
    global bench
    if small:
        bench = lambda fn, n=0: (fn(), 0.0)[1]  # noqa: E731
    for name, (D, H, E, K, T) in shapes.items():
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        ids = torch.argsort(torch.rand(T, E, device=dev), dim=1)[:, :K]
        plan = build_routing_plan(ids, E, 128)
        w = (torch.randn(E, H, D, device=dev) * 0.02).to(torch.bfloat16)
        # token tiles, gathered
        ref = quantize_token_tiles(x, plan)
        r = {"tiles_shipped": bench(lambda: quantize_token_tiles(x, plan))}
        for tma in (False, True):
            for warps in (4, 8):
                for cl in (1, 2):
                    key = f"tiles_tma{int(tma)}_w{warps}_cl{cl}"
                    try:
                        d, s = tiles_v(x, plan, False, tma, warps, cl)
                        ok = torch.equal(d.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(s, ref.scale)
                        r[key] = bench(lambda: tiles_v(x, plan, False, tma, warps, cl)) if ok else "WRONG"
                    except Exception as e:  # noqa: BLE001
                        r[key] = f"error {type(e).__name__}: {str(e)[:200]}"
        # rows + tiles (dout)
        rrows, rtiles = quantize_sorted_rows(x, plan, with_tiles=True)
        r["rowtiles_shipped"] = bench(lambda: quantize_sorted_rows(x, plan, with_tiles=True))
        for tma in (False, True):
            for warps in (4, 8):
                key = f"rowtiles_tma{int(tma)}_w{warps}"
                try:
                    a, b, c, d2 = tiles_v(x, plan, True, tma, warps)
                    ok = all(torch.equal(u.view(torch.uint8) if u.dtype == quant.E4M3 else u,
                                         v.view(torch.uint8) if v.dtype == quant.E4M3 else v)
                             for u, v in ((a, rrows.data), (b, rrows.scale), (c, rtiles.data), (d2, rtiles.scale)))
                    r[key] = bench(lambda: tiles_v(x, plan, True, tma, warps)) if ok else "WRONG"
                except Exception as e:  # noqa: BLE001
                    r[key] = f"error {type(e).__name__}: {str(e)[:200]}"
        # sorted rows (x forward)
        srows = quantize_sorted_rows(x, plan)
        r["rows_shipped"] = bench(lambda: quantize_sorted_rows(x, plan))
        r["rows_pertoken_quant_only"] = bench(lambda: quantize_rows(x))
        for br, bc, warps in ((32, 512, 4), (64, 256, 4), (16, 2048, 8), (32, 1024, 8)):
            key = f"rows_gather_r{br}_c{bc}_w{warps}"
            try:
                a, b = sorted_rows_v(x, plan, br, bc, warps)
                ok = torch.equal(a.view(torch.uint8), srows.data.view(torch.uint8)) and torch.equal(b, srows.scale)
                r[key] = bench(lambda: sorted_rows_v(x, plan, br, bc, warps)) if ok else "WRONG"
            except Exception as e:  # noqa: BLE001
                r[key] = f"error {type(e).__name__}: {str(e)[:200]}"
        # weight pair
        wq, wtq = quantize_weight_pair(w)
        r["wpair_shipped"] = bench(lambda: quantize_weight_pair(w))
        for warps in (4, 8):
            key = f"wpair_tma_w{warps}"
            try:
                d, s, dt, st = wpair_v(w, warps)
                ok = (torch.equal(d.view(torch.uint8), wq.data.view(torch.uint8)) and torch.equal(s, wq.scale)
                      and torch.equal(dt.view(torch.uint8), wtq.data.view(torch.uint8)) and torch.equal(st, wtq.scale))
                r[key] = bench(lambda: wpair_v(w, warps)) if ok else "WRONG"
            except Exception as e:  # noqa: BLE001
                r[key] = f"error {type(e).__name__}: {str(e)[:200]}"
        res[name] = r
        print(name, json.dumps(r, indent=1), flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "qvar.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
