"""The bf16 GEMM2 in Gluon, persistent and warp-specialised: an experiment beside `grouped_gemm`'s Triton
kernel, launched only where a bf16 gemm2 tile config sets `gluon` and `warp_specialize` (GPU only; not in the
shipped table or the defaults). Timed once, on an H100, it lost (below): nothing selects it.

    y[order(p)] = h_p W2_e^T      (h [N, H] expert-sorted rows, W2 [E, D, H]: K-major, y [N, D] routed rows)

Why: the block-FP8 row GEMMs gained 1.08-1.24x over the Triton kernels from `fp8_rows_ws_gluon`'s structure,
while the bf16 GEMM2 (Triton, 128x256 tiles, 3 stages, persistent) runs at ~565 TFLOP/s on an H200 where
cuBLAS reaches 700+. The question is whether the structure, not the FP8 promotion it was built to hide,
is what helped. It is that kernel's structure without the scales: `fp8_rows_ws_gluon.ring` (a K block of
64 bf16 elements: 128 bytes, the 128-byte swizzle's width, as 128 e4m3 are there), its producer warp
(`_producer` with one operand pair and no staged scales), its item walk (`row_item`) and epilogue
(`row_dest` at an item's start, `store_rows` at its end), its launch (`launch_ws`). A 128-row item of
BLOCK_N (128 or 256) columns; the two consumer warpgroups take 64 rows each and share the weight tile.

The consumers differ: no promotion, so each accumulates straight into its fp32 wgmma accumulator (64 x
BLOCK_N: 64 or 128 registers a thread) and keeps one MMA group in flight. Per K block: wait for the stage,
issue its MMA, wait until at most that one is outstanding (`warpgroup_mma_wait(1)`), which means the
previous K block's MMA has read its stage, and release that stage (`empty`, one arrival per consumer). An
item's first K block has no previous one to release (its MMA also ignores the accumulator: use_acc False);
after the last the consumer waits for everything and releases the last stage before the store.

Rows past an expert's end are computed (TMA's rows of the next expert, or zeros past N) and masked at the
store. Columns likewise: D need not be a multiple of BLOCK_N (the last item reads the next expert's weight
rows, or TMA's zeros past the matrix, into columns the store drops), so D=1152 runs 256-column items too.
The reduction must not run into the next expert's columns: H is a multiple of the K block (64).

Measured (scripts/bench_bf16_gluon.py, one run on an H100, docs/results/bench_bf16_gluon_20261206T200637.json):
bitwise the Triton kernel's output at every shape and variant, and slower. 256 columns, 4 stages: 0.95x
at Qwen3-30B-A3B (770 against 733 us), 0.98x at 235B-A22B, 0.95x Mixtral-like; 3 stages 0.94x, 0.99x,
0.87x; 128 columns 0.74-0.89x. So the structure alone does not carry over to bf16: the FP8 kernels won by
overlapping the promotion, which bf16 does not have. Not measured, a guess at what it lacks: the two
consumers share each item's stages, so they reach its epilogue together and the tensor cores idle while
both store (a second accumulator to store one item while the next one's MMAs run fits at 128 columns
only; the ping-pong schedule, consumers on alternate items, would halve the weight tile's reuse).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ..plan import RoutingPlan
from .common import new_output, tma_ok
from .fp8_rows_gluon import _descriptor, row_dest, store_rows
from .fp8_rows_ws_gluon import HALF_M, PRODUCER_REGS, _producer, consumer_regs, launch_ws, ring, ring_done, row_item

BLOCK_K = 64  # bf16 elements per K block: 128 bytes, the widest swizzle
SMEM_BYTES = 227 * 1024  # shared memory of one sm_90 program at most


def max_stages(block_n: int) -> int:
    """The deepest ring that fits shared memory: per stage A's two 64 x 64 halves and the block_n x 64
    weight tile (bf16), beside it the epilogue's layout conversion (128 * block_n bytes over both consumers)
    and the barriers: 4 stages of 256 columns (229448 bytes in the sm_90 compile), 6 of 128. A consumer
    releases a stage only once the next K block's MMA is issued, so a ring of one stage would deadlock."""
    return (SMEM_BYTES - 128 * block_n - 64) // (2 * HALF_M.value * BLOCK_K * 2 + block_n * BLOCK_K * 2)


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr,
              num_items, num_n, ND, total, HALF: gl.constexpr, SORTED_OUT: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every item: its K blocks accumulated with one MMA in flight, each
    stage released once the MMA after it is issued and it is done, then the store."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    # carried from item to item: an item's first MMA ignores it (use_acc False), so no tile of zeros per item
    acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
    it = 0
    expert, row0, row_end, pid_n = row_item(gl.program_id(0), num_items, num_n, tile_expert_ptr, tile_row_ptr,
                                            offsets_ptr, GROUP_M)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        n_expert, n_row0, n_row_end, n_pid_n = row_item(item + gl.num_programs(0), num_items, num_n, tile_expert_ptr,
                                                        tile_row_ptr, offsets_ptr, GROUP_M)
        if (expert >= 0) & (row0 < row_end):
            my_row0 = row0 + HALF * HALF_M
            # the output rows' destinations (order[row]) loaded now, waited for at the store
            dest = row_dest(order_ptr, my_row0, row_end, HALF_M, BLOCK_N, SORTED_OUT, 4)
            for j in range(total):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(a_smem.index(2 * s + HALF), b_smem.index(s).permute((1, 0)), acc, use_acc=j > 0,
                                    is_async=True)
                # at most this block's MMA in flight: the previous block's has read its stage, which this
                # warpgroup hands back (one of the stage's two arrivals); the item's first block has none
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if j > 0:
                    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)  # the item's last stage
            store_rows(out_ptr, acc, my_row0, row_end, pid_n * BLOCK_N, order_ptr, ND, HALF_M, BLOCK_N, SORTED_OUT,
                       4, dest)
        expert, row0, row_end, pid_n = n_expert, n_row0, n_row_end, n_pid_n


