"""Block-FP8 row GEMMs in Gluon, with the promotion overlapped: GEMM2, dgrad's q and dx (an experiment
beside `grouped_gemm`'s Triton kernels, launched only where a tile config sets `gluon`; GPU only). On an
H100 its outputs were bitwise the Triton kernels' and it ran at 0.63-1.00x their speed, so nothing
selects it (docs/kernels.md, "More Gluon").

    out[p] = sum_kb (A_p[kb] B_e[kb]^T) * sa[p, kb] * sb[e, n_block, kb]    (one or two pairs of operands)

Why Gluon: each 128-wide K block's FP8 product must leave the tensor cores' reduced-precision accumulator
and be scaled into an fp32 one (DeepSeek-V3's promotion). In Triton a `tl.dot` whose result is not the
next dot's accumulator is waited for at once (`wgmma.wait_group 0`), so within a program the tensor cores
idle while it scales (docs/kernels.md, "Deferring the promotion"). Here the main loop issues block k's
MMA asynchronously, then waits with one group still outstanding (`warpgroup_mma_wait(1)`) and scales
block k-1's product while block k's runs: the tensor cores always have the next block queued. The price
is a third accumulator-sized tile in registers (acc, the product being scaled, the one in flight).

Operands: A expert-sorted rows [N, KD] e4m3 (1x128 scales [N, KD/128]); B the weight stored [n, k]
(K-major, as Hopper's FP8 MMA takes it) viewed as [E*ND, KD], 128x128 scales [E, ND/128, KD/128]. Both
through TMA, STAGES deep. A program takes BLOCK_M rows of a plan tile (SUB_TILES per tile) and BLOCK_N
<= 128 columns (inside one scale block column: one weight scale per K block). Rows past the expert's end
are computed and masked at the store. Output bf16: sorted rows (dgrad's q) or scattered to routed-row
order through the plan's `order` (GEMM2, dx).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import cdiv, new_output
from .launch import launch

# Gluon is experimental and renames things between releases (3.6 is the H200's Triton, CI's torch brings
# a newer one): the TMA load was `async_copy_global_to_shared`, now `async_load`; the TMA store
# `async_copy_shared_to_global`, now `async_store`; cp.async `async_copy_global_to_shared`, now `async_load`;
# the CTA barrier likewise
_tma_load = getattr(tma, "async_load", tma.async_copy_global_to_shared)
_tma_store = getattr(tma, "async_store", tma.async_copy_shared_to_global)
_cp_async = getattr(async_copy, "async_load", async_copy.async_copy_global_to_shared)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6: thread_barrier; later: barrier
SCALE_BLOCK = 128  # one scale block along the reduction (host code)
BLOCK_K = gl.constexpr(SCALE_BLOCK)  # the same for jitted code (which reads constexpr globals only)


@gluon.jit
def _issue_loads(j, nk, stage, a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready, row0, b_row):
    """TMA of K block j (of the first pair below nk, else the second) into pipeline stage `stage`."""
    bar = ready.index(stage)
    mbarrier.expect(bar, a1_desc.block_type.nbytes + b1_desc.block_type.nbytes)
    if j < nk:
        _tma_load(a1_desc, [row0, j * 128], bar, a_smem.index(stage))
        _tma_load(b1_desc, [b_row, j * 128], bar, b_smem.index(stage))
    else:
        _tma_load(a2_desc, [row0, (j - nk) * 128], bar, a_smem.index(stage))
        _tma_load(b2_desc, [b_row, (j - nk) * 128], bar, b_smem.index(stage))


@gluon.jit
def _block_scale(j, kb, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, rows, rows_in, b_scale_off):
    """sa * sb of K block j (of the first pair below kb, the K blocks per pair, else the second): fp32 per
    row, zero for rows past the matrix."""
    if j < kb:
        sa = gl.load(a1s_ptr + rows.to(gl.int64) * kb + j, mask=rows_in, other=0.0)
        sb = gl.load(b1s_ptr + b_scale_off + j)
    else:
        sa = gl.load(a2s_ptr + rows.to(gl.int64) * kb + (j - kb), mask=rows_in, other=0.0)
        sb = gl.load(b2s_ptr + b_scale_off + (j - kb))
    return sa * sb


@gluon.jit
def _start_block(j, a_smem, b_smem, ready, zero, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, rows, rows_in, b_scale_off, kb,
                 STAGES: gl.constexpr):
    """Wait for K block j's operands, issue its MMA into a fresh accumulator (asynchronously), load its
    scales: (the MMA in flight, sa * sb per row)."""
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    prod = warpgroup_mma(a_smem.index(stage), b_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
    return prod, _block_scale(j, kb, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, rows, rows_in, b_scale_off)


@gluon.jit
def _overlapped_loop(a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr,
                     rows, rows_in, b_scale_off, row0, b_row, kb, total, mma_layout: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The accumulator over all K blocks, each block's scaling overlapped with the next block's MMA; the
    program's own threads issue the TMA loads STAGES blocks ahead."""
    for s in gl.static_range(STAGES):
        if s < total:
            _issue_loads(s, kb, s, a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready, row0, b_row)
    zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
    # K block 0: issued, not waited for
    prev, prev_scale = _start_block(0, a_smem, b_smem, ready, zero, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, rows,
                                    rows_in, b_scale_off, kb, STAGES)
    for j in range(1, total):
        cur, cur_scale = _start_block(j, a_smem, b_smem, ready, zero, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, rows,
                                      rows_in, b_scale_off, kb, STAGES)
        # block j-1's product is done once at most one group (block j's) is in flight; scale it meanwhile
        done = warpgroup_mma_wait(num_outstanding=1, deps=(prev, ))
        acc += done * prev_scale[:, None]
        # block j-1's stage is free once every warp has seen its MMA done (the barrier: with two
        # warpgroups, the thread that issues the TMA must not run ahead of the other's wait); refill it
        # STAGES blocks ahead
        _cta_barrier()
        nxt = j - 1 + STAGES
        if nxt < total:
            _issue_loads(nxt, kb, (j - 1) % STAGES, a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready,
                         row0, b_row)
        prev = cur
        prev_scale = cur_scale
    done = warpgroup_mma_wait(num_outstanding=0, deps=(prev, ))
    return acc + done * prev_scale[:, None]


