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
hands dh to the SwiGLU backward in bf16). Split with `tma`: dout's rows are first copied into sorted
order and q comes from the row-tiled grouped GEMM with both operands through TMA (`expert_h_grad`),
the same q up to summation order; `block_n` is then that GEMM's whole tile width.

Block FP8 (dout and W2 `BlockScaled`; W2 as its transposed copy W2^T [E, H, D], K-major for the FP8
MMA): always split. The GEMM (`grouped_gemm.expert_h_grad`, the row-tiled GEMM with sorted stores) reads
dout's sorted FP8 rows through TMA and stores q in bf16; `_dswiglu_fp8_kernel` then does, per plan tile
and 128 columns, the dSwiGLU, s*h and ds, and quantizes what the later GEMMs read: dg and du in 1x128
row blocks for dx, and dg, du, s*h in the token-tile layout (`quant.quantize_token_tiles`) for the
weight gradients. No bf16 copy of dg, du or s*h is written. The fused FP8 epilogue this replaced held
the block-scaled main loop's partial products beside the whole dSwiGLU and spilled: 6.2 ms at
Qwen3-30B-A3B T=16384 on an H200, against 1.1 ms for bf16's split pair (docs/kernels.md).

`_dswiglu_fp8_kernel` itself spills too (five outputs, two of them transposed, at 16 warps: 1.32 ms,
~840 GB/s). The replacement (`_FP8_DSWIGLU_SPLIT`, on since it was timed on the H200: 1.05 ms against 1.31 ms) runs
the same work as two kernels that each recompute the dSwiGLU from q, g, u: `_dswiglu_fp8_rows_kernel`
(small row blocks of the N real rows, no transposes: dg, du rows and ds) and `_dswiglu_fp8_tiles_kernel`
(per plan tile, the three transposed token tiles). They read q, g, u twice, but each is shaped like a
kernel that ran fast on the H200 (the bf16 rows kernel, the token-tile quantizer). Same helpers, same
rounding points: bitwise the same outputs in the interpreter (tests/test_fp8_dswiglu_split.py, which
also runs on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import INTERPRET, cdiv, new_output, tma_ok
from .launch import launch
from .configs import FP8_BLOCK as _FP8_BLOCK
from .configs import programs_per_plan_tile, tile_config
from .epilogue import dswiglu, dswiglu_values_bf16, store_rows_fp8, store_sorted, store_token_tile
from .grouped_gemm import expert_h_grad
from .mainloop import row_mainloop
from .peer_rows import wait_for_expert_rows
from .schedule import row_tile
from .sorted_rows import sorted_rows

# `_dswiglu_fp8_kernel`'s warps: on the H200 16 were fastest, 1.32 ms at 30B-A3B T=16384 against 2.04 with
# 8, though sm_90's compile spills at both (docs/results/tune_logs/2026-12-04_fp8_dswiglu_modes_3a5e4c7.log)
_FP8_DSWIGLU = dict(num_warps=16)

# The Triton kernels of block FP8's dSwiGLU (where the Gluon one below does not run: Triton's interpreter, or
# `_FP8_DSWIGLU_GLUON = None`): the rows + token-tiles pair (True) or `_dswiglu_fp8_kernel` (False). The switch
# and knobs are read at each call, so a GPU script can time every variant (`scripts/bench_row_kernels.py
# --sections fp8_dswiglu`, each checked bitwise first). The pair's shapes: the bf16 rows kernel's 32 x 128 at 8
# warps (74 registers, no spill in the sm_90 compile) and the token-tile quantizer's 4 warps with two column
# blocks in turn, 32 columns a step (dg, du and s*h live at once: 4 warps spill 2.2 KB a thread at 128-column
# steps, 1 KB at 64, 56 B at 32). H200, 30B-A3B T=16384 (docs/results/bench_row_kernels_20261205T021052.json,
# at cc0ca82): the pair 1055 us, the single kernel 1308 us; 8-warp tiles were slower (1.50 ms)
_FP8_DSWIGLU_SPLIT = True
_FP8_ROWS_BLOCK_M, _FP8_ROWS_WARPS = 32, 8
_FP8_TILES_WARPS, _FP8_TILES_COL_BLOCKS, _FP8_TILES_BLOCK_N = 4, 2, 32
# On a GPU the one-kernel Gluon version runs in their place (`dswiglu_fp8_gluon`: the dSwiGLU computed once
# per element, the token tiles stored through a layout change of their e4m3 bytes): (warps, exact cast,
# persistent), or None for the Triton kernels. On the H100 (2026-12-05, docs/results/gluon_20261205_h100/, 30B-A3B
# T=16384, every output bitwise the Triton single kernel's, ds_part to fp32 rounding): the one-item kernel at 16
# warps with the hardware cast 1031 us against the pair's 1097 and the single Triton kernel's 1318; 8 warps 1087;
# with the exact cast 1238 (16 warps) and 3007 (8). Persistent (one program per multiprocessor, the next item's
# q, g, u coming in through TMA while this one computes; 2026-12-06, bench_row_kernels_20261206T062453.json, same
# process): 8 warps 983 us against the one-item kernel's 1037, 16 warps 1111. Triton's interpreter cannot run
# Gluon: there the Triton kernels run.
_FP8_DSWIGLU_GLUON: tuple[int, bool, bool] | None = (8, False, True)


@triton.jit
def _dgrad_swiglu_kernel(
    dout_ptr, w2_ptr,  # dout [rows, D]; w2 [E, D, H]
    g_ptr, u_ptr, scores_ptr,  # g, u [N, H] sorted; scores [N] row order (fp32)
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    dg_ptr, du_ptr, hs_ptr, ds_part_ptr,  # dg, du, s*h [N, H] sorted; ds_part [N, num_n] row order, fp32
    arrived_ptr, expected_ptr,  # WAIT: per local expert, int32 counts of landed rows and the count to wait for
    D, H, rows_per_token,
    stride_dt, stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, SUB_TILES: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STORE_Q: tl.constexpr, WAIT: tl.constexpr, INTERPRET: tl.constexpr, W_TMA: tl.constexpr = False,
    w2_next_ptr=None,  # W_TMA: w2_ptr and this are TMA descriptors over W2 [E*D, H], this one from column BLOCK_N on
):
    # each program covers 2*BLOCK_N columns of H with two accumulators sharing every gathered dout tile
    # (like GEMM1's gate/up pair): half the A-operand traffic per MMA of a single-accumulator tile
    num_n = tl.cdiv(H, 2 * BLOCK_N)
    expert, pid_n, row0, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                                 BLOCK_M, SUB_TILES, GROUP_M)
    if expert < 0:
        return
    if WAIT:  # expert parallelism, symmetric memory: this expert's dout rows may still be landing
        wait_for_expert_rows(arrived_ptr, expected_ptr, expert, INTERPRET)
    routed = tl.load(order_ptr + rows, mask=row_ok, other=0)
    src = routed // rows_per_token
    offs_n0 = pid_n * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n1 = offs_n0 + BLOCK_N
    n0_ok = offs_n0 < H
    n1_ok = offs_n1 < H
    offs_k = tl.arange(0, BLOCK_K)
    a_off = src.to(tl.int64)[:, None] * stride_dt + offs_k[None, :]
    b_off = expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n0[None, :] * stride_wn
    q0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_TMA:
        # W2's two column blocks at the same coordinates of two descriptors (the second starts BLOCK_N columns
        # in; its columns past H, like the first's, are TMA's zero fill); D % BLOCK_K == 0 (the launcher
        # checks), so no K step reads the next expert's rows. dout stays gathered by pointer, as GEMM1's x
        q0, q1 = row_mainloop(q0, q1, dout_ptr, a_off, row_ok, row0, w2_ptr, w2_next_ptr, b_off, n0_ok, n1_ok,
                              expert * D, pid_n * 2 * BLOCK_N, D, stride_wk, A_TMA=False, B_TMA=True, B_TRANS=False,
                              TWO_B=True, WS=False, BLOCK_K=BLOCK_K, INTERPRET=INTERPRET)
    else:
        q0, q1 = row_mainloop(q0, q1, dout_ptr, a_off, row_ok, row0, w2_ptr, w2_ptr + BLOCK_N * stride_wn, b_off,
                              n0_ok, n1_ok, 0, 0, D, stride_wk, A_TMA=False, B_TMA=False, B_TRANS=False, TWO_B=True,
                              WS=False, BLOCK_K=BLOCK_K, INTERPRET=INTERPRET)

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


