"""Forward GEMM1: gather token rows, gate and up projections in one pass over D, SwiGLU epilogue.

For the expert-sorted rows p of one tile (all of expert e):
    g_p = x_{tok(p)} W1_e^T,  u_p = x_{tok(p)} W3_e^T,  h_p = silu(g_p) * u_p
The rows of x are gathered by index in the prologue (no (T*K, D) copy of x is made); g, u and h are
stored in sorted order for GEMM2 and the backward.

With `TileConfig.tma` the weight tiles come through Hopper TMA descriptors over W viewed as [E*H, D]
(the gathered x rows cannot: TMA has no row gather on Hopper). A tile that runs past expert e's H rows
reads expert e+1's rows into columns the store masks off; columns past D are zero-filled by TMA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast_rne, interpret_flag, matrix_descriptor, mma, new_output, row_tile, tma_ok
from .configs import tile_config


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w1_ptr, w3_ptr,  # x [T, D]; w1, w3 [E, H, D] (pointers, or TMA descriptors over [E*H, D])
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    g_ptr, u_ptr, h_ptr,  # [N, H] each, sorted order
    D, H, top_k,
    stride_xt, stride_we, stride_wh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    num_n = tl.cdiv(H, BLOCK_N)
    expert, pid_n, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                           BLOCK_M)
    if expert < 0:
        return
    tok = tl.load(order_ptr + rows, mask=row_ok, other=0) // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    if not W_TMA:
        w_off = expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wh + offs_k[:, None]
        w1_ptrs = w1_ptr + w_off
        w3_ptrs = w3_ptr + w_off
    w_row = expert * H + pid_n * BLOCK_N

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        k_ok = offs_k < D - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_TMA:
            b1 = w1_ptr.load([w_row, k * BLOCK_K]).T
            b3 = w3_ptr.load([w_row, k * BLOCK_K]).T
        else:
            b1 = tl.load(w1_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            b3 = tl.load(w3_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w1_ptrs += BLOCK_K
            w3_ptrs += BLOCK_K
        acc_g = mma(a, b1, acc_g, INTERPRET)
        acc_u = mma(a, b3, acc_u, INTERPRET)
        a_ptrs += BLOCK_K

    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out_off = rows.to(tl.int64)[:, None] * H + offs_n[None, :]
    out_ok = row_ok[:, None] & n_ok[None, :]
    tl.store(g_ptr + out_off, cast_rne(acc_g, g_ptr.dtype.element_ty, INTERPRET), mask=out_ok)
    tl.store(u_ptr + out_off, cast_rne(acc_u, u_ptr.dtype.element_ty, INTERPRET), mask=out_ok)
    tl.store(h_ptr + out_off, cast_rne(h, h_ptr.dtype.element_ty, INTERPRET), mask=out_ok)


def gemm1_swiglu(x_TD, w1_EHD, w3_EHD, order_N, tile_expert, tile_row, offsets_E1, top_k):
    """Returns (g_NH, u_NH, h_NH) in bf16, expert-sorted rows."""
    N = order_N.numel()
    D = x_TD.shape[1]
    E, H, _ = w1_EHD.shape
    g, u, h = (new_output((N, H), torch.bfloat16, x_TD.device) for _ in range(3))
    cfg = tile_config("gemm1_swiglu", D, H)
    grid = (tile_expert.numel() * triton.cdiv(H, cfg.block_n),)
    if grid[0] == 0:
        return g, u, h
    w1, w3 = w1_EHD, w3_EHD
    use_tma = cfg.tma and tma_ok(w1_EHD, w3_EHD)
    if use_tma:
        w1, w3 = (matrix_descriptor(w, [cfg.block_n, cfg.block_k]) for w in (w1_EHD, w3_EHD))
    _gemm1_swiglu_kernel[grid](
        x_TD, w1, w3, order_N, tile_expert, tile_row, offsets_E1, g, u, h,
        D, H, top_k, x_TD.stride(0), w1_EHD.stride(0), w1_EHD.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, W_TMA=use_tma, INTERPRET=interpret_flag(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return g, u, h