@gluon.jit
def plan_row_tile(pid, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M: gl.constexpr,
                  SUB_TILES: gl.constexpr, GROUP_M: gl.constexpr = 1, num_pids=0):
    """Work item pid's (expert, first row, the expert's end row, column block) in `schedule.row_tile`'s order
    (SUB_TILES items of BLOCK_M rows per plan tile; GROUP_M 1: column blocks fastest, else groups of GROUP_M
    row items walked down each column block, `num_pids` items in all). expert < 0 or first row >= end
    row: nothing to do (a spare tile, or a sub-tile past the expert's rows)."""
    if GROUP_M == 1:
        pid_m = pid // num_n
        pid_n = pid % num_n
    else:
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        group_size = gl.minimum(num_pids // num_n - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_size
        pid_n = (pid % width) // group_size
    tile = pid_m // SUB_TILES
    expert = gl.load(tile_expert_ptr + tile)
    row0 = gl.load(tile_row_ptr + tile) + (pid_m % SUB_TILES) * BLOCK_M
    row_end = gl.load(offsets_ptr + gl.maximum(expert, 0) + 1)
    return expert, row0, row_end, pid_n


@gluon.jit
def _fp8_rows_kernel(a1_desc, b1_desc, a2_desc, b2_desc, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr,
                     order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr, N, KD, ND, NK1,
                     SORTED_OUT: gl.constexpr, BLOCK_M: gl.constexpr, SUB_TILES: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    # the plan tile and columns of this program (row_tile's order: N-tiles fastest)
    expert, row0, row_end, pid_n = plan_row_tile(gl.program_id(0), gl.cdiv(ND, BLOCK_N), tile_expert_ptr,
                                                 tile_row_ptr, offsets_ptr, BLOCK_M, SUB_TILES)
    n0 = pid_n * BLOCK_N
    if (expert < 0) | (row0 >= row_end):
        return

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    kb = KD // BLOCK_K  # K blocks per pair
    total = NK1  # K blocks of both pairs: kb, or 2 * kb with a second pair (dx)
    b_row = expert * ND + n0
    b_scale_off = (expert.to(gl.int64) * (ND // BLOCK_K) + n0 // BLOCK_K) * kb
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
    rows_in = rows < N

    a_smem = gl.allocate_shared_memory(a1_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a1_desc.layout)
    b_smem = gl.allocate_shared_memory(b1_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b1_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()
    acc = _overlapped_loop(a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready, a1s_ptr, b1s_ptr, a2s_ptr,
                           b2s_ptr, rows, rows_in, b_scale_off, row0, b_row, kb, total, mma_layout, BLOCK_M, BLOCK_N,
                           STAGES)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    store_rows(out_ptr, acc, row0, row_end, n0, order_ptr, ND, BLOCK_M, BLOCK_N, SORTED_OUT, num_warps)


@gluon.jit
def row_dest(order_ptr, row0, row_end, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SORTED_OUT: gl.constexpr,
             WARPS: gl.constexpr):
    """Where `store_rows` stores sorted rows row0 ..: the rows themselves (SORTED_OUT) or order[row], in
    its layout; a kernel that loads them early (at its item's start) hands them to `store_rows`."""
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [WARPS, 1], [1, 0])
    srows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    if SORTED_OUT:
        return srows
    return gl.load(order_ptr + srows, mask=srows < row_end, other=0)


@gluon.jit
def store_rows(out_ptr, acc, row0, row_end, n0, order_ptr, ND, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               SORTED_OUT: gl.constexpr, WARPS: gl.constexpr, dest=None):
    """The row GEMMs' epilogue: sorted rows row0 .. row0 + BLOCK_M - 1 of the accumulator, columns n0 ..,
    stored in out's dtype at their sorted row (SORTED_OUT) or at order[row] (`dest`: `row_dest`'s, loaded
    earlier, else loaded here); rows past the expert's end (computed on rows of the next expert or TMA's
    zeros) are dropped. 16-byte stores along each row."""
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [WARPS, 1], [1, 0])
    val = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store_layout)
    srows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    row_ok = srows < row_end
    if dest is None:
        dest = row_dest(order_ptr, row0, row_end, BLOCK_M, BLOCK_N, SORTED_OUT, WARPS)
    off = dest.to(gl.int64)[:, None] * ND + cols[None, :]
    gl.store(out_ptr + off, val, mask=row_ok[:, None] & (cols < ND)[None, :])


@functools.lru_cache(maxsize=None)
def _tile_layout(rows: int, dtype) -> gl.NVMMASharedLayout:
    """The MMA-friendly shared-memory layout of [rows, 128] tiles of `dtype`: a function of its arguments,
    made once (Gluon's `get_default_for` goes through its constexpr-function machinery: ~25 us of host time
    per fp8 forward+backward at 30B-A3B, 23 descriptors, on a development CPU)."""
    return gl.NVMMASharedLayout.get_default_for([rows, SCALE_BLOCK], dtype)


def _descriptor(t: torch.Tensor, rows: int, dtype=gl.float8e4nv) -> TensorDescriptor:
    """A TMA descriptor over t as a matrix (leading dimensions flattened) in [rows, 128] tiles, with the
    MMA-friendly shared-memory layout of `dtype` (t's element type in Gluon's terms)."""
    t = t.reshape(-1, t.shape[-1])
    return TensorDescriptor.from_tensor(t, [rows, SCALE_BLOCK], _tile_layout(rows, dtype))


def pair_args(a1: BlockScaled, b1: BlockScaled, a2: BlockScaled | None, b2: BlockScaled | None, a_rows: int,
              block_n: int) -> tuple:
    """The row GEMMs' operand arguments: the four descriptors (A tiles of a_rows x 128, B tiles of block_n x 128),
    then the four scales. With one pair the second pair's arguments repeat the first's (the kernel never
    reads them), built once."""
    descs = (_descriptor(a1.data, a_rows), _descriptor(b1.data, block_n))
    descs += (_descriptor(a2.data, a_rows), _descriptor(b2.data, block_n)) if a2 is not None else descs
    scales = (a1.scale, b1.scale) + ((a2.scale, b2.scale) if a2 is not None else (a1.scale, b1.scale))
    return descs + scales


def k_blocks(a1: BlockScaled, a2: BlockScaled | None) -> int:
    """K blocks of both pairs together: the first pair's, twice with a second pair (dx)."""
    return a1.data.shape[1] // SCALE_BLOCK * (2 if a2 is not None else 1)


def fp8_row_gemm(a1: BlockScaled, b1: BlockScaled, plan: RoutingPlan, nd: int, out_dtype=torch.bfloat16,
                 a2: BlockScaled | None = None, b2: BlockScaled | None = None, sorted_out: bool = False,
                 block_m: int = 64, block_n: int = 128, num_warps: int = 4, stages: int = 4,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """out [N, nd]: sum over the pairs of A_p B_e^T with block scales, by sorted row (`sorted_out`) or in
    routed-row order. a: sorted rows [N, KD] e4m3; b: the expert weight stored [E, nd, KD] e4m3. `out`: the
    [N, nd] tensor to write (allocated when None)."""
    N, kd = a1.data.shape
    E = b1.data.shape[0]
    assert b1.data.shape == (E, nd, kd) and kd % SCALE_BLOCK == 0 and nd % SCALE_BLOCK == 0, (b1.data.shape, nd, kd)
    assert SCALE_BLOCK % block_n == 0 and plan.layout.block_m % block_m == 0, (block_n, block_m)
    if out is None:
        out = new_output((N, nd), out_dtype, a1.data.device)
    sub_tiles = plan.layout.block_m // block_m
    grid = (plan.layout.num_tiles * sub_tiles * cdiv(nd, block_n),)
    if grid[0] == 0:
        return out
    launch(
        _fp8_rows_kernel, grid, *pair_args(a1, b1, a2, b2, block_m, block_n),
        plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1, out, N, kd, nd, k_blocks(a1, a2),
        SORTED_OUT=sorted_out, BLOCK_M=block_m, SUB_TILES=sub_tiles, BLOCK_N=block_n, STAGES=stages,
        num_warps=num_warps)
    return out
