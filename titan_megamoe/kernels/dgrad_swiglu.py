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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import RoutingPlan
from .common import INTERPRET, new_output
from .configs import tile_config
from .epilogue import dswiglu, store_sorted
from .mainloop import row_mainloop
from .schedule import row_tile


@triton.jit
def _dgrad_swiglu_kernel(
    dout_ptr, w2_ptr,  # dout [rows, D]; w2 [E, D, H]
    g_ptr, u_ptr, scores_ptr,  # g, u [N, H] sorted; scores [N] row order (fp32)
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    dg_ptr, du_ptr, hs_ptr, ds_part_ptr,  # dg, du, s*h [N, H] sorted; ds_part [N, num_n] row order, fp32
    D, H, rows_per_token,
    stride_dt, stride_we, stride_wd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STORE_Q: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # each program covers 2*BLOCK_N columns of H with two accumulators sharing every gathered dout tile
    # (like GEMM1's gate/up pair): half the A-operand traffic per MMA of a single-accumulator tile
    num_n = tl.cdiv(H, 2 * BLOCK_N)
    expert, pid_n, _, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                              BLOCK_M)
    if expert < 0:
        return
    routed = tl.load(order_ptr + rows, mask=row_ok, other=0)
    src = routed // rows_per_token
    offs_n0 = pid_n * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n1 = offs_n0 + BLOCK_N
    n0_ok = offs_n0 < H
    n1_ok = offs_n1 < H
    offs_k = tl.arange(0, BLOCK_K)
    a_off = src.to(tl.int64)[:, None] * stride_dt + offs_k[None, :]
    b_off = expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wd + offs_n0[None, :]
    q0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q0, q1 = row_mainloop(q0, q1, dout_ptr, a_off, row_ok, 0, w2_ptr, w2_ptr + BLOCK_N, b_off, n0_ok, n1_ok, 0, 0,
                          D, stride_wd, A_TMA=False, B_TMA=False, B_TRANS=False, TWO_B=True, WS=False,
                          BLOCK_K=BLOCK_K, INTERPRET=INTERPRET)

    if STORE_Q:  # split mode: q (bf16, sorted rows) goes to dg's buffer; _dswiglu_rows_kernel does the rest
        store_sorted(dg_ptr, q0, rows, row_ok, offs_n0, n0_ok, H, INTERPRET)
        store_sorted(dg_ptr, q1, rows, row_ok, offs_n1, n1_ok, H, INTERPRET)
        return
    s = tl.load(scores_ptr + routed, mask=row_ok, other=0.0)
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


def dgrad_swiglu(dout_RD, w2_EDH, g_NH, u_NH, scores_N, plan: RoutingPlan, precision: str):
    """(dg_NH, du_NH, hs_NH = s*h) in g's dtype, sorted rows, and ds_N fp32 in row order; dout_RD holds
    the plan's source rows of the output gradient, scores_N the score of each row."""
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
            dg, du, hs, ds_part, D, H, plan.rows_per_token, dout_RD.stride(0), w2_EDH.stride(0), w2_EDH.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STORE_Q=cfg.split,
            INTERPRET=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if cfg.split and N > 0:
        # q sits in dg's buffer; every element of dg is read as q before the same program overwrites it
        block_m = min(_ROWS_BLOCK_M, cfg.block_m)
        _dswiglu_rows_kernel[(triton.cdiv(N, block_m) * num_n_ds,)](
            dg, g_NH, u_NH, scores_N, plan.order_N, dg, du, hs, ds_part, N, H,
            BLOCK_M=block_m, BLOCK_N=rows_block_n, INTERPRET=INTERPRET, num_warps=8,
        )
    return dg, du, hs, ds_part.sum(dim=1)
