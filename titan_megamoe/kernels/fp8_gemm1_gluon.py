"""Block-FP8 GEMM1 (gate and up, SwiGLU, h quantized) in Gluon, with the promotion overlapped (an experiment
beside `gemm1_swiglu`'s Triton kernel, launched only where its tile config sets `gluon`; GPU only). On an
H100 (2026-12-05) g, u and h were bitwise the Triton kernel's and it ran at 0.77-0.86x its speed, so
nothing selects it (docs/kernels.md, "More Gluon").

    g = x W1_e^T, u = x W3_e^T (per 128-wide K block: the FP8 product times x's row scale and the weight's
    block scale, added in fp32), h = silu(g) u; g, u stored bf16; h rounded to bf16, then e4m3 with one
    scale per row of the program's 128 columns

The main loop is `fp8_rows_gluon`'s (docs/kernels.md, "The promotion overlapped, in Gluon") with two
weight operands sharing each x tile: K block k's two MMAs are issued asynchronously, then the program
waits with those two still in flight (`warpgroup_mma_wait(2)`) and scales block k-1's two products
meanwhile. A program takes BLOCK_M sorted rows of a plan tile and the 128 columns of one scale block of
h, in two 64-wide halves one after the other (as the Triton kernel does): the accumulators, the two
products being scaled and the two in flight are six 64-column tiles, which fit beside the first half's h;
two 128-wide halves would not. x comes in sorted order through TMA (`quantize_sorted_rows`), the weights
as [E*H, D] through TMA.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import cast_rne, e4m3_scale, new_output, to_e4m3
from .epilogue import swiglu
from .fp8_rows_gluon import _cta_barrier, _descriptor, _tma_load, plan_row_tile
from .launch import launch


@gluon.jit
def _issue(j, stage, x_desc, w1_desc, w3_desc, a_smem, b1_smem, b3_smem, ready, row0, w_row):
    """TMA of K block j's x tile and both weight tiles into pipeline stage `stage`."""
    bar = ready.index(stage)
    mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * w1_desc.block_type.nbytes)
    _tma_load(x_desc, [row0, j * 128], bar, a_smem.index(stage))
    _tma_load(w1_desc, [w_row, j * 128], bar, b1_smem.index(stage))
    _tma_load(w3_desc, [w_row, j * 128], bar, b3_smem.index(stage))


@gluon.jit
def _scales(j, kb, xs_ptr, w1s_ptr, w3s_ptr, rows, rows_in, ws_off):
    """x's row scale times each weight's block scale for K block j: two fp32 vectors over the rows."""
    sa = gl.load(xs_ptr + rows.to(gl.int64) * kb + j, mask=rows_in, other=0.0)
    return sa * gl.load(w1s_ptr + ws_off + j), sa * gl.load(w3s_ptr + ws_off + j)


