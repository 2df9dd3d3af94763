"""Forward GEMM1: gather rows, gate and up projections in one pass over D, SwiGLU epilogue.

For the expert-sorted rows p of one tile (all of local expert e), with source row r(p) (the plan's
token order[p] // K, or the received row order[p]):
    g_p = x_{r(p)} W1_e^T,  u_p = x_{r(p)} W3_e^T,  h_p = silu(g_p) * u_p
Rows are gathered by index in the prologue (no (N, D) copy of x is made); g, u and h are stored in
sorted order for GEMM2 and the backward.

With `TileConfig.tma` the weight tiles come through Hopper TMA descriptors over W viewed as [E*H, D]
(the gathered rows cannot: TMA has no row gather on Hopper). A tile that runs past expert e's H rows
reads expert e+1's rows into columns the store masks off; columns past D are zero-filled by TMA.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..plan import RoutingPlan
from .common import INTERPRET, matrix_descriptor, new_output, tma_ok
from .configs import tile_config
from .epilogue import store_sorted, swiglu
from .mainloop import row_mainloop
from .schedule import row_tile


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w1_ptr, w3_ptr,  # x [rows, D]; w1, w3 [E, H, D] (pointers, or TMA descriptors over [E*H, D])
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    g_ptr, u_ptr, h_ptr,  # [N, H] each, sorted order
    D, H, rows_per_token,
    stride_xt, stride_we, stride_wh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
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
    acc_g, acc_u = row_mainloop(acc_g, acc_u, x_ptr, a_off, row_ok, 0, w1_ptr, w3_ptr, w_off, n_ok, n_ok,
                                expert * H + pid_n * BLOCK_N, 0, D, 1, A_TMA=False, B_TMA=W_TMA, B_TRANS=True,
                                TWO_B=True, WS=False, BLOCK_K=BLOCK_K, INTERPRET=INTERPRET)
    h = swiglu(acc_g, acc_u)
    store_sorted(g_ptr, acc_g, rows, row_ok, offs_n, n_ok, H, INTERPRET)
    store_sorted(u_ptr, acc_u, rows, row_ok, offs_n, n_ok, H, INTERPRET)
    store_sorted(h_ptr, h, rows, row_ok, offs_n, n_ok, H, INTERPRET)


def gemm1_swiglu(x_RD, w1_EHD, w3_EHD, plan: RoutingPlan, out_dtype, precision: str):
    """(g_NH, u_NH, h_NH) in out_dtype, expert-sorted rows; x_RD holds the plan's source rows."""
    N = plan.num_rows
    D = x_RD.shape[1]
    E, H, _ = w1_EHD.shape
    g, u, h = (new_output((N, H), out_dtype, x_RD.device) for _ in range(3))
    cfg = tile_config("gemm1_swiglu", D, H, precision)
    grid = (plan.layout.num_tiles * triton.cdiv(H, cfg.block_n),)
    if grid[0] == 0:
        return g, u, h
    w1, w3 = w1_EHD, w3_EHD
    use_tma = cfg.tma and tma_ok(w1_EHD, w3_EHD)
    if use_tma:
        w1, w3 = (matrix_descriptor(w, [cfg.block_n, cfg.block_k]) for w in (w1_EHD, w3_EHD))
    _gemm1_swiglu_kernel[grid](
        x_RD, w1, w3, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1, g, u, h,
        D, H, plan.rows_per_token, x_RD.stride(0), w1_EHD.stride(0), w1_EHD.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, W_TMA=use_tma, INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return g, u, h
