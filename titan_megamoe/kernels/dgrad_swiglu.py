"""Backward through GEMM2 and SwiGLU, with the routing-score gradient in the epilogue.

For the expert-sorted rows p of one tile (expert e, row n = order(p), source row r(p), score s_n):
    q_p  = dout_{r(p)} W2_e                  (the gradient of h before the score)
    ds_n = <dout, y_p> = <q_p, h_p>          (so the expert output y is never stored)
    dh_p = s_n q_p
    dg_p = dh_p * u_p * silu'(g_p),   du_p = dh_p * silu(g_p)
dout rows are gathered in the prologue; h = silu(g) * u is recomputed from the saved g, u. ds is summed
over H per program into a [N, num_programs_along_H] fp32 buffer, indexed by row n (so the result needs
no un-sorting), and reduced afterwards in a fixed order: deterministic, no atomics. The epilogue also
writes s*h, the right operand of dW2.

Split mode (`TileConfig.split`, chosen per shape by the tuner): the GEMM stores q in bf16 (sorted rows)
with no dSwiGLU epilogue, which frees the registers for GEMM1-sized tiles (two 128x128 accumulators;
with the epilogue that shape spills), and a second, elementwise kernel does the dSwiGLU, s*h and ds from
q, g, u. It costs one extra N x H bf16 round trip and rounds q to bf16 first (stock's autograd also
hands dh to the SwiGLU backward in bf16).

Block FP8 (dout and W2 `BlockScaled`; W2 as its transposed copy W2^T [E, H, D], K-major for the FP8
MMA): the fused mode only, each program 128 rows (one plan tile) by 2 x 64 columns (one 128-wide scale
block). The epilogue quantizes what the later GEMMs read, where it is in registers: dg and du in 1x128
row blocks for dx, and dg, du, s*h in the token-tile layout (`quant.quantize_token_tiles`) for the
weight gradients. No bf16 copy of dg, du or s*h is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import INTERPRET, e4m3_scale, matrix_descriptor, new_output, tma_ok, to_e4m3
from .configs import tile_config
from .epilogue import dswiglu, dswiglu_fp8, dswiglu_rows_bf16, store_sorted
from .mainloop import row_mainloop
from .schedule import row_tile


@triton.jit
def _dgrad_swiglu_kernel(
    dout_ptr, w2_ptr,  # dout [rows, D]; w2 [E, D, H]
    g_ptr, u_ptr, scores_ptr,  # g, u [N, H] sorted; scores [N] row order (fp32)
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    dg_ptr, du_ptr, hs_ptr, ds_part_ptr,  # dg, du, s*h [N, H] sorted; ds_part [N, num_n] row order, fp32
    douts_ptr, w2s_ptr, dgs_ptr, dus_ptr,  # FP8: scales of dout [rows, D/128], W2^T [E, H/128, D/128]; dg, du [N, H/128]
    dgt_ptr, dgt_s_ptr, dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr, P,  # FP8: token tiles [H, P], scales [H, P/128]
    D, H, rows_per_token,
    stride_dt, stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STORE_Q: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr,
):
    # each program covers 2*BLOCK_N columns of H with two accumulators sharing every gathered dout tile
    # (like GEMM1's gate/up pair): half the A-operand traffic per MMA of a single-accumulator tile
    num_n = tl.cdiv(H, 2 * BLOCK_N)
    expert, pid_n, row0, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                                 BLOCK_M)
    if expert < 0:
        return
    routed = tl.load(order_ptr + rows, mask=row_ok, other=0)
    if A_TMA:  # dout already in sorted order (FP8: quantize_sorted_rows), contiguous rows through TMA
        src = rows
    else:
        src = routed // rows_per_token
    offs_n0 = pid_n * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n1 = offs_n0 + BLOCK_N
    n0_ok = offs_n0 < H
    n1_ok = offs_n1 < H
    offs_k = tl.arange(0, BLOCK_K)
    a_off = src.to(tl.int64)[:, None] * stride_dt + offs_k[None, :]
    b_off = 0
    if not B_TMA:
        b_off = expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n0[None, :] * stride_wn
    b1_src = w2_ptr
    if not B_TMA:
        b1_src = w2_ptr + BLOCK_N * stride_wn
    kb = tl.cdiv(D, BLOCK_K)  # FP8: K blocks per row (BLOCK_K is the 128-wide scale block)
    w_scale_base = expert.to(tl.int64) * tl.cdiv(H, BLOCK_K) * kb
    q0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q0, q1 = row_mainloop(q0, q1, dout_ptr, a_off, row_ok, row0, w2_ptr, b1_src, b_off, n0_ok, n1_ok,
                          expert * H + pid_n * 2 * BLOCK_N, 0, D, stride_wk, A_TMA=A_TMA, B_TMA=B_TMA, B_TRANS=B_TMA,
                          TWO_B=True, WS=False,
                          BLOCK_K=BLOCK_K, INTERPRET=INTERPRET, a_scale=douts_ptr, a_scale_off=src.to(tl.int64) * kb,
                          b0_scale=w2s_ptr, b1_scale=w2s_ptr, b0_scale_off=w_scale_base + (offs_n0 // BLOCK_K) * kb,
                          b1_scale_off=w_scale_base + (offs_n1 // BLOCK_K) * kb, SCALED=FP8,
                          b1_row=expert * H + pid_n * 2 * BLOCK_N + BLOCK_N)

    if STORE_Q:  # split mode: q (bf16, sorted rows) goes to dg's buffer; _dswiglu_rows_kernel does the rest
        store_sorted(dg_ptr, q0, rows, row_ok, offs_n0, n0_ok, H, INTERPRET)
        store_sorted(dg_ptr, q1, rows, row_ok, offs_n1, n1_ok, H, INTERPRET)
        return
    s = tl.load(scores_ptr + routed, mask=row_ok, other=0.0)
    if FP8:  # 2 * BLOCK_N == 128: this program's columns are one scale block of dg and du
        # Registers decide the order: dg, du, s*h of one half at a time go to the token tiles, and only
        # their row maxima are kept; the first half's dg, du are then recomputed (g and u reloaded) for the
        # 1x128 row quantization instead of being held across the second half (holding them spilled)
        tile = tl.program_id(0) // num_n
        dg, du, ds_part = dswiglu_fp8(q0, rows, row_ok, offs_n0, H, g_ptr, u_ptr, s, tile, P, dgt_ptr, dgt_s_ptr,
                                      dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr, BLOCK_M, INTERPRET)
        amax_dg = tl.max(tl.abs(dg), axis=1)
        amax_du = tl.max(tl.abs(du), axis=1)
        dg, du, ds_part1 = dswiglu_fp8(q1, rows, row_ok, offs_n1, H, g_ptr, u_ptr, s, tile, P, dgt_ptr, dgt_s_ptr,
                                       dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr, BLOCK_M, INTERPRET)
        ds_part += ds_part1
        dg_scale, dg_inv = e4m3_scale(tl.maximum(amax_dg, tl.max(tl.abs(dg), axis=1)))
        du_scale, du_inv = e4m3_scale(tl.maximum(amax_du, tl.max(tl.abs(du), axis=1)))
        store_sorted(dg_ptr, to_e4m3(dg, dg_inv[:, None], INTERPRET), rows, row_ok, offs_n1, n1_ok, H, INTERPRET)
        store_sorted(du_ptr, to_e4m3(du, du_inv[:, None], INTERPRET), rows, row_ok, offs_n1, n1_ok, H, INTERPRET)
        dg, du = dswiglu_rows_bf16(q0, rows, row_ok, offs_n0, H, g_ptr, u_ptr, s, INTERPRET)
        store_sorted(dg_ptr, to_e4m3(dg, dg_inv[:, None], INTERPRET), rows, row_ok, offs_n0, n0_ok, H, INTERPRET)
        store_sorted(du_ptr, to_e4m3(du, du_inv[:, None], INTERPRET), rows, row_ok, offs_n0, n0_ok, H, INTERPRET)
        tl.store(dgs_ptr + rows.to(tl.int64) * num_n + pid_n, dg_scale, mask=row_ok)
        tl.store(dus_ptr + rows.to(tl.int64) * num_n + pid_n, du_scale, mask=row_ok)
    else:
        ds_part = dswiglu(q0, rows, row_ok, offs_n0, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET)
        ds_part += dswiglu(q1, rows, row_ok, offs_n1, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET)
    tl.store(ds_part_ptr + routed.to(tl.int64) * num_n + pid_n, ds_part, mask=row_ok)


@triton.jit
def _dswiglu_rows_kernel(
    q_ptr, g_ptr, u_ptr, scores_ptr, order_ptr,  # q, g, u [N, H] sorted; scores [N] row order (fp32)
    dg_ptr, du_ptr, hs_ptr, ds_part_ptr,  # dg may alias q: each element is read before it is written
    N, H,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    routed = tl.load(order_ptr + rows, mask=row_ok, other=0)
    s = tl.load(scores_ptr + routed, mask=row_ok, other=0.0)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * H + offs_n[None, :],
                mask=row_ok[:, None] & (offs_n < H)[None, :], other=0.0).to(tl.float32)
    ds_part = dswiglu(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET)
    tl.store(ds_part_ptr + routed.to(tl.int64) * num_n + pid_n, ds_part, mask=row_ok)


_ROWS_BLOCK_M, _ROWS_BLOCK_N = 64, 128


def dgrad_swiglu(dout_RD, w2_EDH, g_NH, u_NH, scores_N, plan: RoutingPlan, precision: str, sorted_rows: bool = False):
    """(dg_NH, du_NH, hs_NH = s*h) in g's dtype, sorted rows, and ds_N fp32 in row order; dout_RD holds
    the plan's source rows of the output gradient, scores_N the score of each row.

    Block FP8: dout_RD is `BlockScaled` rows and w2_EDH the transposed copy W2^T [E, H, D] (`BlockScaled`);
    returns (dg, du as `BlockScaled` 1x128 rows [N, H]; (dg, du, s*h) as `BlockScaled` token tiles [H, P];
    ds_N). `sorted_rows`: dout_RD holds the plan's rows in sorted order ([N, D], read through TMA)."""
    if isinstance(dout_RD, BlockScaled):
        return _dgrad_swiglu_fp8(dout_RD, w2_EDH, g_NH, u_NH, scores_N, plan, precision, sorted_rows)
    N, H = g_NH.shape
    E, D, _ = w2_EDH.shape
    cfg = tile_config("dgrad_swiglu", D, H, precision)
    num_n = triton.cdiv(H, 2 * cfg.block_n)
    dg, du, hs = (new_output((N, H), g_NH.dtype, g_NH.device) for _ in range(3))
    # the interpreter's small tiles keep CPU tests fast
    rows_block_n = cfg.block_n if INTERPRET else _ROWS_BLOCK_N
    num_n_ds = triton.cdiv(H, rows_block_n) if cfg.split else num_n
    ds_part = new_output((N, num_n_ds), torch.float32, g_NH.device)
    grid = (plan.layout.num_tiles * num_n,)
    if grid[0] > 0:
        _dgrad_swiglu_kernel[grid](
            dout_RD, w2_EDH, g_NH, u_NH, scores_N, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1,
            dg, du, hs, ds_part, *([dg] * 10), 0, D, H, plan.rows_per_token, dout_RD.stride(0), w2_EDH.stride(0),
            w2_EDH.stride(1), 1,
            BLOCK_M=plan.layout.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STORE_Q=cfg.split, A_TMA=False,
            B_TMA=False, FP8=False,
            INTERPRET=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if cfg.split and N > 0:
        # q sits in dg's buffer; every element of dg is read as q before the same program overwrites it
        block_m = min(_ROWS_BLOCK_M, plan.layout.block_m)
        _dswiglu_rows_kernel[(triton.cdiv(N, block_m) * num_n_ds,)](
            dg, g_NH, u_NH, scores_N, plan.order_N, dg, du, hs, ds_part, N, H,
            BLOCK_M=block_m, BLOCK_N=rows_block_n, INTERPRET=INTERPRET, num_warps=8,
        )
    return dg, du, hs, ds_part.sum(dim=1)


def _dgrad_swiglu_fp8(dout_RD: BlockScaled, w2t_EHD: BlockScaled, g_NH, u_NH, scores_N, plan: RoutingPlan,
                      precision: str, sorted_rows: bool):
    N, H = g_NH.shape
    E, _, D = w2t_EHD.data.shape
    cfg = tile_config("dgrad_swiglu", D, H, precision)
    assert 2 * cfg.block_n == cfg.block_k == plan.layout.block_m == 128 and not cfg.split, \
        "block FP8 dgrad: 128 rows by 2 x 64 columns per program, 128-wide K blocks, fused epilogue"
    num_n = H // 128
    dev = g_NH.device
    rows = [BlockScaled(new_output((N, H), torch.float8_e4m3fn, dev), new_output((N, num_n), torch.float32, dev),
                        (1, 128)) for _ in range(2)]  # dg, du: 1x128 rows for dx
    P = plan.layout.num_tiles * 128
    tiles = [BlockScaled(new_output((H, P), torch.float8_e4m3fn, dev), new_output((H, P // 128), torch.float32, dev),
                         (1, 128)) for _ in range(3)]  # dg, du, s*h: token tiles for the weight gradients
    ds_part = new_output((N, num_n), torch.float32, dev)
    grid = (plan.layout.num_tiles * num_n,)
    if grid[0] > 0:
        w2t = w2t_EHD.data
        dout = dout_RD.data
        if sorted_rows:
            assert tma_ok(dout), "sorted rows are read through TMA: contiguous, 16-byte aligned rows"
            dout = matrix_descriptor(dout, [plan.layout.block_m, cfg.block_k])
        b_tma = cfg.tma and tma_ok(w2t)
        w2t_in = matrix_descriptor(w2t, [cfg.block_n, cfg.block_k]) if b_tma else w2t  # W2^T as [E*H, D]
        _dgrad_swiglu_kernel[grid](
            dout, w2t_in, g_NH, u_NH, scores_N, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1,
            rows[0].data, rows[1].data, rows[0].data, ds_part, dout_RD.scale, w2t_EHD.scale, rows[0].scale,
            rows[1].scale, *(x for t in tiles for x in (t.data, t.scale)), P, D, H, plan.rows_per_token,
            dout_RD.data.stride(0), w2t.stride(0), w2t.stride(2), w2t.stride(1),  # B[k=d, n=h] = W2^T[e, h, d]
            BLOCK_M=plan.layout.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STORE_Q=False, A_TMA=sorted_rows,
            B_TMA=b_tma, FP8=True,
            INTERPRET=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return rows[0], rows[1], tuple(tiles), ds_part.sum(dim=1)