@gluon.jit
def _gate_up_half(x_desc, w1_desc, w3_desc, xs_ptr, w1s_ptr, w3s_ptr, a_smem, b1_smem, b3_smem, ready, row0, w_row,
                  rows, rows_in, ws_off, kb, j0, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  mma_layout: gl.constexpr):
    """(g, u) accumulators of 64 columns (weight rows from w_row) over the kb K blocks. j0: the blocks the
    pipeline has run before (its stages and barrier phases continue from there)."""
    for s in gl.static_range(STAGES):
        if s < kb:
            _issue(s, (j0 + s) % STAGES, x_desc, w1_desc, w3_desc, a_smem, b1_smem, b3_smem, ready, row0, w_row)
    zero = gl.zeros((BLOCK_M, 64), gl.float32, layout=mma_layout)
    acc_g = gl.zeros((BLOCK_M, 64), gl.float32, layout=mma_layout)
    acc_u = gl.zeros((BLOCK_M, 64), gl.float32, layout=mma_layout)
    st = j0 % STAGES
    mbarrier.wait(ready.index(st), (j0 // STAGES) & 1)
    prev_g = warpgroup_mma(a_smem.index(st), b1_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
    prev_u = warpgroup_mma(a_smem.index(st), b3_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
    prev_sg, prev_su = _scales(0, kb, xs_ptr, w1s_ptr, w3s_ptr, rows, rows_in, ws_off)
    for j in range(1, kb):
        st = (j0 + j) % STAGES
        mbarrier.wait(ready.index(st), ((j0 + j) // STAGES) & 1)
        cur_g = warpgroup_mma(a_smem.index(st), b1_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
        cur_u = warpgroup_mma(a_smem.index(st), b3_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
        cur_sg, cur_su = _scales(j, kb, xs_ptr, w1s_ptr, w3s_ptr, rows, rows_in, ws_off)
        # block j-1's products are done once at most block j's two are in flight; scale them meanwhile
        done_g, done_u = warpgroup_mma_wait(num_outstanding=2, deps=(prev_g, prev_u))
        acc_g += done_g * prev_sg[:, None]
        acc_u += done_u * prev_su[:, None]
        _cta_barrier()  # every warp is past block j-1's MMAs before its stage is refilled
        nxt = j - 1 + STAGES
        if nxt < kb:
            _issue(nxt, (j0 + nxt) % STAGES, x_desc, w1_desc, w3_desc, a_smem, b1_smem, b3_smem, ready, row0, w_row)
        prev_g = cur_g
        prev_u = cur_u
        prev_sg = cur_sg
        prev_su = cur_su
    done_g, done_u = warpgroup_mma_wait(num_outstanding=0, deps=(prev_g, prev_u))
    acc_g += done_g * prev_sg[:, None]
    acc_u += done_u * prev_su[:, None]
    _cta_barrier()  # the last stages are free before the next half's prologue refills them
    return acc_g, acc_u


@gluon.jit
def _store_bf16(ptr, val, rows, row_ok, cols, H, store_layout: gl.constexpr):
    v = gl.convert_layout(val.to(gl.bfloat16), store_layout)
    r = gl.convert_layout(rows, gl.SliceLayout(1, store_layout))
    ok = gl.convert_layout(row_ok, gl.SliceLayout(1, store_layout))
    c = gl.convert_layout(cols, gl.SliceLayout(0, store_layout))
    gl.store(ptr + r.to(gl.int64)[:, None] * H + c[None, :], v, mask=ok[:, None] & (c < H)[None, :])


@gluon.jit
def _fp8_gemm1_kernel(x_desc, w1_desc, w3_desc, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                      g_ptr, u_ptr, h_ptr, hs_ptr, N, D, H, BLOCK_M: gl.constexpr, SUB_TILES: gl.constexpr,
                      STAGES: gl.constexpr, num_warps: gl.constexpr):
    # the plan tile and 128 columns of this program (row_tile's order: N-tiles fastest)
    expert, row0, row_end, pid_n = plan_row_tile(gl.program_id(0), gl.cdiv(H, 128), tile_expert_ptr, tile_row_ptr,
                                                 offsets_ptr, BLOCK_M, SUB_TILES)
    n0 = pid_n * 128
    if (expert < 0) | (row0 >= row_end):
        return

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, 64, 32])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # 16-byte bf16 stores
    kb = D // 128
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    rows_in = rows < N
    row_ok = rows < row_end
    ws_off = (expert.to(gl.int64) * (H // 128) + n0 // 128) * kb  # the 128x128 weight blocks of these columns

    a_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, 128], x_desc.layout)
    b1_smem = gl.allocate_shared_memory(w1_desc.dtype, [STAGES, 64, 128], w1_desc.layout)
    b3_smem = gl.allocate_shared_memory(w3_desc.dtype, [STAGES, 64, 128], w3_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()

    # first half: columns n0 .. n0 + 63; h kept (bf16-rounded) for the row scale over both halves
    cols0 = n0 + gl.arange(0, 64, layout=gl.SliceLayout(0, mma_layout))
    g0, u0 = _gate_up_half(x_desc, w1_desc, w3_desc, xs_ptr, w1s_ptr, w3s_ptr, a_smem, b1_smem, b3_smem, ready,
                           row0, expert * H + n0, rows, rows_in, ws_off, kb, 0, BLOCK_M, STAGES, mma_layout)
    _store_bf16(g_ptr, g0, rows, row_ok, cols0, H, store_layout)
    _store_bf16(u_ptr, u0, rows, row_ok, cols0, H, store_layout)
    h0 = cast_rne(swiglu(g0, u0), gl.bfloat16, False)  # held as bf16 (its value) while the second half runs
    # second half: columns n0 + 64 .. n0 + 127
    cols1 = cols0 + 64
    g1, u1 = _gate_up_half(x_desc, w1_desc, w3_desc, xs_ptr, w1s_ptr, w3s_ptr, a_smem, b1_smem, b3_smem, ready,
                           row0, expert * H + n0 + 64, rows, rows_in, ws_off, kb, kb, BLOCK_M, STAGES, mma_layout)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    _store_bf16(g_ptr, g1, rows, row_ok, cols1, H, store_layout)
    _store_bf16(u_ptr, u1, rows, row_ok, cols1, H, store_layout)
    h0 = h0.to(gl.float32)
    h1 = cast_rne(swiglu(g1, u1), gl.bfloat16, False).to(gl.float32)
    # h in e4m3, one scale per row over the two halves' 128 columns (`epilogue.store_row_halves_fp8`)
    h_scale, h_inv = e4m3_scale(gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1)))
    srows = gl.convert_layout(rows, gl.SliceLayout(1, store_layout))
    sok = gl.convert_layout(row_ok, gl.SliceLayout(1, store_layout))
    scols = gl.convert_layout(cols0, gl.SliceLayout(0, store_layout))
    for half in gl.static_range(2):
        if half == 0:
            q = to_e4m3(h0, h_inv[:, None], False)
        else:
            q = to_e4m3(h1, h_inv[:, None], False)
        gl.store(h_ptr + srows.to(gl.int64)[:, None] * H + (scols + 64 * half)[None, :],
                 gl.convert_layout(q, store_layout), mask=sok[:, None])
    gl.store(hs_ptr + rows.to(gl.int64) * (H // 128) + n0 // 128, h_scale, mask=row_ok)


def fp8_gemm1(x: BlockScaled, w1: BlockScaled, w3: BlockScaled, plan: RoutingPlan, out_dtype=torch.bfloat16,
              block_m: int = 64, num_warps: int = 4, stages: int = 4):
    """(g, u, h) as `gemm1_swiglu` returns them for block FP8 with sorted rows: g, u [N, H] in out_dtype
    (bf16), h a `BlockScaled` e4m3 [N, H] with 1x128 scales. x: sorted rows [N, D] e4m3 (1x128 scales);
    w1, w3: [E, H, D] e4m3 (128x128 scales)."""
    N, D = x.data.shape
    E, H, _ = w1.data.shape
    assert D % 128 == 0 and H % 128 == 0 and plan.layout.block_m % block_m == 0, (D, H, block_m)
    dev = x.data.device
    g, u = (new_output((N, H), out_dtype, dev) for _ in range(2))
    h = BlockScaled(new_output((N, H), torch.float8_e4m3fn, dev), new_output((N, H // 128), torch.float32, dev),
                    (1, 128))
    sub_tiles = plan.layout.block_m // block_m
    grid = (plan.layout.num_tiles * sub_tiles * (H // 128),)
    if grid[0] == 0:
        return g, u, h
    launch(_fp8_gemm1_kernel, grid, _descriptor(x.data, block_m), _descriptor(w1.data, 64), _descriptor(w3.data, 64),
           x.scale, w1.scale, w3.scale, plan.tile_expert, plan.tile_row, plan.offsets_E1, g, u, h.data, h.scale, N, D,
           H, BLOCK_M=block_m, SUB_TILES=sub_tiles, STAGES=stages, num_warps=num_warps)
    return g, u, h
