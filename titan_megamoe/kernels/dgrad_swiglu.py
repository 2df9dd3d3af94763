"""Backward through GEMM2 and SwiGLU, with the routing-score gradient in the epilogue.

For the expert-sorted rows p of one tile (expert e, routed row n = order(p), token t, score s_p):
    q_p  = dout_t W2_e                       (the gradient of h before the score)
    ds_p = <dout_t, y_p> = <q_p, h_p>        (so the expert output y is never stored)
    dh_p = s_p q_p
    dg_p = dh_p * u_p * silu'(g_p),   du_p = dh_p * silu(g_p)
dout rows are gathered by token in the prologue; h = silu(g) * u is recomputed from the saved g, u.
ds is summed over H per program into a [N, num_programs_along_H] fp32 buffer, indexed by routed row (so
the result needs no un-sorting), and reduced afterwards in a fixed order: deterministic, no atomics. The epilogue also writes s*h, the right operand of dW2.

Split mode (`TileConfig.split`, chosen per shape by the tuner): the GEMM stores q in bf16 (sorted rows)
with no dSwiGLU epilogue, which frees the registers for GEMM1-sized tiles (two 128x128 accumulators;
with the epilogue that shape spills), and a second, elementwise kernel does the dSwiGLU, s*h and ds from
q, g, u. It costs one extra N x H bf16 round trip and rounds q to bf16 first (stock's autograd also
hands dh to the SwiGLU backward in bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast_rne, interpret_flag, mma, new_output, row_tile
from .configs import tile_config


@triton.jit
def _dswiglu_epilogue(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET: tl.constexpr):
    """dSwiGLU for one [BLOCK_M, BLOCK_N] block of q; returns this block's share of ds."""
    n_ok = offs_n < H
    tile_off = rows.to(tl.int64)[:, None] * H + offs_n[None, :]
    tile_ok = row_ok[:, None] & n_ok[None, :]
    g = tl.load(g_ptr + tile_off, mask=tile_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + tile_off, mask=tile_ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # h is recomputed from the saved g and u (cheaper than saving and re-reading it)
    h = silu * u
    ds_part = tl.sum(q * h, axis=1)
    # s*h is dW2's right operand (dW2_e = sum_p dout_t^T s_p h_p): written here, where h is already in
    # registers, so the weight-gradient GEMM needs no per-row scaling in its main loop
    tl.store(hs_ptr + tile_off, cast_rne(h * s[:, None], hs_ptr.dtype.element_ty, INTERPRET), mask=tile_ok)
    dh = q * s[:, None]
    tl.store(du_ptr + tile_off, cast_rne(dh * silu, du_ptr.dtype.element_ty, INTERPRET), mask=tile_ok)
    dg = dh * u * (sig + silu * (1.0 - sig))
    tl.store(dg_ptr + tile_off, cast_rne(dg, dg_ptr.dtype.element_ty, INTERPRET), mask=tile_ok)
    return ds_part


@triton.jit
def _dgrad_swiglu_kernel(
    dout_ptr, w2_ptr,  # dout [T, D]; w2 [E, D, H]
    g_ptr, u_ptr, scores_ptr,  # g, u [N, H] sorted; scores [N] routed-row order (fp32)
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    dg_ptr, du_ptr, hs_ptr, ds_part_ptr,  # dg, du, s*h [N, H] sorted; ds_part [N, num_n] routed, fp32
    D, H, top_k,
    stride_dt, stride_we, stride_wd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STORE_Q: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # each program covers 2*BLOCK_N columns of H with two accumulators sharing every gathered dout tile
    # (like GEMM1's gate/up pair): half the A-operand traffic per MMA of a single-accumulator tile
    num_n = tl.cdiv(H, 2 * BLOCK_N)
    expert, pid_n, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                           BLOCK_M)
    if expert < 0:
        return
    routed = tl.load(order_ptr + rows, mask=row_ok, other=0)
    tok = routed // top_k
    offs_n0 = pid_n * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n1 = offs_n0 + BLOCK_N
    n0_ok = offs_n0 < H
    n1_ok = offs_n1 < H
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = dout_ptr + tok.to(tl.int64)[:, None] * stride_dt + offs_k[None, :]
    b_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wd + offs_n0[None, :]
    q0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        k_ok = offs_k < D - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b0 = tl.load(b_ptrs, mask=k_ok[:, None] & n0_ok[None, :], other=0.0)
        b1 = tl.load(b_ptrs + BLOCK_N, mask=k_ok[:, None] & n1_ok[None, :], other=0.0)
        q0 = mma(a, b0, q0, INTERPRET)
        q1 = mma(a, b1, q1, INTERPRET)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wd

    if STORE_Q:  # split mode: q (bf16, sorted rows) goes to dg's buffer; _dswiglu_rows_kernel does the rest
        q_off = rows.to(tl.int64)[:, None] * H + offs_n0[None, :]
        tl.store(dg_ptr + q_off, cast_rne(q0, dg_ptr.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & n0_ok[None, :])
        tl.store(dg_ptr + q_off + BLOCK_N, cast_rne(q1, dg_ptr.dtype.element_ty, INTERPRET),
                 mask=row_ok[:, None] & n1_ok[None, :])
        return
    s = tl.load(scores_ptr + routed, mask=row_ok, other=0.0)
    ds_part = _dswiglu_epilogue(q0, rows, row_ok, offs_n0, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET)
    ds_part += _dswiglu_epilogue(q1, rows, row_ok, offs_n1, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET)
    tl.store(ds_part_ptr + routed.to(tl.int64) * num_n + pid_n, ds_part, mask=row_ok)


@triton.jit
def _dswiglu_rows_kernel(
    q_ptr, g_ptr, u_ptr, scores_ptr, order_ptr,  # q, g, u [N, H] sorted; scores [N] routed (fp32)
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
    ds_part = _dswiglu_epilogue(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET)
    tl.store(ds_part_ptr + routed.to(tl.int64) * num_n + pid_n, ds_part, mask=row_ok)


_ROWS_BLOCK_M, _ROWS_BLOCK_N = 64, 128


def dgrad_swiglu(dout_TD, w2_EDH, g_NH, u_NH, scores_N, order_N, tile_expert, tile_row, offsets_E1, top_k):
    """Returns (dg_NH, du_NH, hs_NH = s*h) bf16 sorted rows and ds_N fp32 in routed-row order."""
    N, H = g_NH.shape
    E, D, _ = w2_EDH.shape
    cfg = tile_config("dgrad_swiglu", D, H)
    num_n = triton.cdiv(H, 2 * cfg.block_n)
    dg = new_output((N, H), torch.bfloat16, g_NH.device)
    du = new_output((N, H), torch.bfloat16, g_NH.device)
    hs = new_output((N, H), torch.bfloat16, g_NH.device)
    # the interpreter's small tiles keep CPU tests fast
    rows_block_n = cfg.block_n if interpret_flag() else _ROWS_BLOCK_N
    num_n_ds = triton.cdiv(H, rows_block_n) if cfg.split else num_n
    ds_part = new_output((N, num_n_ds), torch.float32, g_NH.device)
    grid = (tile_expert.numel() * num_n,)
    if grid[0] > 0:
        _dgrad_swiglu_kernel[grid](
            dout_TD, w2_EDH, g_NH, u_NH, scores_N, order_N, tile_expert, tile_row, offsets_E1,
            dg, du, hs, ds_part, D, H, top_k, dout_TD.stride(0), w2_EDH.stride(0), w2_EDH.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STORE_Q=cfg.split,
            INTERPRET=interpret_flag(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if cfg.split and N > 0:
        # q sits in dg's buffer; every element of dg is read as q before the same program overwrites it
        block_m = min(_ROWS_BLOCK_M, cfg.block_m)
        _dswiglu_rows_kernel[(triton.cdiv(N, block_m) * num_n_ds,)](
            dg, g_NH, u_NH, scores_N, order_N, dg, du, hs, ds_part, N, H,
            BLOCK_M=block_m, BLOCK_N=rows_block_n,
            INTERPRET=interpret_flag(), num_warps=8,
        )
    return dg, du, hs, ds_part.sum(dim=1)