@gluon.jit
def _bf16_rows_ws_kernel(a_desc, b_desc, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr, N, KD, ND,
                         num_items, SORTED_OUT: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                         STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    a_smem, b_smem, ready, empty = ring(a_desc, b_desc, BLOCK_N, STAGES)
    total = KD // a_desc.block_shape[1]  # K blocks (one operand pair)
    num_n = gl.cdiv(ND, BLOCK_N)
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, empty, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr,
                     num_items, num_n, ND, total, 0, SORTED_OUT, BLOCK_N, STAGES, GROUP_M)),
        (_consumer, (a_smem, b_smem, ready, empty, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, out_ptr,
                     num_items, num_n, ND, total, 1, SORTED_OUT, BLOCK_N, STAGES, GROUP_M)),
        # the block-FP8 kernel's producer: one pair (kb = total, the second pair's descriptors never read), no
        # scales to stage
        (_producer, (a_desc, b_desc, a_desc, b_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row_ptr,
                     offsets_ptr, num_items, num_n, ND, total, total, None, None, None, N, BLOCK_N, STAGES, False,
                     GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    ring_done(ready, empty, STAGES)


def bf16_row_gemm_ws(a: torch.Tensor, b: torch.Tensor, plan: RoutingPlan, nd: int, out_dtype=torch.bfloat16,
                     sorted_out: bool = False, block_n: int = 256, stages: int = 4, out: torch.Tensor | None = None,
                     group_m: int = 1) -> torch.Tensor:
    """out [N, nd] = a_p b_e^T by sorted row (`sorted_out`) or in routed-row order (plan.order_N): the
    grouped GEMM's GEMM2 (`grouped_gemm.expert_down_proj`) from the persistent warp-specialised kernel.
    a: expert-sorted rows [N, KD] bf16; b: the expert weight stored [E, nd, KD] bf16 (W2 itself). `out`:
    the [N, nd] tensor to write (allocated when None). `group_m`: the items' order (`plan_row_tile`)."""
    N, kd = a.shape
    E = b.shape[0]
    assert a.dtype == b.dtype == torch.bfloat16 and b.shape == (E, nd, kd), (a.dtype, b.dtype, b.shape, nd, kd)
    assert kd % BLOCK_K == 0 and tma_ok(a, b), \
        f"H={kd} must be a multiple of {BLOCK_K} and both operands contiguous, 16-byte aligned (TMA)"
    assert block_n in (128, 256) and plan.layout.block_m == 2 * HALF_M.value, (block_n, plan.layout.block_m)
    assert 2 <= stages <= max_stages(block_n), f"stages {stages}: 2 to {max_stages(block_n)} with block_n {block_n}"
    assert out is None or (out.shape == (N, nd) and out.dtype == out_dtype and out.is_contiguous())
    if out is None:
        out = new_output((N, nd), out_dtype, a.device)
    items = plan.layout.num_tiles * triton.cdiv(nd, block_n)
    if items == 0:
        return out
    launch_ws(_bf16_rows_ws_kernel, items, a.device, stages, _descriptor(a, HALF_M.value, gl.bfloat16, BLOCK_K),
              _descriptor(b, block_n, gl.bfloat16, BLOCK_K), plan.order_N, plan.tile_expert, plan.tile_row,
              plan.offsets_E1, out, N, kd, nd, items, SORTED_OUT=sorted_out, BLOCK_N=block_n, GROUP_M=group_m,
              consumer_regs=consumer_regs(block_n), producer_regs=PRODUCER_REGS)
    return out
