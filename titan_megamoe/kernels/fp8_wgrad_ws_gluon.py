"""Block-FP8 expert weight gradients in Gluon, persistent and warp-specialised: dW2 and dW1/dW3 (launched
where the tile config sets `gluon` and `warp_specialize`, the table's choice for both at the Qwen3 shapes
since 2026-12-06; GPU only).

    C_e = sum over expert e's token tiles t of (A[:, t] * sa_t) (B[:, t] * sb_t)^T    (`wgrad` docstring)

Operands in the token-tile layout (`quant.quantize_token_tiles`: e4m3 [rows, P], tokens contiguous, one
fp32 scale per row and tile). `fp8_rows_ws_gluon`'s structure: a producer warp loads each K step (one
token tile) of A's two 64-row halves and B's 128-row tile into a ring of stages, with that tile's scales of
the item's rows (`_stage_scales`: asynchronous copies the stage's ready barrier counts); two consumer
warpgroups take the halves of a 128 x 128 output tile, sharing B, and promote each tile's product into fp32
with its row and column scales (an outer product: sa per output row, sb per output column), read from the
stage. Each consumer's finished tile leaves through shared memory and an asynchronous TMA store
(`_store_tile_tma`) while it goes on to its next item. An item is (expert slot, output row block, output
column block), items of one expert next to each other, experts heaviest first
(`RoutingPlan.experts_by_load`). An expert without rows stores zeros. dW1/dW3 (DUAL): one item computes
both tiles over one x tile per stage (dg's and du's halves beside it, 48 KB a stage), each consumer keeping
two accumulators and one product at a time (the promotion of dW1's product ordered before dW3's MMA).

Why the scales come with the stage (docs/kernels.md, "Weight gradients: scales staged by the producer"):
loaded by each consumer one token tile ahead, 128 scattered four-byte loads a step were not back within a
step, and a quarter of the consumers' time went to waiting for them.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..plan import RoutingPlan
from ..precision import BlockScaled
from .fp8_rows_gluon import SCALE_BLOCK, _cp_async, _cta_barrier, _descriptor, _tma_load, _tma_store
from .common import cdiv, tma_ok
from .fp8_rows_ws_gluon import (CONSUMER_REGS, HALF_M, STAGING_PRODUCER_REGS, launch_ws, ring, ring_done,
                                scale_stages, stage_rows)

# the tiles' store: TMA from shared memory (asynchronous: the consumer goes on while it runs) or the
# consumers' own stores from registers (`fp8_wgrad_ws`'s `tma_store`; H100, 30B-A3B dW2 at 4 stages: 0.737
# against 0.754 ms, bench_fp8_wgrad_20261206T120352.json)
TMA_STORE = True
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@gluon.jit
def _item(item, tiles_m, tiles_n, expert_slot_ptr, first_tile_ptr, offsets_ptr):
    """(expert, its first token tile, its token tiles, output row block, output column block) of an item:
    column blocks fastest, then row blocks, expert slots. The first token tile comes from the plan's
    per-expert table (`RoutingPlan.expert_first_tile`): a sum over the experts before it, redone per item in
    every partition, cost a cross-warp reduction on the consumers' path."""
    pid_n = item % tiles_n
    rest = item // tiles_n
    pid_m = rest % tiles_m
    expert = gl.load(expert_slot_ptr + rest // tiles_m)
    first = gl.load(first_tile_ptr + expert)
    rows = gl.load(offsets_ptr + expert + 1) - gl.load(offsets_ptr + expert)
    return expert, first, (rows + 127) // 128, pid_m, pid_n


@gluon.jit
def _stage_scales(a_scale_ptr, a2_scale_ptr, b_scale_ptr, sa_smem, sa2_smem, sb_smem, bar, s, t, pid_m, pid_n, M,
                  N, stride_sa, stride_sb, DUAL: gl.constexpr):
    """Token tile t's scales of an item's 128 A rows (A2's too with DUAL) and 128 B rows into stage s's
    buffers (zeros past M and N) by asynchronous copies that `bar` (the stage's ready barrier) waits for:
    the producer warp issues them and goes on, as it does its TMA loads."""
    rows = stage_rows(pid_m * 128)
    cols = stage_rows(pid_n * 128)
    # int32 offsets: a scale matrix has rows x tiles entries, far below 2^31
    _cp_async(sa_smem.index(s), a_scale_ptr + rows * stride_sa + t, mask=rows < M)
    if DUAL:
        _cp_async(sa2_smem.index(s), a2_scale_ptr + rows * stride_sa + t, mask=rows < M)
    _cp_async(sb_smem.index(s), b_scale_ptr + cols * stride_sb + t, mask=cols < N)
    # counted on the barrier before the arrival that expects the TMA bytes, so the phase waits for both
    async_copy.mbarrier_arrive(bar)


@gluon.jit
def _producer(a_desc, a2_desc, b_desc, a_smem, b_smem, ready, empty, expert_slot_ptr, first_tile_ptr, offsets_ptr,
              num_items, tiles_m, tiles_n, a_scale_ptr, a2_scale_ptr, b_scale_ptr, sa_smem, sa2_smem, sb_smem, M, N,
              stride_sa, stride_sb, DUAL: gl.constexpr, STAGES: gl.constexpr):
    A_TILES: gl.constexpr = 2 if DUAL else 1
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        expert, first, count, pid_m, pid_n = _item(item, tiles_m, tiles_n, expert_slot_ptr, first_tile_ptr,
                                                   offsets_ptr)
        for t in range(first, first + count):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            _stage_scales(a_scale_ptr, a2_scale_ptr, b_scale_ptr, sa_smem, sa2_smem, sb_smem, bar, s, t, pid_m, pid_n,
                          M, N, stride_sa, stride_sb, DUAL)
            mbarrier.expect(bar, 2 * A_TILES * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_m * 128, t * 128], bar, a_smem.index(2 * A_TILES * s))
            _tma_load(a_desc, [pid_m * 128 + HALF_M, t * 128], bar, a_smem.index(2 * A_TILES * s + 1))
            if DUAL:
                _tma_load(a2_desc, [pid_m * 128, t * 128], bar, a_smem.index(4 * s + 2))
                _tma_load(a2_desc, [pid_m * 128 + HALF_M, t * 128], bar, a_smem.index(4 * s + 3))
            _tma_load(b_desc, [pid_n * 128, t * 128], bar, b_smem.index(s))
            it += 1


