"""Forward GEMM1: gather rows, gate and up projections in one pass over D, SwiGLU epilogue.

For the expert-sorted rows p of one tile (all of local expert e), with source row r(p) (the plan's
token order[p] // K, or the received row order[p]):
    g_p = x_{r(p)} W1_e^T,  u_p = x_{r(p)} W3_e^T,  h_p = silu(g_p) * u_p
Rows are gathered by index in the prologue (no (N, D) copy of x is made); g, u and h are stored in
sorted order for GEMM2 and the backward.

With `TileConfig.tma` the weight tiles come through Hopper TMA descriptors over W viewed as [E*H, D]
(the gathered rows cannot: TMA has no row gather on Hopper). A tile that runs past expert e's H rows
reads expert e+1's rows into columns the store masks off; columns past D are zero-filled by TMA.

Block FP8 (x, W1, W3 as `BlockScaled`): the main loop applies x's 1x128 and the weights' 128x128 scales
per K block; g and u are still stored in bf16 (the backward's residuals), and h, GEMM2's operand, is
quantized in the epilogue: rounded to bf16 first (the value the bf16 path would store, which the
emulation quantizes too), then one power-of-two scale per row of the tile's 128 columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

import torch

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import INTERPRET, cast_rne, e4m3_scale, matrix_descriptor, new_output, tma_ok, to_e4m3
from .configs import tile_config
from .epilogue import store_sorted, swiglu
from .mainloop import row_mainloop
from .schedule import row_tile


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w1_ptr, w3_ptr,  # x [rows, D]; w1, w3 [E, H, D] (pointers, or TMA descriptors over [E*H, D])
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    g_ptr, u_ptr, h_ptr,  # [N, H] each, sorted order
    xs_ptr, w1s_ptr, w3s_ptr, hs_ptr,  # FP8 scales: x [rows, D/128], w [E, H/128, D/128]; h [N, H/128] out
    D, H, rows_per_token,
    stride_xt, stride_we, stride_wh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    FP8: tl.constexpr, INTERPRET: tl.constexpr,
):
    num_n = tl.cdiv(H, BLOCK_N)
    expert, pid_n, _, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                              BLOCK_M)
    if expert < 0:
        return
    src = tl.load(order_ptr + rows, mask=row_ok, other=0) // rows_per_token
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_off = src.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    w_off = 0
    if not W_TMA:
        w_off = expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wh + offs_k[:, None]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb = tl.cdiv(D, BLOCK_K)  # FP8: K blocks per row (BLOCK_K is the 128-wide scale block)
    w_scale_off = expert.to(tl.int64) * tl.cdiv(H, BLOCK_K) * kb + (offs_n // BLOCK_K) * kb
    acc_g, acc_u = row_mainloop(acc_g, acc_u, x_ptr, a_off, row_ok, 0, w1_ptr, w3_ptr, w_off, n_ok, n_ok,
                                expert * H + pid_n * BLOCK_N, 0, D, 1, A_TMA=False, B_TMA=W_TMA, B_TRANS=True,
                                TWO_B=True, WS=False, BLOCK_K=BLOCK_K, INTERPRET=INTERPRET,
                                a_scale=xs_ptr, a_scale_off=src.to(tl.int64) * kb, b0_scale=w1s_ptr, b1_scale=w3s_ptr,
                                b0_scale_off=w_scale_off, b1_scale_off=w_scale_off, SCALED=FP8)
    store_sorted(g_ptr, acc_g, rows, row_ok, offs_n, n_ok, H, INTERPRET)
    store_sorted(u_ptr, acc_u, rows, row_ok, offs_n, n_ok, H, INTERPRET)
    h = swiglu(acc_g, acc_u)
    if FP8:  # BLOCK_N == 128: one scale per row of this tile
        h = cast_rne(h, tl.bfloat16, INTERPRET).to(tl.float32)
        scale, inv = e4m3_scale(tl.max(tl.abs(h), axis=1))
        store_sorted(h_ptr, to_e4m3(h, inv[:, None], INTERPRET), rows, row_ok, offs_n, n_ok, H, INTERPRET)
        tl.store(hs_ptr + rows.to(tl.int64) * tl.cdiv(H, BLOCK_N) + pid_n, scale, mask=row_ok)
    else:
        store_sorted(h_ptr, h, rows, row_ok, offs_n, n_ok, H, INTERPRET)


def gemm1_swiglu(x_RD, w1_EHD, w3_EHD, plan: RoutingPlan, out_dtype, precision: str):
    """(g_NH, u_NH, h_NH) in out_dtype, expert-sorted rows; x_RD holds the plan's source rows.

    Block FP8: x_RD, w1_EHD, w3_EHD are `BlockScaled` (x 1x128, weights 128x128) and h comes back
    as a `BlockScaled` e4m3 [N, H] with 1x128 scales (g and u stay in out_dtype)."""
    fp8 = isinstance(x_RD, BlockScaled)
    x, w1, w3 = (t.data if fp8 else t for t in (x_RD, w1_EHD, w3_EHD))
    N = plan.num_rows
    D = x.shape[1]
    E, H, _ = w1.shape
    cfg = tile_config("gemm1_swiglu", D, H, precision)
    g, u = (new_output((N, H), out_dtype, x.device) for _ in range(2))
    h = new_output((N, H), torch.float8_e4m3fn if fp8 else out_dtype, x.device)
    h_scale = new_output((N, H // cfg.block_k), torch.float32, x.device) if fp8 else None
    h_out = BlockScaled(h, h_scale, (1, cfg.block_k)) if fp8 else h
    grid = (plan.layout.num_tiles * triton.cdiv(H, cfg.block_n),)
    if grid[0] == 0:
        return g, u, h_out
    if fp8:
        assert cfg.block_n == cfg.block_k == 128, "block FP8 GEMM1 needs 128-wide N and K tiles (the scale block)"
    w1_t, w3_t = w1, w3
    use_tma = cfg.tma and tma_ok(w1, w3)
    if use_tma:
        w1_t, w3_t = (matrix_descriptor(w, [cfg.block_n, cfg.block_k]) for w in (w1, w3))
    scales = (x_RD.scale, w1_EHD.scale, w3_EHD.scale, h_scale) if fp8 else (x, x, x, x)
    _gemm1_swiglu_kernel[grid](
        x, w1_t, w3_t, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1, g, u, h, *scales,
        D, H, plan.rows_per_token, x.stride(0), w1.stride(0), w1.stride(1),
        BLOCK_M=plan.layout.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, W_TMA=use_tma, FP8=fp8,
        INTERPRET=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return g, u, h_out
