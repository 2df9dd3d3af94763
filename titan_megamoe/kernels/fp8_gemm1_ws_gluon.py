"""Block-FP8 GEMM1 (gate and up, SwiGLU, h quantized) in Gluon, persistent and warp-specialised (an
experiment beside `gemm1_swiglu`'s Triton kernel, launched where its tile config sets `gluon` and
`warp_specialize`; GPU only).

    g = x W1_e^T, u = x W3_e^T (per 128-wide K block: the FP8 product times x's row scale and the weight's
    block scale, added in fp32), h = silu(g) u; g, u stored bf16; h rounded to bf16, then e4m3 with one
    scale per row of the item's 128 columns

`fp8_rows_ws_gluon`'s structure (a producer warp, two consumer warpgroups of 64 rows sharing each weight
tile, one program per multiprocessor walking the items) with GEMM1's operands. An item is a 128-row plan
tile by the 128 columns of one scale block of h, taken in two 64-column halves one after the other (h's
row scale needs both). For each half and K block a stage holds x's two 64-row halves and one 128 x 128
weight tile: W1's 64 rows of the half above W3's, so one MMA of N = 128 gives gate and up side by side
(two MMAs of N = 64 would read x's tile from shared memory twice). Its columns are scaled by x's row scale
times W1's or W3's block scale; at the half's end the accumulator is split into g and u in registers
(columns c and c + 64 sit in the same thread) and the epilogue works in a store-friendly layout.

BLOCK_N 128 (`_consumer_full`): the item's 128 columns in one pass, a stage holding W1's 128 rows above W3's,
one MMA into g's accumulator and one into u's per K block: x's tile is read once per K block instead of
twice. 1.18-1.21x the two-half form at Qwen3 shapes on an H100 (docs/kernels.md, "Wider items"), bitwise the
same g, u and h.

h goes to e4m3 by the hardware cast (`quantize_gluon.e4m3_cast`), not `common.to_e4m3`'s rounding in fp32 first
(the Triton kernels' guard against Triton 3.6's miscast in programs that store a tile twice; this one stores h
once): h's row scale keeps every |h / scale| <= 448, so the two give the same bytes.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .common import cast_rne, e4m3_scale, new_output
from .epilogue import swiglu
from .fp8_rows_gluon import SCALE_BLOCK, _descriptor, _tma_load, plan_row_tile
from .fp8_rows_ws_gluon import HALF_M, launch_ws, ring, ring_done
from .quantize_gluon import e4m3_cast


@gluon.jit
def _producer(x_desc, w1_desc, w3_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row_ptr, offsets_ptr,
              num_items, num_n, H, kb, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA of this program's items' K blocks: x's two 64-row halves, and W1's and W3's rows stacked in one
    weight tile (BLOCK_N 64: each half's 64 rows, the halves one after the other; BLOCK_N 128: all 128)."""
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        expert, row0, row_end, pid_n = plan_row_tile(item, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                                     2 * HALF_M, 1, GROUP_M, num_items)
        if (expert >= 0) & (row0 < row_end):
            for j in range(kb * (128 // BLOCK_N)):
                k = j % kb
                w_row = expert * H + pid_n * 128 + (j // kb) * BLOCK_N
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, 2 * x_desc.block_type.nbytes + 2 * w1_desc.block_type.nbytes)
                _tma_load(x_desc, [row0, k * 128], bar, a_smem.index(2 * s))
                _tma_load(x_desc, [row0 + HALF_M, k * 128], bar, a_smem.index(2 * s + 1))
                _tma_load(w1_desc, [w_row, k * 128], bar, b_smem.index(s).slice(0, BLOCK_N))
                _tma_load(w3_desc, [w_row, k * 128], bar, b_smem.index(s).slice(BLOCK_N, BLOCK_N))
                it += 1


@gluon.jit
def _consumer_rows(expert, row0, pid_n, N, H, kb, HALF: gl.constexpr, row_layout: gl.constexpr):
    """A consumer's view of an item: its first column, its first row, its 64 rows and which lie in the matrix,
    and where the item's 128x128 weight blocks start in a weight scale."""
    my_row0 = row0 + HALF * HALF_M
    rows = my_row0 + gl.arange(0, HALF_M, layout=row_layout)
    return pid_n * 128, my_row0, rows, rows < N, (expert.to(gl.int64) * (H // 128) + pid_n) * kb


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
              g_ptr, u_ptr, h_ptr, hs_ptr, num_items, num_n, N, H, kb, HALF: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every item: per 64-column half the promoted [g | u] accumulator,
    g and u stored, h kept; then h quantized over the item's 128 columns."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte bf16 stores
    zero = gl.zeros((HALF_M, 128), gl.float32, layout=mma_layout)
    is_gate = gl.arange(0, 128, layout=gl.SliceLayout(0, mma_layout)) < 64  # [g | u] columns of the accumulator
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        expert, row0, row_end, pid_n = plan_row_tile(item, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                                     2 * HALF_M, 1, GROUP_M, num_items)
        if (expert >= 0) & (row0 < row_end):
            n0, my_row0, rows, rows_in, ws_off = _consumer_rows(expert, row0, pid_n, N, H, kb, HALF, row_layout)
            srows = my_row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, store_layout))
            srow_ok = srows < row_end  # rows past the expert's end were computed and are dropped here
            row_off = srows.to(gl.int64)[:, None] * H
            for half in gl.static_range(2):
                acc = gl.zeros((HALF_M, 128), gl.float32, layout=mma_layout)
                for k in range(kb):
                    s = it % STAGES
                    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                    prod = warpgroup_mma(a_smem.index(2 * s + HALF), b_smem.index(s).permute((1, 0)), zero,
                                         use_acc=False, is_async=True)
                    sa = gl.load(xs_ptr + rows.to(gl.int64) * kb + k, mask=rows_in, other=0.0)
                    col_scale = gl.where(is_gate, gl.load(w1s_ptr + ws_off + k), gl.load(w3s_ptr + ws_off + k))
                    prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                    mbarrier.arrive(empty.index(s), count=1)  # one of the two arrivals that free the stage
                    # (sa * sb) first, as the Triton kernel scales: the same fp32 sums, bit for bit
                    acc += prod * (sa[:, None] * col_scale[None, :])
                    it += 1
                g, u = acc.reshape([HALF_M, 2, 64]).permute(0, 2, 1).split()
                g = gl.convert_layout(g, store_layout)
                u = gl.convert_layout(u, store_layout)
                cols = n0 + 64 * half + gl.arange(0, 64, layout=gl.SliceLayout(0, store_layout))
                ok = srow_ok[:, None] & (cols < H)[None, :]
                gl.store(g_ptr + row_off + cols[None, :], g.to(gl.bfloat16), mask=ok)
                gl.store(u_ptr + row_off + cols[None, :], u.to(gl.bfloat16), mask=ok)
                h = cast_rne(swiglu(g, u), gl.bfloat16, False)  # held as bf16 (its value) until both halves are in
                if half == 0:
                    h0 = h
                else:
                    h1 = h
            h0 = h0.to(gl.float32)
            h1 = h1.to(gl.float32)
            # h in e4m3, one scale per row over the two halves' 128 columns (`epilogue.store_row_halves_fp8`)
            h_scale, h_inv = e4m3_scale(gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1)))
            cols0 = n0 + gl.arange(0, 64, layout=gl.SliceLayout(0, store_layout))
            gl.store(h_ptr + row_off + cols0[None, :], e4m3_cast(h0, h_inv[:, None], False), mask=srow_ok[:, None])
            gl.store(h_ptr + row_off + (cols0 + 64)[None, :], e4m3_cast(h1, h_inv[:, None], False),
                     mask=srow_ok[:, None])
            gl.store(hs_ptr + srows.to(gl.int64) * (H // 128) + pid_n, h_scale, mask=srow_ok)


@gluon.jit
def _consumer_full(a_smem, b_smem, ready, empty, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr,
                   offsets_ptr, g_ptr, u_ptr, h_ptr, hs_ptr, num_items, num_n, N, H, kb, HALF: gl.constexpr,
                   STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """`_consumer`'s rows and outputs with all 128 columns of an item in one pass (BLOCK_N 128): a stage holds
    W1's 128 rows above W3's, and per K block one MMA into g's accumulator, its promotion, then one into u's
    (one product in registers at a time beside the two accumulators). x's tile is read once per K block
    instead of twice: 171 FLOP per operand byte against 128."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16-byte bf16 stores
    h_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # 16-byte e4m3 stores
    # each MMA takes the last product as its (unread: use_acc=False) accumulator, so no tile of zeros
    # stays live beside the two accumulators (`fp8_rows_ws_gluon._consumer`)
    prod = gl.zeros((HALF_M, 128), gl.float32, layout=mma_layout)
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        expert, row0, row_end, pid_n = plan_row_tile(item, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                                     2 * HALF_M, 1, GROUP_M, num_items)
        if (expert >= 0) & (row0 < row_end):
            n0, my_row0, rows, rows_in, ws_off = _consumer_rows(expert, row0, pid_n, N, H, kb, HALF, row_layout)
            acc_g = gl.zeros((HALF_M, 128), gl.float32, layout=mma_layout)
            acc_u = gl.zeros((HALF_M, 128), gl.float32, layout=mma_layout)
            for k in range(kb):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                b_tile = b_smem.index(s)
                prod = warpgroup_mma(a_smem.index(2 * s + HALF), b_tile.slice(0, 128).permute((1, 0)), prod,
                                     use_acc=False, is_async=True)
                sa = gl.load(xs_ptr + rows.to(gl.int64) * kb + k, mask=rows_in, other=0.0)
                sg = gl.load(w1s_ptr + ws_off + k)
                prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                # (sa * sb) first, as the Triton kernel scales: the same fp32 sums, bit for bit
                acc_g += prod * (sa * sg)[:, None]
                # the promotion before the next MMA's issue (`fp8_rows_ws_gluon._consumer`: otherwise two
                # products are kept and spill)
                acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, ))
                prod = warpgroup_mma(a_smem.index(2 * s + HALF), b_tile.slice(128, 128).permute((1, 0)), prod,
                                     use_acc=False, is_async=True)
                su = gl.load(w3s_ptr + ws_off + k)
                prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                mbarrier.arrive(empty.index(s), count=1)  # one of the two arrivals that free the stage
                acc_u += prod * (sa * su)[:, None]
                it += 1
            # the epilogue: h from the accumulators in their own layout (elementwise), then g, u and h's e4m3
            # moved into 16-byte store layouts one at a time, in bf16 / e4m3 (the registers of two fp32 tiles
            # moved at once spilled)
            h = cast_rne(swiglu(acc_g, acc_u), gl.bfloat16, False)  # the value the emulation quantizes
            srows = my_row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, store_layout))
            srow_ok = srows < row_end  # rows past the expert's end were computed and are dropped here
            row_off = srows.to(gl.int64)[:, None] * H
            cols = n0 + gl.arange(0, 128, layout=gl.SliceLayout(0, store_layout))
            gl.store(g_ptr + row_off + cols[None, :], gl.convert_layout(acc_g.to(gl.bfloat16), store_layout),
                     mask=srow_ok[:, None])
            gl.store(u_ptr + row_off + cols[None, :], gl.convert_layout(acc_u.to(gl.bfloat16), store_layout),
                     mask=srow_ok[:, None])
            # h in e4m3, one scale per row over the item's 128 columns
            h = h.to(gl.float32)
            h_scale, h_inv = e4m3_scale(gl.max(gl.abs(h), axis=1))
            hq = gl.convert_layout(e4m3_cast(h, h_inv[:, None], False), h_layout)
            hrows = my_row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, h_layout))
            hcols = n0 + gl.arange(0, 128, layout=gl.SliceLayout(0, h_layout))
            gl.store(h_ptr + hrows.to(gl.int64)[:, None] * H + hcols[None, :], hq, mask=(hrows < row_end)[:, None])
            gl.store(hs_ptr + rows.to(gl.int64) * (H // 128) + pid_n, h_scale, mask=rows < row_end)


@gluon.jit
def _consumer_of(a_smem, b_smem, ready, empty, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                 g_ptr, u_ptr, h_ptr, hs_ptr, num_items, num_n, N, H, kb, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The consumer partition of BLOCK_N: the two-half form (64) or the one pass (128)."""
    if BLOCK_N == 64:
        _consumer(a_smem, b_smem, ready, empty, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                  g_ptr, u_ptr, h_ptr, hs_ptr, num_items, num_n, N, H, kb, HALF, STAGES, GROUP_M)
    else:
        _consumer_full(a_smem, b_smem, ready, empty, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr,
                       offsets_ptr, g_ptr, u_ptr, h_ptr, hs_ptr, num_items, num_n, N, H, kb, HALF, STAGES, GROUP_M)


@gluon.jit
def _fp8_gemm1_ws_kernel(x_desc, w1_desc, w3_desc, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr,
                         offsets_ptr, g_ptr, u_ptr, h_ptr, hs_ptr, N, D, H, num_items, BLOCK_N: gl.constexpr,
                         GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr):
    # a weight tile: W1's BLOCK_N rows above W3's
    a_smem, b_smem, ready, empty = ring(x_desc, w1_desc, 2 * BLOCK_N, STAGES)
    kb = D // 128
    num_n = H // 128
    gl.warp_specialize([
        (_consumer_of, (a_smem, b_smem, ready, empty, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr,
                        offsets_ptr, g_ptr, u_ptr, h_ptr, hs_ptr, num_items, num_n, N, H, kb, 0, BLOCK_N, STAGES,
                        GROUP_M)),
        (_consumer_of, (a_smem, b_smem, ready, empty, xs_ptr, w1s_ptr, w3s_ptr, tile_expert_ptr, tile_row_ptr,
                        offsets_ptr, g_ptr, u_ptr, h_ptr, hs_ptr, num_items, num_n, N, H, kb, 1, BLOCK_N, STAGES,
                        GROUP_M)),
        (_producer, (x_desc, w1_desc, w3_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row_ptr,
                     offsets_ptr, num_items, num_n, H, kb, BLOCK_N, STAGES, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    ring_done(ready, empty, STAGES)


def fp8_gemm1_ws(x: BlockScaled, w1: BlockScaled, w3: BlockScaled, plan: RoutingPlan, out_dtype=torch.bfloat16,
                 stages: int = 4, block_n: int = 64, group_m: int = 1):
    """(g, u, h) as `gemm1_swiglu` returns them for block FP8 with sorted rows (`fp8_gemm1_gluon.fp8_gemm1`'s
    contract), from the persistent warp-specialised kernel. `group_m`: the items' order
    (`fp8_rows_gluon.plan_row_tile`'s GROUP_M; the same sums per item in any order)."""
    N, D = x.data.shape
    E, H, _ = w1.data.shape
    assert D % SCALE_BLOCK == 0 and H % SCALE_BLOCK == 0 and plan.layout.block_m == 2 * HALF_M.value, (D, H)
    assert out_dtype == torch.bfloat16, "the kernel stores g and u in bf16"
    assert block_n in (64, 128), block_n
    dev = x.data.device
    g, u = (new_output((N, H), out_dtype, dev) for _ in range(2))
    h = BlockScaled(new_output((N, H), torch.float8_e4m3fn, dev), new_output((N, H // 128), torch.float32, dev),
                    (1, 128))
    items = plan.layout.num_tiles * (H // 128)
    if items == 0:
        return g, u, h
    launch_ws(_fp8_gemm1_ws_kernel, items, dev, stages, _descriptor(x.data, HALF_M.value), _descriptor(w1.data, block_n),
              _descriptor(w3.data, block_n), x.scale, w1.scale, w3.scale, plan.tile_expert, plan.tile_row,
              plan.offsets_E1, g, u, h.data, h.scale, N, D, H, items, BLOCK_N=block_n, GROUP_M=group_m)
    return g, u, h

