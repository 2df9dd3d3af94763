"""Forward GEMM1: gather rows, gate and up projections in one pass over D, SwiGLU epilogue.

For the expert-sorted rows p of one tile (all of local expert e), with source row r(p) (the plan's
token order[p] // K, or the received row order[p]):
    g_p = x_{r(p)} W1_e^T,  u_p = x_{r(p)} W3_e^T,  h_p = silu(g_p) * u_p
Rows are gathered by index in the prologue (no (N, D) copy of x is made); g, u and h are stored in
sorted order for GEMM2 and the backward.

With `TileConfig.tma` the weight tiles come through Hopper TMA descriptors over W viewed as [E*H, D]
(the gathered rows cannot: TMA has no row gather on Hopper). A tile that runs past expert e's H rows
reads expert e+1's rows into columns the store masks off; columns past D are zero-filled by TMA.
(Copying x's rows into sorted order first, to read them through TMA as well, lost on the H200 at all
three shapes tuned: 8.63 against 8.26 ms at Mixtral-like D=4096, H=14336; 1.81 against 1.61 ms at
Qwen3-30B-A3B; 6.45 against 6.18 at 235B-A22B; docs/results/tune_gathered_first_20261204T1300.json. Removed.)

Block FP8 (x, W1, W3 as `BlockScaled`): the main loop applies x's 1x128 and the weights' 128x128 scales
per K block; g and u are still stored in bf16 (the backward's residuals), and h, GEMM2's operand, is
quantized in the epilogue: rounded to bf16 first (the value the bf16 path would store, which the
emulation quantizes too), then one power-of-two scale per row of the program's 128 columns (two
64-wide halves computed one after the other).
"""

from __future__ import annotations

from dataclasses import replace

import triton
import triton.language as tl

import torch

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import INTERPRET, cast_rne, cdiv, matrix_descriptor, new_output, tma_ok
from .launch import launch
from .configs import programs_per_plan_tile, tile_config
from .epilogue import store_row_halves_fp8, store_sorted, swiglu
from .mainloop import row_mainloop
from .peer_rows import wait_for_expert_rows
from .schedule import row_tile