@triton.jit
def _dswiglu_of_q(q_ptr, g_ptr, u_ptr, s, rows, row_ok, offs_n, q_mask, H, INTERPRET: tl.constexpr):
    """(dg, du, s*h, ds's share) of sorted rows x columns offs_n from q (bf16 [N, H], zero where q_mask is
    false), g, u and the rows' scores s: the FP8 kernels' one dSwiGLU, so that each computes it from the
    same expressions (their outputs are compared bit for bit)."""
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * H + offs_n[None, :], mask=q_mask, other=0.0)
    return dswiglu_values_bf16(q.to(tl.float32), rows, row_ok, offs_n, H, g_ptr, u_ptr, s, INTERPRET)


@triton.jit
def _dswiglu_fp8_kernel(
    q_ptr, g_ptr, u_ptr, scores_ptr,  # q, g, u [N, H] bf16 sorted; scores [N] row order (fp32)
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    dg_ptr, dg_s_ptr, du_ptr, du_s_ptr,  # dg, du e4m3 [N, H] sorted rows, scales [N, H/128]
    dgt_ptr, dgt_s_ptr, dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr,  # token tiles e4m3 [H, P], scales [H, P/128]
    ds_part_ptr,  # [N, H/128] row order, fp32
    H, P,
    BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Block FP8 dSwiGLU of one plan tile (128 sorted rows of one expert) by 128 columns: the tile's rows
    are one token block of the weight-gradient operands and its columns one 1x128 row block of dx's."""
    num_n = H // BLOCK
    tile = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:  # past the real count: the weight gradients never read this tile
        return
    rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK)
    row_ok = rows < tl.load(offsets_ptr + expert + 1)  # rows past the expert's end: zeros (token-tile padding)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    n_ok = offs_n < H
    routed = tl.load(order_ptr + rows, mask=row_ok, other=0)
    s = tl.load(scores_ptr + routed, mask=row_ok, other=0.0)
    dg, du, hs, ds_part = _dswiglu_of_q(q_ptr, g_ptr, u_ptr, s, rows, row_ok, offs_n, row_ok[:, None], H, INTERPRET)
    store_token_tile(hst_ptr, hst_s_ptr, hs, tile, offs_n, n_ok, P, BLOCK, INTERPRET)
    store_token_tile(dgt_ptr, dgt_s_ptr, dg, tile, offs_n, n_ok, P, BLOCK, INTERPRET)
    store_token_tile(dut_ptr, dut_s_ptr, du, tile, offs_n, n_ok, P, BLOCK, INTERPRET)
    store_rows_fp8(dg_ptr, dg_s_ptr, dg, rows, row_ok, offs_n, H, pid_n, INTERPRET)
    store_rows_fp8(du_ptr, du_s_ptr, du, rows, row_ok, offs_n, H, pid_n, INTERPRET)
    tl.store(ds_part_ptr + routed.to(tl.int64) * num_n + pid_n, ds_part, mask=row_ok)