@gluon.jit
def _store_tile(c_ptr, acc, expert, pid_m, M, N, scols, HALF: gl.constexpr, store_layout: gl.constexpr):
    # cast to the output's dtype first: half the bytes through shared memory for a bf16 gradient
    val = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), store_layout)
    srows = pid_m * 128 + HALF * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, store_layout))
    off = (expert.to(gl.int64) * M + srows)[:, None] * N + scols[None, :]
    gl.store(c_ptr + off, val, mask=(srows < M)[:, None] & (scols < N)[None, :])


@gluon.jit
def _store_tile_tma(c_desc, c_smem, acc, expert, pid_m, pid_n, M, HALF: gl.constexpr):
    """The tile through shared memory and an asynchronous TMA store: the consumer goes on to its next item
    while the copy runs, waiting only before it reuses the buffer (the previous store's read of it)."""
    tma.store_wait(0)
    _cta_barrier()  # the store was issued by one thread: every thread past its wait before the buffer is written
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()  # the writes visible to the TMA unit
    _cta_barrier()  # every thread's part written before the copy is issued
    _tma_store(c_desc, [expert * M + pid_m * 128 + HALF * HALF_M, pid_n * 128], c_smem)


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, expert_slot_ptr, first_tile_ptr, offsets_ptr, c_ptr, c2_ptr, c_desc,
              c2_desc, c_smem, sa_smem, sa2_smem, sb_smem, num_items, tiles_m, tiles_n, M, N, HALF: gl.constexpr,
              DUAL: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr):
    """Output rows HALF * 64 .. HALF * 64 + 63 of every item's 128 x 128 tile (DUAL: of C and C2, one
    accumulator each: per token tile the MMA with A's half, its promotion, then the one with A2's half;
    one product in registers at a time). The scales come with the stage (`_stage_scales`)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    zero = gl.zeros((HALF_M, 128), gl.float32, layout=mma_layout)
    if DUAL:
        # the MMAs take the last product as their (unread: use_acc=False) accumulator, so no tile of zeros
        # stays live beside the two accumulators (`fp8_rows_ws_gluon._consumer`)
        prod = zero
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        expert, first, count, pid_m, pid_n = _item(item, tiles_m, tiles_n, expert_slot_ptr, first_tile_ptr,
                                                   offsets_ptr)
        acc = gl.zeros((HALF_M, 128), gl.float32, layout=mma_layout)
        if DUAL:
            acc2 = gl.zeros((HALF_M, 128), gl.float32, layout=mma_layout)
        for t in range(first, first + count):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if DUAL:
                prod = warpgroup_mma(a_smem.index(4 * s + HALF), b_smem.index(s).permute((1, 0)), prod,
                                     use_acc=False, is_async=True)
            else:
                prod = warpgroup_mma(a_smem.index(2 * s + HALF), b_smem.index(s).permute((1, 0)), zero,
                                     use_acc=False, is_async=True)
            # the stage's scales, read before the stage is handed back
            sa = sa_smem.index(s).slice(HALF * HALF_M, HALF_M).load(row_layout)
            sb = sb_smem.index(s).load(gl.SliceLayout(0, mma_layout))
            if DUAL:
                sa2 = sa2_smem.index(s).slice(HALF * HALF_M, HALF_M).load(row_layout)
            prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
            if not DUAL:
                mbarrier.arrive(empty.index(s), count=1)  # one of the two arrivals that free the stage
            # (partial * sa) * sb, as the Triton kernel scales: each step exact (power-of-two scales)
            acc += prod * sa[:, None] * sb[None, :]
            if DUAL:
                # the promotion above before the next MMA's issue (otherwise two products are kept and spill)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                prod = warpgroup_mma(a_smem.index(4 * s + 2 + HALF), b_smem.index(s).permute((1, 0)), prod,
                                     use_acc=False, is_async=True)
                prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                mbarrier.arrive(empty.index(s), count=1)  # one of the two arrivals that free the stage
                acc2 += prod * sa2[:, None] * sb[None, :]
            it += 1
        if TMA_STORE:
            _store_tile_tma(c_desc, c_smem.index(HALF), acc, expert, pid_m, pid_n, M, HALF)
            if DUAL:
                _store_tile_tma(c2_desc, c_smem.index(HALF), acc2, expert, pid_m, pid_n, M, HALF)
        else:
            scols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, store_layout))
            _store_tile(c_ptr, acc, expert, pid_m, M, N, scols, HALF, store_layout)
            if DUAL:
                _store_tile(c2_ptr, acc2, expert, pid_m, M, N, scols, HALF, store_layout)
    if TMA_STORE:
        tma.store_wait(0)  # the last tile's copy has read the buffer before the program (and its memory) ends


@gluon.jit
def _fp8_wgrad_ws_kernel(a_desc, a2_desc, b_desc, a_scale_ptr, a2_scale_ptr, b_scale_ptr, expert_slot_ptr,
                         first_tile_ptr, offsets_ptr, c_ptr, c2_ptr, c_desc, c2_desc, num_items, tiles_m, tiles_n, M,
                         N, stride_sa, stride_sb, DUAL: gl.constexpr, TMA_STORE: gl.constexpr, STAGES: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    a_smem, b_smem, ready, empty = ring(a_desc, b_desc, 128, STAGES, 2 if DUAL else 1)
    if TMA_STORE:  # one output buffer per consumer: its 64 rows of a tile
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, HALF_M, 128], c_desc.layout)
    else:
        c_smem = a_smem
    # per stage, its token tile's scales of the item's 128 A rows (A2's) and 128 B rows (`_stage_scales`)
    sa_smem = scale_stages(STAGES)
    sa2_smem = scale_stages(STAGES) if DUAL else sa_smem
    sb_smem = scale_stages(STAGES)
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, empty, expert_slot_ptr, first_tile_ptr, offsets_ptr, c_ptr, c2_ptr, c_desc,
                     c2_desc, c_smem, sa_smem, sa2_smem, sb_smem, num_items, tiles_m, tiles_n, M, N, 0, DUAL, STAGES,
                     TMA_STORE)),
        (_consumer, (a_smem, b_smem, ready, empty, expert_slot_ptr, first_tile_ptr, offsets_ptr, c_ptr, c2_ptr, c_desc,
                     c2_desc, c_smem, sa_smem, sa2_smem, sb_smem, num_items, tiles_m, tiles_n, M, N, 1, DUAL, STAGES,
                     TMA_STORE)),
        (_producer, (a_desc, a2_desc, b_desc, a_smem, b_smem, ready, empty, expert_slot_ptr, first_tile_ptr,
                     offsets_ptr, num_items, tiles_m, tiles_n, a_scale_ptr, a2_scale_ptr, b_scale_ptr, sa_smem,
                     sa2_smem, sb_smem, M, N, stride_sa, stride_sb, DUAL, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    ring_done(ready, empty, STAGES)


def consumer_regs(dual: bool) -> int:
    """The worker consumer's registers: DUAL's two accumulators, the product and the 32 column scales a
    thread applies need ~245 during dW3's promotion; at 232 the sm_90 compile spilled 112 bytes. 240 leaves
    the default consumer 240 (65536 / 128 threads - 240 - the producer's `STAGING_PRODUCER_REGS`)."""
    return 240 if dual else CONSUMER_REGS


SMEM_LIMIT = 232448  # bytes of shared memory a program may have on sm_90
SMEM_SPARE = 8192  # the barriers, the scales' stages and the compiler's scratch beside the ring and the outputs


def fp8_wgrad_ws(a: BlockScaled, a2: BlockScaled | None, b: BlockScaled, plan: RoutingPlan, outs: list[torch.Tensor],
                 stages: int = 4, tma_store: bool | None = None) -> None:
    """`wgrad._launch_fp8`'s work from the persistent warp-specialised kernel: outs[0][e] = sum over e's token
    tiles of A B^T (dequantized), outs[-1] likewise with A2 when given (the same items: B's tile read once
    for both). a, a2: token tiles [M, P]; b: [N, P]; outs: [E, M, N] each, every element written.
    `tma_store` (None: `TMA_STORE`): the tiles leave through shared memory and TMA (`_store_tile_tma`) where
    the outputs allow it (M and N multiples of 128, contiguous) and shared memory holds the buffers beside
    the ring, else by the consumers' own stores."""
    M, N, E = a.data.shape[0], b.data.shape[0], plan.layout.num_experts
    assert plan.layout.block_m == SCALE_BLOCK and a.scale.stride(1) == b.scale.stride(1) == 1
    dual = a2 is not None
    assert not dual or a2.scale.stride() == a.scale.stride(), "A and A2 share their scales' layout"
    tiles_m, tiles_n = cdiv(M, 2 * HALF_M.value), cdiv(N, 128)
    items = E * tiles_m * tiles_n
    a_desc = _descriptor(a.data, HALF_M.value)
    a2_desc = _descriptor(a2.data, HALF_M.value) if dual else a_desc
    ring_bytes = stages * 128 * 128 * (3 if dual else 2)  # e4m3 A halves (A2's) and B per stage
    out_bytes = 2 * HALF_M.value * 128 * outs[0].element_size()
    tma_store = (TMA_STORE if tma_store is None else tma_store) and M % 128 == 0 and N % 128 == 0 \
        and tma_ok(*outs) and ring_bytes + out_bytes + SMEM_SPARE <= SMEM_LIMIT
    c_descs = [_descriptor(c, HALF_M.value, _GL_DTYPES[c.dtype]) if tma_store else None for c in (outs[0], outs[-1])]
    launch_ws(_fp8_wgrad_ws_kernel, items, a.data.device, stages, a_desc, a2_desc, _descriptor(b.data, 128), a.scale,
              (a2 if dual else a).scale, b.scale, plan.experts_by_load, plan.expert_first_tile, plan.offsets_E1,
              outs[0], outs[-1], *c_descs, items, tiles_m, tiles_n, M, N, a.scale.stride(0), b.scale.stride(0),
              DUAL=dual, TMA_STORE=tma_store, consumer_regs=consumer_regs(dual), producer_regs=STAGING_PRODUCER_REGS)
