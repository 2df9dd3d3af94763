"""Row-tiled grouped GEMM over expert-sorted rows, output scattered back to routed-row order.

    out[order(p)] = A1_p B1_e (+ A2_p B2_e)

Serves three passes with the weight layout given by strides:
  forward GEMM2:  y_n  = h_p W2_e^T              (one pair; B = W2_e read transposed)
  backward dx:    dx_n = dg_p W1_e + du_p W3_e   (two pairs sharing one accumulator: two K loops, or one
                                                 with `TileConfig.pairs_in_one_loop`)
  dgrad's GEMM:   q_p = dout_p W2_e             (stored in sorted order: `dgrad_swiglu` continues from it;
                                                 block FP8, and bf16 with its rows gathered first)

Under expert parallelism with symmetric memory GEMM2 and dx store each output row straight into its token's
rank's buffer (`PeerRows`, `peer_rows.store_rows_to_peers`): the return trip overlaps the GEMM.

With `TileConfig.tma` both operands come through TMA descriptors: A is contiguous in sorted order (a tile
is rows [tile_row, tile_row + BLOCK_M)) and B is the weight viewed as a matrix. Rows of a tile past its
expert's range, and B rows past expert e's block along N, are computed and masked at the store; along the
reduction dimension the host requires KD % BLOCK_K == 0 so no tile reaches into the next expert's K rows.

Block FP8 (every operand a `BlockScaled`): A rows e4m3 with 1x128 scales along KD, B an expert weight
stored [n, k] (B_TRANS: W2 itself for GEMM2, the transposed copies W1^T, W3^T [E, D, H] for dx, since
Hopper's FP8 MMA takes K-major operands only) with 128x128 block scales [E, ND/128, KD/128].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import INTERPRET, cdiv, matrix_descriptor, multiprocessors, new_output, tma_ok
from .launch import launch
from .configs import programs_per_plan_tile, tile_config
from .epilogue import scatter_routed, store_sorted
from .fp8_rows_gluon import fp8_row_gemm
from .fp8_rows_ws_gluon import fp8_row_gemm_ws
from .mainloop import pair_mainloop, row_mainloop
from .peer_rows import store_rows_to_peers, wait_for_expert_rows
from .schedule import real_tile_count, row_tile


@triton.jit
def _grouped_gemm_kernel(
    a1_ptr, b1_ptr, a2_ptr, b2_ptr,  # A: [N, KD] sorted rows; B: [E, ...] per expert
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    out_ptr,  # [N, ND] routed-row order (SORTED_OUT: sorted order; PEER_OUT: `PeerRows.base`)
    a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr,  # FP8 scales: A [N, KD/128], B [E, ND/128, KD/128]
    dst_offset_ptr,  # PEER_OUT: int64 [N], where sorted row p's output starts, in elements from out_ptr
    arrived_ptr, expected_ptr,  # WAIT: per local expert, int32 counts of landed rows and the count to wait for
    KD, ND, num_tiles,  # num_tiles: the plan's tile bound (`PlanLayout.num_tiles`)
    stride_be, stride_bk, stride_bn,
    TWO_PAIRS: tl.constexpr, TMA: tl.constexpr, B_TRANS: tl.constexpr, WS: tl.constexpr, SORTED_OUT: tl.constexpr,
    PEER_OUT: tl.constexpr, WAIT: tl.constexpr,
    BLOCK_M: tl.constexpr, SUB_TILES: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, PERSISTENT: tl.constexpr, ONE_LOOP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    num_n = tl.cdiv(ND, BLOCK_N)
    if PERSISTENT:
        # resident programs, each walking work items pid, pid + grid, ... of the real tiles (counted here,
        # no host sync). With one operand pair (GEMM2, dgrad's q) Triton flattens this loop with the K loop:
        # the software pipeline then loads the next item's first K blocks while this one's epilogue stores,
        # instead of a pipeline fill and drain per tile (GEMM2's reduction is short: 6-12 K steps at Qwen3
        # shapes). dx's two K loops per item are not flattened (Triton 3.6 fuses a loop nest only with a
        # single inner loop; sm_90 compile): there it is a plain tile loop, unless ONE_LOOP puts both pairs
        # in one K loop (TileConfig.pairs_in_one_loop), which flattens. Flattening needs the main loop
        # outside any branch, so a part past its expert's rows (block_m 64: the second half of an expert's
        # last plan tile) runs masked instead of returning (its loads and MMAs are wasted: at most one part
        # per expert)
        num_pids = real_tile_count(tile_expert_ptr, num_tiles) * SUB_TILES * num_n
        for pid in tl.range(tl.program_id(0), num_pids, tl.num_programs(0), flatten=True):
            expert, pid_n, row0, rows, row_ok = row_tile(pid, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                                         BLOCK_M, SUB_TILES, GROUP_M, num_pids)
            # (a part past its expert's rows has expert -1 and no row in range: row_ok masks it whole)
            _row_gemm_tile(tl.maximum(expert, 0), pid_n, row0, rows, row_ok,
                           a1_ptr, b1_ptr, a2_ptr, b2_ptr, order_ptr, out_ptr, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr,
                           dst_offset_ptr, arrived_ptr, expected_ptr, KD, ND, stride_be, stride_bk, stride_bn,
                           TWO_PAIRS, TMA, B_TRANS, WS, SORTED_OUT, PEER_OUT, WAIT, BLOCK_M, BLOCK_N, BLOCK_K, FP8,
                           ONE_LOOP, INTERPRET)
    else:
        expert, pid_n, row0, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr,
                                                     offsets_ptr, BLOCK_M, SUB_TILES, GROUP_M)
        if expert >= 0:  # < 0: nothing to do (a tile past the real count, a part past its expert's rows)
            _row_gemm_tile(expert, pid_n, row0, rows, row_ok,
                           a1_ptr, b1_ptr, a2_ptr, b2_ptr, order_ptr, out_ptr, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr,
                           dst_offset_ptr, arrived_ptr, expected_ptr, KD, ND, stride_be, stride_bk, stride_bn,
                           TWO_PAIRS, TMA, B_TRANS, WS, SORTED_OUT, PEER_OUT, WAIT, BLOCK_M, BLOCK_N, BLOCK_K, FP8,
                           ONE_LOOP, INTERPRET)


@triton.jit
def _row_gemm_tile(expert, pid_n, row0, rows, row_ok, a1_ptr, b1_ptr, a2_ptr, b2_ptr, order_ptr, out_ptr, a1s_ptr,
                   b1s_ptr, a2s_ptr, b2s_ptr, dst_offset_ptr, arrived_ptr, expected_ptr, KD, ND, stride_be, stride_bk,
                   stride_bn,
                   TWO_PAIRS: tl.constexpr, TMA: tl.constexpr, B_TRANS: tl.constexpr, WS: tl.constexpr,
                   SORTED_OUT: tl.constexpr, PEER_OUT: tl.constexpr, WAIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, ONE_LOOP: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """One work item of the tile schedule (`schedule.row_tile`): its rows times its expert's weight, stored."""
    if WAIT:  # expert parallelism, symmetric memory: this expert's A rows (dgrad's dout) may still be landing
        wait_for_expert_rows(arrived_ptr, expected_ptr, expert, INTERPRET)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < ND
    offs_k = tl.arange(0, BLOCK_K)
    a_off = 0
    b_off = 0
    if not TMA:
        a_off = rows.to(tl.int64)[:, None] * KD + offs_k[None, :]
        b_off = expert.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    n0 = pid_n * BLOCK_N
    # TMA: B^T stored [n, k] starts expert e at row e*ND (plus the N-tile), B stored [k, n] at row e*KD
    if B_TRANS:
        b_row = expert * ND + n0
    else:
        b_row = expert * KD

    kb = tl.cdiv(KD, BLOCK_K)  # FP8: K blocks per row (BLOCK_K is the 128-wide scale block)
    a_scale_off = rows.to(tl.int64) * kb
    b_scale_off = (expert.to(tl.int64) * tl.cdiv(ND, BLOCK_K) + n0 // BLOCK_K) * kb  # the tile's 128x128 blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ONE_LOOP:  # both pairs in one K loop (TileConfig.pairs_in_one_loop: dx, operands through TMA)
        acc = pair_mainloop(acc, a1_ptr, b1_ptr, a2_ptr, b2_ptr, row0, b_row, n0, KD, B_TRANS=B_TRANS,
                            BLOCK_K=BLOCK_K, INTERPRET=INTERPRET, a1_scale=a1s_ptr, b1_scale=b1s_ptr,
                            a2_scale=a2s_ptr, b2_scale=b2s_ptr, a_scale_off=a_scale_off, b_scale_off=b_scale_off,
                            row_ok=row_ok, SCALED=FP8)
    else:
        acc, _ = row_mainloop(acc, acc, a1_ptr, a_off, row_ok, row0, b1_ptr, b1_ptr, b_off, n_ok, n_ok, b_row, n0,
                              KD, stride_bk, A_TMA=TMA, B_TMA=TMA, B_TRANS=B_TRANS, TWO_B=False, WS=WS,
                              BLOCK_K=BLOCK_K, INTERPRET=INTERPRET, a_scale=a1s_ptr, a_scale_off=a_scale_off,
                              b0_scale=b1s_ptr, b1_scale=b1s_ptr, b0_scale_off=b_scale_off, b1_scale_off=b_scale_off,
                              SCALED=FP8)
    if TWO_PAIRS and not ONE_LOOP:
        # a second pass over K into the same accumulator, not interleaved with the first: an interleaved
        # loop holds four operand tiles per pipeline stage, so fewer stages fit (pairs_in_one_loop does it)
        acc, _ = row_mainloop(acc, acc, a2_ptr, a_off, row_ok, row0, b2_ptr, b2_ptr, b_off, n_ok, n_ok, b_row, n0,
                              KD, stride_bk, A_TMA=TMA, B_TMA=TMA, B_TRANS=B_TRANS, TWO_B=False, WS=WS,
                              BLOCK_K=BLOCK_K, INTERPRET=INTERPRET, a_scale=a2s_ptr, a_scale_off=a_scale_off,
                              b0_scale=b2s_ptr, b1_scale=b2s_ptr, b0_scale_off=b_scale_off,
                              b1_scale_off=b_scale_off, SCALED=FP8)
    if SORTED_OUT:
        store_sorted(out_ptr, acc, rows, row_ok, offs_n, n_ok, ND, INTERPRET)
    elif PEER_OUT:
        store_rows_to_peers(out_ptr, acc, rows, row_ok, offs_n, n_ok, dst_offset_ptr, INTERPRET)
    else:
        scatter_routed(out_ptr, acc, order_ptr, rows, row_ok, offs_n, n_ok, ND, INTERPRET)


@dataclass(frozen=True)
class PeerRows:
    """Where a GEMM's output rows go instead of a local [N, ND] tensor (expert parallelism, symmetric
    memory, `symm_transport.back_from_gemm`): the output of the plan's sorted row p starts offsets[p]
    elements from base, which lands it in its token's rank's buffer (peers' buffers are mapped into this
    process, so one base and an offset reach any of them). By sorted row, not routed row: the epilogue
    then reads its offsets contiguously, without the order gather (`peer_rows.store_rows_to_peers` has
    the sm_90 spill figures)."""

    base: torch.Tensor  # this rank's own rows, in the output dtype
    offsets: torch.Tensor  # int64 [N], elements from base, by sorted row


def _launch(kernel_name, a1, b1, a2, b2, b_strides, b_trans, nd, plan: RoutingPlan, dim, hidden, out_dtype,
            precision, sorted_out=False, peers: PeerRows | None = None, arrivals=None):
    fp8 = isinstance(a1, BlockScaled)
    two_pairs = b2 is not None
    a1_q, b1_q, a2_q, b2_q = a1, b1, a2, b2  # the BlockScaled operands (the Gluon kernel takes them whole)
    # one pair: the second operands are None (the kernel reads them only with TWO_PAIRS), so the launch
    # neither builds nor converts descriptors for them; likewise no scale pointers without FP8
    scales = [t.scale if t is not None else None for t in (a1, b1, a2, b2)] if fp8 else [None] * 4
    if fp8:
        a1, b1, a2, b2 = (t.data if t is not None else None for t in (a1, b1, a2, b2))
    N, kd = a1.shape
    assert peers is None or peers.base.dtype == out_dtype
    out = new_output((N, nd), out_dtype, a1.device) if peers is None else peers.base
    cfg = tile_config(kernel_name, dim, hidden, precision)
    operands = (a1, b1, a2, b2) if two_pairs else (a1, b1)
    use_tma = cfg.tma and kd % cfg.block_k == 0 and tma_ok(*operands)
    ws_gluon = fp8 and cfg.gluon and cfg.warp_specialize and use_tma and peers is None and arrivals is None
    if fp8 and cfg.block_n > 128 and not (ws_gluon and nd % cfg.block_n == 0):
        # 256 columns (two 128-column sub-tiles) exist in the warp-specialised Gluon kernel only; elsewhere
        # the same sums over 128-column tiles: bitwise the same output
        cfg = replace(cfg, block_n=128)
    sub_tiles = programs_per_plan_tile(cfg, plan.layout.block_m)
    grid = (plan.layout.num_tiles * sub_tiles * cdiv(nd, cfg.block_n),)
    if grid[0] == 0:
        return out
    persistent = cfg.persistent > 0 and peers is None and arrivals is None  # (TileConfig.persistent: why not EP)
    if persistent:
        grid = (min(grid[0], cfg.persistent * multiprocessors(a1.device)),)
    if fp8:
        assert b_trans and cfg.block_k == 128 and (128 % cfg.block_n == 0 or ws_gluon), \
            "block FP8 takes K-major weights, 128-wide K blocks and weight tiles inside one 128-column block"
    # TileConfig.pairs_in_one_loop (dx): both operand pairs through TMA in one K loop; where TMA cannot cover
    # the operands, two pointer-load passes (another summation order: not bitwise the same)
    one_loop = cfg.pairs_in_one_loop and two_pairs and use_tma
    if cfg.gluon:
        if not fp8 or INTERPRET:
            raise ValueError(f"tile config {kernel_name}: gluon runs block FP8 on a GPU only (Triton's interpreter "
                             f"cannot run Gluon); got {'the interpreter' if INTERPRET else precision}")
        if ws_gluon:
            return fp8_row_gemm_ws(a1_q, b1_q, plan, nd, out_dtype, a2=a2_q, b2=b2_q, sorted_out=sorted_out,
                                   block_n=cfg.block_n, stages=cfg.num_stages, out=out, group_m=cfg.group_m)
        if use_tma and peers is None and arrivals is None:
            return fp8_row_gemm(a1_q, b1_q, plan, nd, out_dtype, a2=a2_q, b2=b2_q, sorted_out=sorted_out,
                                block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps,
                                stages=cfg.num_stages, out=out)
        # expert parallelism over symmetric memory (stores to peers, waits for arriving rows) and operands
        # TMA cannot cover run the Triton kernel below: the same block-FP8 math, the promotion not overlapped
        # (and without Triton's own warp specialisation, which `warp_specialize` asks of the Gluon kernel here)
    if use_tma:
        b_block = [cfg.block_n, cfg.block_k] if b_trans else [cfg.block_k, cfg.block_n]
        a1, b1 = matrix_descriptor(a1, [cfg.block_m, cfg.block_k]), matrix_descriptor(b1, b_block)
        if two_pairs:
            a2, b2 = matrix_descriptor(a2, [cfg.block_m, cfg.block_k]), matrix_descriptor(b2, b_block)
    launch(
        _grouped_gemm_kernel, grid,
        a1, b1, a2, b2,
        plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1, out, *scales,
        peers.offsets if peers is not None else None, *(arrivals if arrivals is not None else (None, None)), kd, nd,
        plan.layout.num_tiles, *b_strides,
        TWO_PAIRS=two_pairs, TMA=use_tma, B_TRANS=b_trans, WS=use_tma and cfg.warp_specialize and not cfg.gluon,
        SORTED_OUT=sorted_out,
        PEER_OUT=peers is not None, WAIT=arrivals is not None,
        BLOCK_M=cfg.block_m, SUB_TILES=sub_tiles, GROUP_M=cfg.group_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        FP8=fp8, PERSISTENT=persistent, ONE_LOOP=one_loop,
        INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _data(t):
    return t.data if isinstance(t, BlockScaled) else t


def expert_down_proj(h_NH, w2_EDH, plan: RoutingPlan, out_dtype, precision: str, peers: PeerRows | None = None):
    """Forward GEMM2: y[order(p)] = h_p W2_e^T, [N, D] in routed-row order (FP8: h and W2 `BlockScaled`).
    With `peers` each y row is stored at its `PeerRows` destination instead (returns None)."""
    w2 = _data(w2_EDH)
    E, D, H = w2.shape
    strides = (w2.stride(0), w2.stride(2), w2.stride(1))  # B[k=h, n=d] = W2[e, d, h]
    out = _launch("gemm2", h_NH, w2_EDH, None, None, strides, True, D, plan, D, H, out_dtype, precision, peers=peers)
    return out if peers is None else None


def expert_h_grad(dout_ND, w2_E, plan: RoutingPlan, out_dtype, precision: str, arrivals=None):
    """dgrad's GEMM alone: q_p = dout_p W2_e, [N, H] in out_dtype, sorted rows (the gradient of h before
    the score; `dgrad_swiglu` takes it on). dout_ND: the plan's rows in sorted order. `arrivals` (bf16)
    = (arrived, expected), int32 [E] each: each program first waits for its expert's rows to land
    (`peer_rows.wait_for_expert_rows`; dout_ND is then the buffer they land in).

    bf16 (split dgrad with its rows gathered first): w2_E is W2 itself [E, D, H], read [k=d, n=h].
    Block FP8: dout 1x128 along D and w2_E the transposed copy W2^T [E, H, D] (K-major for the FP8 MMA)."""
    if not isinstance(dout_ND, BlockScaled):
        E, D, H = w2_E.shape
        strides = (w2_E.stride(0), w2_E.stride(1), w2_E.stride(2))  # B[k=d, n=h] = W2[e, d, h]
        return _launch("dgrad_swiglu", dout_ND, w2_E, None, None, strides, False, H, plan, D, H, out_dtype,
                       precision, sorted_out=True, arrivals=arrivals)
    w2t_EHD = w2_E
    w2t = w2t_EHD.data
    E, H, D = w2t.shape
    strides = (w2t.stride(0), w2t.stride(2), w2t.stride(1))  # B[k=d, n=h] = W2^T[e, h, d]
    return _launch("dgrad_swiglu", dout_ND, w2t_EHD, None, None, strides, True, H, plan, D, H, out_dtype, precision,
                   sorted_out=True)


def expert_input_grad(dg_NH, du_NH, w1_EHD, w3_EHD, plan: RoutingPlan, out_dtype, precision: str,
                      peers: PeerRows | None = None):
    """Backward dx rows: dx[order(p)] = dg_p W1_e + du_p W3_e, [N, D] in routed-row order (with `peers`:
    stored at their `PeerRows` destinations, returns None).

    Block FP8: dg, du `BlockScaled` rows and w1_EHD, w3_EHD the transposed copies W1^T, W3^T [E, D, H]
    (`BlockScaled`, K-major for the FP8 MMA)."""
    if isinstance(dg_NH, BlockScaled):
        w1t = w1_EHD.data
        E, D, H = w1t.shape
        strides = (w1t.stride(0), w1t.stride(2), w1t.stride(1))  # B[k=h, n=d] = W1^T[e, d, h]
        trans = True
    else:
        E, H, D = w1_EHD.shape
        strides = (w1_EHD.stride(0), w1_EHD.stride(1), w1_EHD.stride(2))  # B[k=h, n=d] = W1[e, h, d]
        trans = False
    out = _launch("dx", dg_NH, w1_EHD, du_NH, w3_EHD, strides, trans, D, plan, D, H, out_dtype, precision, peers=peers)
    return out if peers is None else None
