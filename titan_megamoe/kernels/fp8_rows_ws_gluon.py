"""Block-FP8 row GEMMs in Gluon, persistent and warp-specialised: GEMM2, dgrad's q and dx (an experiment
beside `grouped_gemm`'s Triton kernels; GPU only).

    out[p] = sum_kb (A_p[kb] B_e[kb]^T) * sa[p, kb] * sb[e, n_block, kb]    (one or two pairs of operands)

The same product, operands and output as `fp8_rows_gluon` (its docstring), in DeepGEMM's structure:
- one program per multiprocessor walks the items (a 128-row plan tile by BLOCK_N columns, column blocks
  fastest, `schedule.row_tile`'s order) with a stride of the grid, each item's indices loaded one item
  ahead and its output rows' destinations at its start (both consumers start and store an item at once:
  a load waited for there idles the tensor cores);
- a producer warp issues the TMA loads of every K block of every item into a ring of STAGES stages: A's
  two 64-row halves and the BLOCK_N x 128 weight tile, `ready[s]` counting their bytes;
- two consumer warpgroups (the default partition and a 4-warp worker) take the two 64-row halves and share
  each weight tile: 128 FLOP per operand byte, against 85 for the 64-row programs of the Triton kernels.
  Per K block a consumer issues its MMA into a fresh accumulator, waits for it, hands the stage back
  (`empty[s]`, one arrival per consumer) and scales the product into its fp32 accumulator (the promotion).
  Nothing synchronises the two consumers with each other, so while one scales the other's MMA runs;
- at an item's end each consumer stores its 64 rows while the producer is already loading the next
  item's first K blocks;
- BLOCK_N 256: two 128-column sub-tiles per consumer (one accumulator each, one product at a time), so
  A's tile serves both: 171 FLOP per operand byte. The operand reads from L2 are what held the 128-column
  items (docs/kernels.md, "Wider items"): 1.11-1.19x faster at Qwen3 shapes on an H100, bitwise the same.

What the previous warp-specialised form lacked (docs/kernels.md, "Warp-specialised, fourth H100 run"): it
was one item per program (no load of the next item during the epilogue) and one 8-warp consumer partition
whose CTA barrier after every K block held both warpgroups in step, so they scaled at the same time and
the tensor cores idled meanwhile.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import cdiv, multiprocessors, new_output
from .fp8_rows_gluon import (SCALE_BLOCK, _block_scale, _cp_async, _tma_load, k_blocks, pair_args, plan_row_tile,
                              row_dest, store_rows)
from .launch import launch

HALF_M = gl.constexpr(64)  # rows per consumer warpgroup (one wgmma M of 64); a plan tile is two halves
CONSUMER_REGS = 232  # per thread of the worker consumer warpgroup (the default one takes what is left)
PRODUCER_REGS = 24  # the producer only computes addresses and loop counters
# a producer that also copies each stage's scales (`_stage_row_scales`, `fp8_wgrad_ws_gluon._stage_scales`)
STAGING_PRODUCER_REGS = 32
# the row GEMMs' row scales: copied into each stage by the producer (as the weight gradient's are), or
# loaded by the consumers per K block (the default until 02c83d1; docs/kernels.md, "Scales from the exponent bits")
STAGED_SCALES = True
# 12 warps at launch (two consumer warpgroups, the producer's warp rounded up to a warpgroup): each thread
# may start with at most 65536 / (12 * 32) registers, rounded down to 8; the partitions then rebalance
MAXNREG = 65536 // (12 * 32) // 8 * 8


@gluon.jit
def ring(a_desc, b_desc, B_ROWS: gl.constexpr, STAGES: gl.constexpr, A_TILES: gl.constexpr = 1):
    """The pipeline the producer fills and the consumers drain: STAGES stages of A's two 64-row halves
    (a_smem[2s], a_smem[2s + 1]; with A_TILES 2 a second A's halves after them, a_smem[4s] .. a_smem[4s + 3])
    and a B_ROWS x 128 weight tile, with their barriers: `ready[s]` (the stage's TMA bytes have landed) and
    `empty[s]` (both consumers' MMAs have read it)."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * A_TILES * STAGES, HALF_M, 128], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, B_ROWS, 128], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit before its first copy
    return a_smem, b_smem, ready, empty


@gluon.jit
def scale_stages(STAGES: gl.constexpr):
    """Per stage of the ring, one K step's fp32 scales of an item's 128 rows: what the producer copies in
    beside the stage's operands (`stage_rows`) and the consumers read once the stage is ready."""
    return gl.allocate_shared_memory(gl.float32, [STAGES, 2 * HALF_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def stage_rows(row0):
    """The 128 rows from row0 whose scales the producer warp copies into a stage (`scale_stages`), 4 a lane."""
    return row0 + gl.arange(0, 2 * HALF_M, layout=gl.BlockedLayout([4], [32], [1], [0]))


@gluon.jit
def ring_done(ready, empty, STAGES: gl.constexpr):
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def row_item(item, num_items, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr, GROUP_M: gl.constexpr):
    """`plan_row_tile` of a 128-row item, clamped into range (the item after a program's last one reads the
    last item's indices and is never run). Every partition loads each item's indices one item ahead through
    it: both consumers start an item at once (they share the weight tiles), so a load chain waited for
    there idled the tensor cores."""
    return plan_row_tile(gl.minimum(item, num_items - 1), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                         2 * HALF_M, 1, GROUP_M, num_items)


@gluon.jit
def _stage_row_scales(a1s_ptr, a2s_ptr, sa_smem, bar, s, j, kb, row0, N):
    """K block j's scales of the item's 128 A rows (of the first pair below kb, else the second; zeros past
    N) into stage s by asynchronous copies that `bar`, the stage's ready barrier, waits for: counted before
    the arrival that expects the TMA bytes (`fp8_wgrad_ws_gluon._stage_scales`)."""
    rows = stage_rows(row0)
    if j < kb:
        _cp_async(sa_smem.index(s), a1s_ptr + rows.to(gl.int64) * kb + j, mask=rows < N)
    else:
        _cp_async(sa_smem.index(s), a2s_ptr + rows.to(gl.int64) * kb + (j - kb), mask=rows < N)
    async_copy.mbarrier_arrive(bar)


@gluon.jit
def _staged_scale(sa_smem, s, j, kb, b1s_ptr, b2s_ptr, b_scale_off, HALF: gl.constexpr, row_layout: gl.constexpr):
    """`fp8_rows_gluon._block_scale`'s sa * sb (the same product, bitwise) with sa from stage s."""
    sa = sa_smem.index(s).slice(HALF * HALF_M, HALF_M).load(row_layout)
    if j < kb:
        sb = gl.load(b1s_ptr + b_scale_off + j)
    else:
        sb = gl.load(b2s_ptr + b_scale_off + (j - kb))
    return sa * sb


@gluon.jit
def _producer(a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row_ptr,
              offsets_ptr, num_items, num_n, ND, kb, total, a1s_ptr, a2s_ptr, sa_smem, N, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, STAGED_SCALES: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA of every K block of this program's items, each into a stage both consumers have freed (a fresh
    barrier counts as freed: the first pass waits on phase 1). `it` counts K blocks across items, as the
    consumers' does, so stages and phases run on from one item to the next."""
    it = 0
    expert, row0, row_end, pid_n = row_item(gl.program_id(0), num_items, num_n, tile_expert_ptr, tile_row_ptr,
                                            offsets_ptr, GROUP_M)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        n_expert, n_row0, n_row_end, n_pid_n = row_item(item + gl.num_programs(0), num_items, num_n, tile_expert_ptr,
                                                        tile_row_ptr, offsets_ptr, GROUP_M)
        if (expert >= 0) & (row0 < row_end):
            b_row = expert * ND + pid_n * BLOCK_N
            for j in range(total):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                if STAGED_SCALES:
                    _stage_row_scales(a1s_ptr, a2s_ptr, sa_smem, bar, s, j, kb, row0, N)
                mbarrier.expect(bar, 2 * a1_desc.block_type.nbytes + b1_desc.block_type.nbytes)
                if j < kb:  # the first pair's K blocks, then the second's (dx)
                    _tma_load(a1_desc, [row0, j * 128], bar, a_smem.index(2 * s))
                    _tma_load(a1_desc, [row0 + HALF_M, j * 128], bar, a_smem.index(2 * s + 1))
                    _tma_load(b1_desc, [b_row, j * 128], bar, b_smem.index(s))
                else:
                    _tma_load(a2_desc, [row0, (j - kb) * 128], bar, a_smem.index(2 * s))
                    _tma_load(a2_desc, [row0 + HALF_M, (j - kb) * 128], bar, a_smem.index(2 * s + 1))
                    _tma_load(b2_desc, [b_row, (j - kb) * 128], bar, b_smem.index(s))
                it += 1
        expert, row0, row_end, pid_n = n_expert, n_row0, n_row_end, n_pid_n


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, order_ptr, tile_expert_ptr,
              tile_row_ptr, offsets_ptr, out_ptr, sa_smem, num_items, num_n, N, ND, kb, total, HALF: gl.constexpr,
              SORTED_OUT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STAGED_SCALES: gl.constexpr,
              GROUP_M: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every item: the K blocks' promoted products, then the store.
    A 256-column item is two 128-column sub-tiles, one accumulator each: per K block the first sub-tile's
    MMA, its promotion, then the second's (one product in registers at a time: two accumulators and one
    product fit a consumer's registers, two of each would not)."""
    SUB_N: gl.constexpr = BLOCK_N if BLOCK_N < 128 else 128
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, SUB_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    zero = gl.zeros((HALF_M, SUB_N), gl.float32, layout=mma_layout)
    if BLOCK_N > 128:
        # the MMAs of two sub-tiles take the last product as their (unread: use_acc=False) accumulator: with
        # `zero` there instead, the sm_90 compile kept a tile of zeros beside two accumulators and spilled
        prod = zero
    it = 0
    expert, row0, row_end, pid_n = row_item(gl.program_id(0), num_items, num_n, tile_expert_ptr, tile_row_ptr,
                                            offsets_ptr, GROUP_M)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        n_expert, n_row0, n_row_end, n_pid_n = row_item(item + gl.num_programs(0), num_items, num_n, tile_expert_ptr,
                                                        tile_row_ptr, offsets_ptr, GROUP_M)
        if (expert >= 0) & (row0 < row_end):
            n0 = pid_n * BLOCK_N
            b_scale_off = (expert.to(gl.int64) * (ND // 128) + n0 // 128) * kb
            my_row0 = row0 + HALF * HALF_M
            rows = my_row0 + gl.arange(0, HALF_M, layout=row_layout)
            rows_in = rows < N
            # the output rows' destinations (GEMM2 and dx: order[row]) loaded now, waited for at the store
            dest = row_dest(order_ptr, my_row0, row_end, HALF_M, SUB_N, SORTED_OUT, 4)
            acc = gl.zeros((HALF_M, SUB_N), gl.float32, layout=mma_layout)
            acc2 = gl.zeros((HALF_M, SUB_N), gl.float32, layout=mma_layout)  # BLOCK_N 256 only
            for j in range(total):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                b_tile = b_smem.index(s)
                if BLOCK_N > 128:
                    prod = warpgroup_mma(a_smem.index(2 * s + HALF), b_tile.slice(0, 128).permute((1, 0)), prod,
                                         use_acc=False, is_async=True)
                else:
                    prod = warpgroup_mma(a_smem.index(2 * s + HALF), b_tile.permute((1, 0)), zero,
                                         use_acc=False, is_async=True)
                if STAGED_SCALES:
                    scale = _staged_scale(sa_smem, s, j, kb, b1s_ptr, b2s_ptr, b_scale_off, HALF, row_layout)
                else:
                    scale = _block_scale(j, kb, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, rows, rows_in, b_scale_off)
                prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                if BLOCK_N <= 128:
                    # this warpgroup's MMA has read the stage: one of the two arrivals that free it
                    mbarrier.arrive(empty.index(s), count=1)
                acc += prod * scale[:, None]
                if BLOCK_N > 128:
                    # the promotion above before the next MMA: a wait with nothing in flight that takes acc,
                    # which the compiler cannot move the MMA's issue above (left free, it issued the second
                    # MMA first and kept two products in registers: 300 bytes of spills)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    prod = warpgroup_mma(a_smem.index(2 * s + HALF), b_tile.slice(128, 128).permute((1, 0)),
                                         prod, use_acc=False, is_async=True)
                    if STAGED_SCALES:
                        scale = _staged_scale(sa_smem, s, j, kb, b1s_ptr, b2s_ptr, b_scale_off + kb, HALF, row_layout)
                    else:
                        scale = _block_scale(j, kb, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, rows, rows_in,
                                             b_scale_off + kb)
                    prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc2 += prod * scale[:, None]
                it += 1
            store_rows(out_ptr, acc, my_row0, row_end, n0, order_ptr, ND, HALF_M, SUB_N, SORTED_OUT, 4, dest)
            if BLOCK_N > 128:
                store_rows(out_ptr, acc2, my_row0, row_end, n0 + 128, order_ptr, ND, HALF_M, SUB_N, SORTED_OUT, 4,
                           dest)
        expert, row0, row_end, pid_n = n_expert, n_row0, n_row_end, n_pid_n


@gluon.jit
def _fp8_rows_ws_kernel(a1_desc, b1_desc, a2_desc, b2_desc, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, order_ptr,
                        tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr, N, KD, ND, NK1, num_items,
                        SORTED_OUT: gl.constexpr, BLOCK_N: gl.constexpr, STAGED_SCALES: gl.constexpr,
                        GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr):
    a_smem, b_smem, ready, empty = ring(a1_desc, b1_desc, BLOCK_N, STAGES)
    sa_smem = scale_stages(STAGES)  # its K block's scales of the item's 128 A rows (`_stage_row_scales`)
    kb = KD // 128  # K blocks per pair
    num_n = gl.cdiv(ND, BLOCK_N)
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, empty, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, order_ptr, tile_expert_ptr,
                     tile_row_ptr, offsets_ptr, out_ptr, sa_smem, num_items, num_n, N, ND, kb, NK1, 0, SORTED_OUT,
                     BLOCK_N, STAGES, STAGED_SCALES, GROUP_M)),
        (_consumer, (a_smem, b_smem, ready, empty, a1s_ptr, b1s_ptr, a2s_ptr, b2s_ptr, order_ptr, tile_expert_ptr,
                     tile_row_ptr, offsets_ptr, out_ptr, sa_smem, num_items, num_n, N, ND, kb, NK1, 1, SORTED_OUT,
                     BLOCK_N, STAGES, STAGED_SCALES, GROUP_M)),
        (_producer, (a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row_ptr,
                     offsets_ptr, num_items, num_n, ND, kb, NK1, a1s_ptr, a2s_ptr, sa_smem, N, BLOCK_N, STAGES,
                     STAGED_SCALES, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    ring_done(ready, empty, STAGES)


def fp8_row_gemm_ws(a1: BlockScaled, b1: BlockScaled, plan: RoutingPlan, nd: int, out_dtype=torch.bfloat16,
                    a2: BlockScaled | None = None, b2: BlockScaled | None = None, sorted_out: bool = False,
                    block_n: int = 128, stages: int = 4, out: torch.Tensor | None = None,
                    staged_scales: bool | None = None, group_m: int = 1) -> torch.Tensor:
    """`fp8_rows_gluon.fp8_row_gemm`'s result (same arguments, same sums in the same order) from the
    persistent warp-specialised kernel: out [N, nd] by sorted row (`sorted_out`) or in routed-row order.
    `staged_scales` (None: `STAGED_SCALES`): the producer copies each K block's row scales into the stage
    (`_stage_row_scales`), else each consumer loads them after issuing the block's MMA. `group_m`: the items'
    order (`plan_row_tile`'s GROUP_M; the same sums per item in any order)."""
    N, kd = a1.data.shape
    E = b1.data.shape[0]
    assert b1.data.shape == (E, nd, kd) and kd % SCALE_BLOCK == 0 and nd % SCALE_BLOCK == 0, (b1.data.shape, nd, kd)
    assert (SCALE_BLOCK % block_n == 0 or (block_n == 2 * SCALE_BLOCK and nd % block_n == 0)) \
        and plan.layout.block_m == 2 * HALF_M.value, (block_n, nd, plan.layout.block_m)
    if out is None:
        out = new_output((N, nd), out_dtype, a1.data.device)
    items = plan.layout.num_tiles * cdiv(nd, block_n)
    if items == 0:
        return out
    staged = STAGED_SCALES if staged_scales is None else staged_scales
    launch_ws(_fp8_rows_ws_kernel, items, a1.data.device, stages, *pair_args(a1, b1, a2, b2, HALF_M.value, block_n),
              plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1, out, N, kd, nd, k_blocks(a1, a2),
              items, SORTED_OUT=sorted_out, BLOCK_N=block_n, STAGED_SCALES=staged, GROUP_M=group_m,
              consumer_regs=consumer_regs(block_n),
              producer_regs=STAGING_PRODUCER_REGS if staged else PRODUCER_REGS)
    return out


def consumer_regs(block_n: int) -> int:
    """The worker consumer's registers for the row GEMMs: 256 columns (two accumulators and a product)
    take 240, which leaves the default consumer 248 (65536 / 128 threads - 240 - the producer's 24); at
    232 the sm_90 compile (Triton 3.6) spilled 8-16 bytes around each item's start."""
    return 240 if block_n > 128 else CONSUMER_REGS


def ws_options(stages: int, consumer_regs: int = CONSUMER_REGS, producer_regs: int = PRODUCER_REGS) -> dict:
    """The constexprs and launch options every persistent warp-specialised kernel here takes: the ring's
    stages, the partitions' registers (`consumer_regs`: the worker consumer's, `producer_regs` the producer
    warp's; the default partition gets what those two leave), 4 warps in the default partition, the
    register cap at launch."""
    return dict(STAGES=stages, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=4,
                maxnreg=MAXNREG)


def launch_ws(kernel, items: int, device: torch.device, stages: int, *args, consumer_regs: int = CONSUMER_REGS,
              producer_regs: int = PRODUCER_REGS, **constexprs) -> None:
    """Launch a persistent warp-specialised kernel over `items` work items: one program per multiprocessor
    (fewer where there are fewer items), each walking the items with a stride of the grid."""
    launch(kernel, (min(items, multiprocessors(device)),), *args, **constexprs,
           **ws_options(stages, consumer_regs, producer_regs))
