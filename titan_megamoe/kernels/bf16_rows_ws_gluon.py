"""bf16 row GEMMs in Gluon, persistent and warp-specialised: GEMM2, dgrad's q and dx (an experiment beside
`grouped_gemm`'s Triton kernels; GPU only, selected by nothing until a GPU has timed it).

    out[p] = A1_p B1_e (+ A2_p B2_e)      (one or two pairs of operands, one fp32 accumulator)

The block-FP8 kernels' structure (`fp8_rows_ws_gluon`, docs/kernels.md "Persistent, warp-specialised Gluon
GEMMs"), which made those GEMMs 1.2-1.4x the Triton kernels', without the scales:
- one program per multiprocessor walks the items (a 128-row plan tile by BLOCK_N columns, column blocks
  fastest, or GROUP_M row items down each column block) with a stride of the grid, so the next item's loads
  run during this item's epilogue;
- a producer warp issues every K block's TMA loads into a ring of STAGES stages: A's two 64-row halves and
  the weight tile, `ready[s]` counting their bytes;
- two consumer warpgroups (the default partition and a 4-warp worker) take the two 64-row halves and share
  each weight tile. With no promotion to do, each chains its K blocks' MMAs into its accumulator in place,
  keeps one MMA in flight (`warpgroup_mma_wait(1)`) and hands a stage back (`empty[s]`, one arrival per
  consumer) once the MMA that read it is done.

K blocks are 64 wide (128 bytes of bf16 a row: the 128-byte swizzle). An item of 128 x 256 reads 48 KB of
operands per K block for 4.2 MFLOP: 85 FLOP per byte, as the Triton kernel's 128 x 256 tile, but each
operand byte serves both consumers from one copy in shared memory and the item's epilogue overlaps the
next item's loads.

Operands: A expert-sorted rows [N, KD] (contiguous); B the expert weight as stored, either [E, ND, KD]
(B_TRANS, K-major: GEMM2's W2 [E, D, H]) or [E, KD, ND] (MN-major: dx's W1, W3 [E, H, D], dgrad's W2
[E, D, H] read [k=d, n=h]); bf16's wgmma reads either layout from shared memory. Rows of an item past its
expert's end and columns past ND are computed and dropped at the store. Output bf16 (or A's dtype): sorted
rows (dgrad's q) or scattered to routed-row order through the plan's `order` (GEMM2, dx).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..plan import RoutingPlan
from .common import new_output
from .fp8_rows_gluon import _tma_load, row_dest, store_rows
from .fp8_rows_ws_gluon import HALF_M, PRODUCER_REGS, launch_ws, ring_done, row_item

BLOCK_K = gl.constexpr(64)  # one K block: 64 bf16 = 128 bytes a row
# per thread of the worker consumer warpgroup: its 64 x 256 fp32 accumulator is 128 registers
CONSUMER_REGS = 232


@gluon.jit
def _ring(a_desc, b_desc, BLOCK_N: gl.constexpr, B_TRANS: gl.constexpr, STAGES: gl.constexpr):
    """STAGES stages of A's two 64 x 64 halves (a_smem[2s], a_smem[2s + 1]) and the weight tile (BLOCK_N x 64
    K-major, or 64 x BLOCK_N), with their barriers: `ready[s]` (the stage's TMA bytes have landed) and
    `empty[s]` (both consumers' MMAs have read it)."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
    if B_TRANS:
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    else:
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit before its first copy
    return a_smem, b_smem, ready, empty


@gluon.jit
def _load_block(a_desc, b_desc, a_smem, b_smem, bar, s, row0, k, expert, n0, KD, ND, B_TRANS: gl.constexpr):
    _tma_load(a_desc, [row0, k], bar, a_smem.index(2 * s))
    _tma_load(a_desc, [row0 + HALF_M, k], bar, a_smem.index(2 * s + 1))
    if B_TRANS:  # W [E, ND, KD] viewed [E * ND, KD]
        _tma_load(b_desc, [expert * ND + n0, k], bar, b_smem.index(s))
    else:  # W [E, KD, ND] viewed [E * KD, ND]
        _tma_load(b_desc, [expert * KD + k, n0], bar, b_smem.index(s))


@gluon.jit
def _producer(a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row_ptr,
              offsets_ptr, num_items, num_n, KD, ND, kb, total, BLOCK_N: gl.constexpr, B_TRANS: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA of every K block of this program's items into a stage both consumers have freed (a fresh barrier
    counts as freed: the first pass waits on phase 1). `it` counts K blocks across items, as the consumers'
    does, so stages and phases run on from one item to the next."""
    it = 0
    expert, row0, row_end, pid_n = row_item(gl.program_id(0), num_items, num_n, tile_expert_ptr, tile_row_ptr,
                                            offsets_ptr, GROUP_M)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        n_expert, n_row0, n_row_end, n_pid_n = row_item(item + gl.num_programs(0), num_items, num_n, tile_expert_ptr,
                                                        tile_row_ptr, offsets_ptr, GROUP_M)
        if (expert >= 0) & (row0 < row_end):
            n0 = pid_n * BLOCK_N
            for j in range(total):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, 2 * a1_desc.block_type.nbytes + b1_desc.block_type.nbytes)
                if j < kb:  # the first pair's K blocks, then the second's (dx)
                    _load_block(a1_desc, b1_desc, a_smem, b_smem, bar, s, row0, j * BLOCK_K, expert, n0, KD, ND,
                                B_TRANS)
                else:
                    _load_block(a2_desc, b2_desc, a_smem, b_smem, bar, s, row0, (j - kb) * BLOCK_K, expert, n0, KD,
                                ND, B_TRANS)
                it += 1
        expert, row0, row_end, pid_n = n_expert, n_row0, n_row_end, n_pid_n


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr,
              num_items, num_n, ND, total, HALF: gl.constexpr, SORTED_OUT: gl.constexpr, BLOCK_N: gl.constexpr,
              B_TRANS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every item: the K blocks' MMAs chained into one accumulator, one
    in flight while the previous one's stage is handed back, then the store."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    it = 0
    expert, row0, row_end, pid_n = row_item(gl.program_id(0), num_items, num_n, tile_expert_ptr, tile_row_ptr,
                                            offsets_ptr, GROUP_M)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        n_expert, n_row0, n_row_end, n_pid_n = row_item(item + gl.num_programs(0), num_items, num_n, tile_expert_ptr,
                                                        tile_row_ptr, offsets_ptr, GROUP_M)
        if (expert >= 0) & (row0 < row_end):
            n0 = pid_n * BLOCK_N
            my_row0 = row0 + HALF * HALF_M
            # the output rows' destinations (GEMM2 and dx: order[row]) loaded now, waited for at the store
            dest = row_dest(order_ptr, my_row0, row_end, HALF_M, BLOCK_N, SORTED_OUT, 4)
            acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
            for j in range(total):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                if B_TRANS:
                    b = b_smem.index(s).permute((1, 0))
                else:
                    b = b_smem.index(s)
                acc = warpgroup_mma(a_smem.index(2 * s + HALF), b, acc, is_async=True)
                # the previous K block's MMA is done once at most this one is in flight: its stage is free
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if j > 0:
                    mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            store_rows(out_ptr, acc, my_row0, row_end, n0, order_ptr, ND, HALF_M, BLOCK_N, SORTED_OUT, 4, dest)
        expert, row0, row_end, pid_n = n_expert, n_row0, n_row_end, n_pid_n


@gluon.jit
def _bf16_rows_ws_kernel(a1_desc, b1_desc, a2_desc, b2_desc, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                         out_ptr, KD, ND, total, num_items, SORTED_OUT: gl.constexpr, BLOCK_N: gl.constexpr,
                         B_TRANS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    a_smem, b_smem, ready, empty = _ring(a1_desc, b1_desc, BLOCK_N, B_TRANS, STAGES)
    kb = KD // BLOCK_K  # K blocks per pair
    num_n = gl.cdiv(ND, BLOCK_N)
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, empty, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr,
                     num_items, num_n, ND, total, 0, SORTED_OUT, BLOCK_N, B_TRANS, STAGES, GROUP_M)),
        (_consumer, (a_smem, b_smem, ready, empty, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr,
                     num_items, num_n, ND, total, 1, SORTED_OUT, BLOCK_N, B_TRANS, STAGES, GROUP_M)),
        (_producer, (a1_desc, b1_desc, a2_desc, b2_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row_ptr,
                     offsets_ptr, num_items, num_n, KD, ND, kb, total, BLOCK_N, B_TRANS, STAGES, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    ring_done(ready, empty, STAGES)


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor over t as a matrix (leading dimensions flattened) in `block` tiles, with the
    MMA-friendly shared-memory layout of its dtype."""
    t = t.reshape(-1, t.shape[-1])
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return TensorDescriptor.from_tensor(t, block, layout)


def bf16_row_gemm_ws(a1: torch.Tensor, b1: torch.Tensor, plan: RoutingPlan, nd: int, b_trans: bool,
                     out_dtype=torch.bfloat16, a2: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                     sorted_out: bool = False, block_n: int = 256, stages: int = 3, out: torch.Tensor | None = None,
                     group_m: int = 1) -> torch.Tensor:
    """out [N, nd] = A1_p B1_e (+ A2_p B2_e) by sorted row (`sorted_out`) or in routed-row order, from the
    persistent warp-specialised kernel. a: sorted rows [N, KD]; b: the expert weight [E, nd, KD] (`b_trans`)
    or [E, KD, nd], contiguous. `group_m`: the items' order (`plan_row_tile`'s GROUP_M)."""
    N, kd = a1.shape
    E = b1.shape[0]
    want = (E, nd, kd) if b_trans else (E, kd, nd)
    assert b1.shape == want and kd % BLOCK_K.value == 0 and plan.layout.block_m == 2 * HALF_M.value, \
        (b1.shape, want, plan.layout.block_m)
    assert a1.is_contiguous() and b1.is_contiguous() and (a2 is None or (a2.is_contiguous() and b2.is_contiguous()))
    if out is None:
        out = new_output((N, nd), out_dtype, a1.device)
    items = plan.layout.num_tiles * triton.cdiv(nd, block_n)
    if items == 0:
        return out
    bk = BLOCK_K.value
    a_block, b_block = [HALF_M.value, bk], ([block_n, bk] if b_trans else [bk, block_n])
    descs = [_descriptor(a1, a_block), _descriptor(b1, b_block)]
    descs += [_descriptor(a2, a_block), _descriptor(b2, b_block)] if a2 is not None else descs
    total = kd // bk * (2 if a2 is not None else 1)
    launch_ws(_bf16_rows_ws_kernel, items, a1.device, stages, *descs, plan.order_N, plan.tile_expert, plan.tile_row,
              plan.offsets_E1, out, kd, nd, total, items, SORTED_OUT=sorted_out, BLOCK_N=block_n, B_TRANS=b_trans,
              GROUP_M=group_m, consumer_regs=CONSUMER_REGS, producer_regs=PRODUCER_REGS)
    return out