@triton.jit
def _gate_up(x_ptr, w1_ptr, w3_ptr, src, row_ok, row0, expert, n0, D, H, stride_xt, stride_we, stride_wh,
             xs_ptr, w1s_ptr, w3s_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             A_TMA: tl.constexpr, W_TMA: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """(g, u) accumulators of the tile's rows for the columns [n0, n0 + BLOCK_N)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_off = src.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    w_off = 0
    if not W_TMA:
        w_off = expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wh + offs_k[:, None]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb = tl.cdiv(D, BLOCK_K)  # FP8: K blocks per row (BLOCK_K is the 128-wide scale block)
    w_scale_off = (expert.to(tl.int64) * tl.cdiv(H, BLOCK_K) + n0 // BLOCK_K) * kb  # the tile's 128x128 blocks
    return row_mainloop(acc_g, acc_u, x_ptr, a_off, row_ok, row0, w1_ptr, w3_ptr, w_off, n_ok, n_ok,
                        expert * H + n0, 0, D, 1, A_TMA=A_TMA, B_TMA=W_TMA, B_TRANS=True,
                        TWO_B=True, WS=False, BLOCK_K=BLOCK_K, INTERPRET=INTERPRET,
                        a_scale=xs_ptr, a_scale_off=src.to(tl.int64) * kb, b0_scale=w1s_ptr, b1_scale=w3s_ptr,
                        b0_scale_off=w_scale_off, b1_scale_off=w_scale_off, SCALED=FP8)


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w1_ptr, w3_ptr,  # x [rows, D]; w1, w3 [E, H, D] (pointers, or TMA descriptors over [E*H, D])
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    g_ptr, u_ptr, h_ptr,  # [N, H] each, sorted order
    xs_ptr, w1s_ptr, w3s_ptr, hs_ptr,  # FP8 scales: x [rows, D/128], w [E, H/128, D/128]; h [N, H/128] out
    arrived_ptr, expected_ptr,  # WAIT: per local expert, int32 counts of landed rows and the count to wait for
    D, H, rows_per_token,
    stride_xt, stride_we, stride_wh,
    BLOCK_M: tl.constexpr, SUB_TILES: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_TMA: tl.constexpr, W_TMA: tl.constexpr, FP8: tl.constexpr, WAIT: tl.constexpr, INTERPRET: tl.constexpr,
):
    # FP8: a program covers 2 x BLOCK_N = 128 columns (one scale block of h) in two passes over D, one
    # 64-wide half at a time: a block-scaled main loop holds each MMA's partial product beside its
    # accumulator, and two 128-wide accumulators plus their partials would not fit in registers
    if FP8:
        span = 2 * BLOCK_N
    else:
        span = BLOCK_N
    num_n = tl.cdiv(H, span)
    expert, pid_n, row0, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                                 BLOCK_M, SUB_TILES, GROUP_M)
    if expert < 0:
        return
    if WAIT:  # expert parallelism, symmetric memory: this expert's rows may still be landing
        wait_for_expert_rows(arrived_ptr, expected_ptr, expert, INTERPRET)
    if A_TMA:  # x already in sorted order (FP8: quantize_sorted_rows), read as contiguous rows
        src = rows
    else:
        src = tl.load(order_ptr + rows, mask=row_ok, other=0) // rows_per_token
    n0 = pid_n * span
    offs_n0 = n0 + tl.arange(0, BLOCK_N)
    g0, u0 = _gate_up(x_ptr, w1_ptr, w3_ptr, src, row_ok, row0, expert, n0, D, H, stride_xt, stride_we, stride_wh,
                      xs_ptr, w1s_ptr, w3s_ptr, BLOCK_M, BLOCK_N, BLOCK_K, A_TMA, W_TMA, FP8, INTERPRET)
    store_sorted(g_ptr, g0, rows, row_ok, offs_n0, offs_n0 < H, H, INTERPRET)
    store_sorted(u_ptr, u0, rows, row_ok, offs_n0, offs_n0 < H, H, INTERPRET)
    h0 = swiglu(g0, u0)
    if FP8:
        offs_n1 = offs_n0 + BLOCK_N
        g1, u1 = _gate_up(x_ptr, w1_ptr, w3_ptr, src, row_ok, row0, expert, n0 + BLOCK_N, D, H, stride_xt, stride_we,
                          stride_wh, xs_ptr, w1s_ptr, w3s_ptr, BLOCK_M, BLOCK_N, BLOCK_K, A_TMA, W_TMA, FP8, INTERPRET)
        store_sorted(g_ptr, g1, rows, row_ok, offs_n1, offs_n1 < H, H, INTERPRET)
        store_sorted(u_ptr, u1, rows, row_ok, offs_n1, offs_n1 < H, H, INTERPRET)
        # h rounded to bf16 first (the value the emulation quantizes), then one scale per row
        h0 = cast_rne(h0, tl.bfloat16, INTERPRET).to(tl.float32)
        h1 = cast_rne(swiglu(g1, u1), tl.bfloat16, INTERPRET).to(tl.float32)
        store_row_halves_fp8(h_ptr, hs_ptr, h0, h1, rows, row_ok, offs_n0, offs_n1, H, pid_n, INTERPRET)
    else:
        store_sorted(h_ptr, h0, rows, row_ok, offs_n0, offs_n0 < H, H, INTERPRET)


def gemm1_swiglu(x_RD, w1_EHD, w3_EHD, plan: RoutingPlan, out_dtype, precision: str, sorted_rows: bool = False,
                 arrivals=None):
    """(g_NH, u_NH, h_NH) in out_dtype, expert-sorted rows; x_RD holds the plan's source rows.

    Block FP8: x_RD, w1_EHD, w3_EHD are `BlockScaled` (x 1x128, weights 128x128) and h comes back
    as a `BlockScaled` e4m3 [N, H] with 1x128 scales (g and u stay in out_dtype). `sorted_rows`: x_RD
    holds the plan's rows already in sorted order ([N, D], FP8's `quantize_sorted_rows`), read through TMA.
    `arrivals` = (arrived, expected), int32 [E] each: each program first waits until its expert's
    arrived count reaches the expected one (rows landing from EP peers, `pipeline.symm_transport`)."""
    fp8 = isinstance(x_RD, BlockScaled)
    x, w1, w3 = (t.data if fp8 else t for t in (x_RD, w1_EHD, w3_EHD))
    N = plan.num_rows
    D = x.shape[1]
    E, H, _ = w1.shape
    cfg = tile_config("gemm1_swiglu", D, H, precision)
    g, u = (new_output((N, H), out_dtype, x.device) for _ in range(2))
    h = new_output((N, H), torch.float8_e4m3fn if fp8 else out_dtype, x.device)
    h_scale = new_output((N, H // 128), torch.float32, x.device) if fp8 else None
    h_out = BlockScaled(h, h_scale, (1, 128)) if fp8 else h
    ws_gluon = fp8 and cfg.gluon and cfg.warp_specialize and sorted_rows and arrivals is None and tma_ok(x, w1, w3)
    if fp8 and cfg.block_n == 128 and not ws_gluon:
        # an item's 128 columns in one pass exist in the warp-specialised Gluon kernel only; elsewhere the
        # same sums in two 64-column halves: bitwise the same g, u and h
        cfg = replace(cfg, block_n=64)
    if fp8:
        assert 2 * cfg.block_n == cfg.block_k == 128 or (ws_gluon and cfg.block_n == cfg.block_k == 128), \
            "block FP8 GEMM1: 2 x 64 columns (one scale block of h), K 128"
    if cfg.gluon:
        if not fp8 or INTERPRET:
            raise ValueError("tile config gemm1_swiglu: gluon runs block FP8 on a GPU only (Triton's interpreter "
                             f"cannot run Gluon); got {'the interpreter' if INTERPRET else precision}")
        if ws_gluon:
            from .fp8_gemm1_ws_gluon import fp8_gemm1_ws  # imported only here: Gluon is experimental

            return fp8_gemm1_ws(x_RD, w1_EHD, w3_EHD, plan, out_dtype, stages=cfg.num_stages, block_n=cfg.block_n,
                                group_m=cfg.group_m)
        if sorted_rows and arrivals is None and tma_ok(x, w1, w3):
            from .fp8_gemm1_gluon import fp8_gemm1  # imported only here: Gluon is experimental

            return fp8_gemm1(x_RD, w1_EHD, w3_EHD, plan, out_dtype, block_m=cfg.block_m, num_warps=cfg.num_warps,
                             stages=cfg.num_stages)
        # expert parallelism's rows landing over symmetric memory (arrival waits) run the Triton kernel below:
        # the same block-FP8 math, the promotion not overlapped
    sub_tiles = programs_per_plan_tile(cfg, plan.layout.block_m)
    grid = (plan.layout.num_tiles * sub_tiles * cdiv(H, cfg.block_n * (2 if fp8 else 1)),)
    if grid[0] == 0:
        return g, u, h_out
    w1_t, w3_t = w1, w3
    use_tma = cfg.tma and tma_ok(w1, w3)
    if use_tma:
        w1_t, w3_t = (matrix_descriptor(w, [cfg.block_n, cfg.block_k]) for w in (w1, w3))
    scales = (x_RD.scale, w1_EHD.scale, w3_EHD.scale, h_scale) if fp8 else (None,) * 4  # read only with FP8
    a_tma = sorted_rows
    assert not sorted_rows or tma_ok(x), "sorted rows are read through TMA: contiguous, 16-byte aligned rows"
    x_in = matrix_descriptor(x, [cfg.block_m, cfg.block_k]) if a_tma else x
    arrived, expected = arrivals if arrivals is not None else (None, None)  # read only with WAIT
    launch(
        _gemm1_swiglu_kernel, grid,
        x_in, w1_t, w3_t, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1, g, u, h, *scales,
        arrived, expected, D, H, plan.rows_per_token, x.stride(0), w1.stride(0), w1.stride(1),
        BLOCK_M=cfg.block_m, SUB_TILES=sub_tiles, GROUP_M=cfg.group_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        A_TMA=a_tma,
        W_TMA=use_tma, FP8=fp8, WAIT=arrivals is not None,
        INTERPRET=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return g, u, h_out