@triton.jit
def _dswiglu_fp8_rows_kernel(
    q_ptr, g_ptr, u_ptr, scores_ptr, order_ptr,  # q, g, u [N, H] bf16 sorted; scores [N] row order (fp32)
    dg_ptr, dg_s_ptr, du_ptr, du_s_ptr,  # dg, du e4m3 [N, H] sorted rows, scales [N, H/128]
    ds_part_ptr,  # [N, H/128] row order, fp32
    N, H,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The row half of `_dswiglu_fp8_kernel`: BLOCK_M sorted rows by one 1x128 row block, dg and du
    quantized along the row and ds's share. The N real rows are contiguous in sorted order, so the blocks
    run over them with no plan tiles (a row block may span two experts: every value is per row)."""
    num_n = H // BLOCK
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n  # a block's column programs are neighbours: they share order, scores
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    routed = tl.load(order_ptr + rows, mask=row_ok, other=0)
    s = tl.load(scores_ptr + routed, mask=row_ok, other=0.0)
    dg, du, _, ds_part = _dswiglu_of_q(q_ptr, g_ptr, u_ptr, s, rows, row_ok, offs_n, row_ok[:, None], H, INTERPRET)
    store_rows_fp8(dg_ptr, dg_s_ptr, dg, rows, row_ok, offs_n, H, pid_n, INTERPRET)
    store_rows_fp8(du_ptr, du_s_ptr, du, rows, row_ok, offs_n, H, pid_n, INTERPRET)
    tl.store(ds_part_ptr + routed.to(tl.int64) * num_n + pid_n, ds_part, mask=row_ok)


@triton.jit
def _dswiglu_fp8_tiles_kernel(
    q_ptr, g_ptr, u_ptr, scores_ptr,  # q, g, u [N, H] bf16 sorted; scores [N] row order (fp32)
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    dgt_ptr, dgt_s_ptr, dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr,  # token tiles e4m3 [H, P], scales [H, P/128]
    H, P,
    BLOCK: tl.constexpr, COL_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The token-tile half of `_dswiglu_fp8_kernel`: one plan tile by COL_BLOCKS blocks of 128 columns,
    BLOCK_N columns at a time (as in the token-tile quantizer, the next step's loads overlap this step's
    transposed stores). A token tile's scales are per column, so a step may be narrower than a block:
    dg, du, s*h for 128 x 128 at 4 warps would be 384 fp32 registers a thread."""
    num_n = H // BLOCK
    col_programs = tl.cdiv(num_n, COL_BLOCKS)
    tile = tl.program_id(0) // col_programs
    col0 = (tl.program_id(0) % col_programs) * COL_BLOCKS * BLOCK
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:  # past the real count: the weight gradients never read this tile
        return
    rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK)
    row_ok = rows < tl.load(offsets_ptr + expert + 1)  # rows past the expert's end: zeros (token-tile padding)
    routed = tl.load(order_ptr + rows, mask=row_ok, other=0)
    s = tl.load(scores_ptr + routed, mask=row_ok, other=0.0)
    for n0 in tl.range(col0, col0 + COL_BLOCKS * BLOCK, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H  # false for the last program's second block when H / 128 is odd
        dg, du, hs, _ = _dswiglu_of_q(q_ptr, g_ptr, u_ptr, s, rows, row_ok, offs_n, row_ok[:, None] & n_ok[None, :], H,
                                      INTERPRET)
        store_token_tile(hst_ptr, hst_s_ptr, hs, tile, offs_n, n_ok, P, BLOCK, INTERPRET)
        store_token_tile(dgt_ptr, dgt_s_ptr, dg, tile, offs_n, n_ok, P, BLOCK, INTERPRET)
        store_token_tile(dut_ptr, dut_s_ptr, du, tile, offs_n, n_ok, P, BLOCK, INTERPRET)


# 32 x 128 at 8 warps: 0.32 ms against 0.41 for 64 x 128 at Qwen3-30B-A3B T=16384 (0.62 / 0.80 at
# 235B-A22B), the fastest of 32/64/128 rows x 64/128/256 columns x 4/8 warps on the H200 (docs/kernels.md)
_ROWS_BLOCK_M, _ROWS_BLOCK_N = 32, 128


def dgrad_swiglu(dout_RD, w2_EDH, g_NH, u_NH, scores_N, plan: RoutingPlan, precision: str, arrivals=None):
    """(dg_NH, du_NH, hs_NH = s*h) in g's dtype, sorted rows, and ds_N fp32 in row order; dout_RD holds
    the plan's source rows of the output gradient, scores_N the score of each row.

    `arrivals` (bf16; expert parallelism, symmetric memory) = (arrived, expected), int32 [E] each: dout_RD
    is the buffer the rows land in, already in the plan's sorted order, and each GEMM program first waits
    for its expert's rows (`peer_rows.wait_for_expert_rows`); the rows are read in place, never copied.

    Block FP8: dout_RD is the plan's rows in sorted order as `BlockScaled` 1x128 rows [N, D]
    (`quantize_sorted_rows`) and w2_EDH the transposed copy W2^T [E, H, D] (`BlockScaled`); returns (dg, du
    as `BlockScaled` 1x128 rows [N, H]; (dg, du, s*h) as `BlockScaled` token tiles [H, P]; ds_N)."""
    if isinstance(dout_RD, BlockScaled):
        return _dgrad_swiglu_fp8(dout_RD, w2_EDH, g_NH, u_NH, scores_N, plan, precision)
    N, H = g_NH.shape
    E, D, _ = w2_EDH.shape
    cfg = tile_config("dgrad_swiglu", D, H, precision)
    num_n = cdiv(H, 2 * cfg.block_n)
    # the interpreter's small tiles keep CPU tests fast
    rows_block_n = cfg.block_n if INTERPRET else _ROWS_BLOCK_N
    num_n_ds = cdiv(H, rows_block_n) if cfg.split else num_n
    ds_part = new_output((N, num_n_ds), torch.float32, g_NH.device)
    gathered_first = cfg.split and cfg.tma and tma_ok(dout_RD, w2_EDH)
    if gathered_first:
        # dout's rows copied into sorted order (landing rows already are), then q = dout W2_e by the grouped
        # GEMM with both operands through TMA, stored in dg's buffer like the fused kernel's q; the rows
        # kernel below takes it on
        dout_sorted = sorted_rows(dout_RD, plan) if arrivals is None else dout_RD
        dg = expert_h_grad(dout_sorted, w2_EDH, plan, g_NH.dtype, precision, arrivals=arrivals)
        del dout_sorted
        du, hs = (new_output((N, H), g_NH.dtype, g_NH.device) for _ in range(2))
    else:
        dg, du, hs = (new_output((N, H), g_NH.dtype, g_NH.device) for _ in range(3))
    sub_tiles = programs_per_plan_tile(cfg, plan.layout.block_m)
    grid = (plan.layout.num_tiles * sub_tiles * num_n,)
    # TileConfig.weight_tma: W2's tiles through TMA (the second column block needs a column past BLOCK_N)
    w_tma = cfg.weight_tma and D % cfg.block_k == 0 and H > cfg.block_n and tma_ok(w2_EDH)
    w2, w2_next = w2_EDH, None
    if w_tma:
        w2_matrix = w2_EDH.reshape(-1, H)
        w2 = TensorDescriptor.from_tensor(w2_matrix, [cfg.block_k, cfg.block_n])
        w2_next = TensorDescriptor.from_tensor(w2_matrix[:, cfg.block_n:], [cfg.block_k, cfg.block_n])
    if grid[0] > 0 and not gathered_first:
        launch(
            _dgrad_swiglu_kernel, grid,
            dout_RD, w2, g_NH, u_NH, scores_N, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1,
            dg, du, hs, ds_part, *(arrivals if arrivals is not None else (None, None)), D, H, plan.rows_per_token,
            dout_RD.stride(0), w2_EDH.stride(0), w2_EDH.stride(1), 1,
            BLOCK_M=cfg.block_m, SUB_TILES=sub_tiles, GROUP_M=cfg.group_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            STORE_Q=cfg.split, WAIT=arrivals is not None,
            INTERPRET=INTERPRET, W_TMA=w_tma, w2_next_ptr=w2_next, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if cfg.split and N > 0:
        # q sits in dg's buffer; every element of dg is read as q before the same program overwrites it
        block_m = min(_ROWS_BLOCK_M, plan.layout.block_m)
        launch(
            _dswiglu_rows_kernel, (cdiv(N, block_m) * num_n_ds,),
            dg, g_NH, u_NH, scores_N, plan.order_N, dg, du, hs, ds_part, N, H,
            BLOCK_M=block_m, BLOCK_N=rows_block_n, INTERPRET=INTERPRET, num_warps=8,
        )
    return dg, du, hs, ds_part.sum(dim=1)


def _dgrad_swiglu_fp8(dout_ND: BlockScaled, w2t_EHD: BlockScaled, g_NH, u_NH, scores_N, plan: RoutingPlan,
                      precision: str):
    if plan.layout.block_m != _FP8_BLOCK:
        raise ValueError(f"block-FP8 dgrad needs a plan of {_FP8_BLOCK}-row tiles (one token block per tile), got "
                         f"block_m {plan.layout.block_m}")
    q = expert_h_grad(dout_ND, w2t_EHD, plan, g_NH.dtype, precision)
    dg, du, tiles, ds_part = _dswiglu_fp8(q, g_NH, u_NH, scores_N, plan)
    return dg, du, tiles, ds_part.sum(dim=1)


def _dswiglu_fp8(q_NH, g_NH, u_NH, scores_N, plan: RoutingPlan):
    """Block FP8 dgrad's elementwise half from q (bf16, sorted rows): (dg, du as `BlockScaled` 1x128 rows
    [N, H]; (dg, du, s*h) as `BlockScaled` token tiles [H, P]; ds_part [N, H/128] fp32, row order)."""
    N, H = g_NH.shape
    num_n = H // _FP8_BLOCK
    dev = g_NH.device
    rows = [BlockScaled(new_output((N, H), torch.float8_e4m3fn, dev), new_output((N, num_n), torch.float32, dev),
                        (1, _FP8_BLOCK)) for _ in range(2)]  # dg, du: 1x128 rows for dx
    num_tiles = plan.layout.num_tiles
    P = num_tiles * _FP8_BLOCK
    tiles = [BlockScaled(new_output((H, P), torch.float8_e4m3fn, dev),
                         new_output((H, P // _FP8_BLOCK), torch.float32, dev), (1, _FP8_BLOCK))
             for _ in range(3)]  # dg, du, s*h: token tiles for the weight gradients
    ds_part = new_output((N, num_n), torch.float32, dev)
    row_args = [x for t in rows for x in (t.data, t.scale)]
    tile_args = [x for t in tiles for x in (t.data, t.scale)]
    plan_args = (plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1)
    if _FP8_DSWIGLU_GLUON is not None and not INTERPRET:
        if num_tiles * num_n > 0:
            from . import dswiglu_fp8_gluon  # imported only where it runs: Gluon compiles for GPUs only

            dswiglu_fp8_gluon.dswiglu_fp8(q_NH, g_NH, u_NH, scores_N, plan, row_args, tile_args, ds_part,
                                          *_FP8_DSWIGLU_GLUON)
    elif not _FP8_DSWIGLU_SPLIT:
        if num_tiles * num_n > 0:
            launch(
                _dswiglu_fp8_kernel, (num_tiles * num_n,),
                q_NH, g_NH, u_NH, scores_N, *plan_args, *row_args, *tile_args, ds_part,
                H, P, BLOCK=_FP8_BLOCK, INTERPRET=INTERPRET, **_FP8_DSWIGLU,
            )
    elif N * num_n > 0:  # N > 0: at least one real tile
        launch(
            _dswiglu_fp8_rows_kernel, (cdiv(N, _FP8_ROWS_BLOCK_M) * num_n,),
            q_NH, g_NH, u_NH, scores_N, plan.order_N, *row_args, ds_part, N, H,
            BLOCK_M=_FP8_ROWS_BLOCK_M, BLOCK=_FP8_BLOCK, INTERPRET=INTERPRET, num_warps=_FP8_ROWS_WARPS,
        )
        launch(
            _dswiglu_fp8_tiles_kernel, (num_tiles * cdiv(num_n, _FP8_TILES_COL_BLOCKS),),
            q_NH, g_NH, u_NH, scores_N, *plan_args, *tile_args, H, P,
            BLOCK=_FP8_BLOCK, COL_BLOCKS=_FP8_TILES_COL_BLOCKS, BLOCK_N=_FP8_TILES_BLOCK_N, INTERPRET=INTERPRET,
            num_warps=_FP8_TILES_WARPS,
        )
    return rows[0], rows[1], tuple(tiles), ds_part
