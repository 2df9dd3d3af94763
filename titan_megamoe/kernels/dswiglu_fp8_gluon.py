"""Block-FP8 dgrad's elementwise half in Gluon, as one kernel: the dSwiGLU of one plan tile by 128 columns,
dg and du quantized along the rows (dx's operands), dg, du and s*h along the tokens (the weight gradients'
token tiles), and ds's share: the GPU default in place of `dgrad_swiglu`'s Triton kernels
(`dgrad_swiglu._FP8_DSWIGLU_GLUON`; Triton's interpreter runs those). On an H100 (2026-12-05) 1.06x the
Triton pair and 1.28x the Triton single kernel at 30B-A3B T=16384, bitwise the same outputs. Its persistent form
(`_dswiglu_fp8_persistent_kernel`, the default since 2026-12-06: 983 against 1037 us at 8 warps on an H100) keeps
one program per multiprocessor and brings the next item's q, g, u in through TMA while this one is computed.

Why: the Triton kernels move 1.1-1.6 GB at 30B-A3B T=16384 in 1.06 ms (the rows + token-tiles pair,
~1.7 TB/s; the single Triton kernel spills and takes 1.31 ms): each token-tile store transposes its tile,
and Triton rematerialises the computation feeding a transposed store in the transposed layout (the sm_90
compile of the weight quantizer shows the same: every element cast twice). Here the dSwiGLU is computed
once per element, in the layout q, g and u are loaded in (16-byte loads along the rows); the row blocks are
quantized and stored from there, and each token tile's e4m3 bytes change layout through shared memory
(`quantize_gluon.store_token_tile_e4m3`).

The values are `dgrad_swiglu`'s: the same jitted dSwiGLU (`epilogue.dswiglu_values_bf16`: dg, du, s*h
rounded to bf16 before the quantization, as the emulation does) and the same scales and casts
(`common.e4m3_scale`, `to_e4m3` with `EXACT_CAST`). The GPU benchmark checks the outputs bitwise against
the Triton kernels' before timing.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .common import multiprocessors, tma_ok
from .epilogue import dswiglu_math_bf16, dswiglu_values_bf16
from .fp8_rows_gluon import _cta_barrier, _descriptor, _tma_load
from .launch import launch
from .quantize_gluon import store_rows_e4m3, store_token_tile_e4m3


@gluon.jit
def _item(tile, pid_n, expert, tile_row_ptr, offsets_ptr, order_ptr, scores_ptr, ld: gl.constexpr):
    """A work item's sorted rows (those past the expert's end masked: zeros, the token tile's padding), its 128
    columns, the rows' routed positions and scores."""
    rows = gl.load(tile_row_ptr + tile) + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    row_ok = rows < gl.load(offsets_ptr + expert + 1)
    offs_n = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    routed = gl.load(order_ptr + rows, mask=row_ok, other=0)
    return rows, row_ok, offs_n, routed, gl.load(scores_ptr + routed, mask=row_ok, other=0.0)


@gluon.jit
def _store_item(dg, du, hs, ds_part, tile, pid_n, rows, row_ok, offs_n, routed, dg_ptr, dg_s_ptr, du_ptr, du_s_ptr,
                dgt_ptr, dgt_s_ptr, dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr, ds_part_ptr, H, P, EXACT_CAST: gl.constexpr,
                num_warps: gl.constexpr):
    """A work item's outputs: s*h, dg, du as token tiles, dg and du as 1x128 rows, ds's share."""
    n_ok = offs_n < H
    store_token_tile_e4m3(hst_ptr, hst_s_ptr, hs, tile, pid_n * 128, H, P, EXACT_CAST, num_warps)
    store_token_tile_e4m3(dgt_ptr, dgt_s_ptr, dg, tile, pid_n * 128, H, P, EXACT_CAST, num_warps)
    store_rows_e4m3(dg_ptr, dg_s_ptr, dg, rows, row_ok, offs_n, n_ok, H, pid_n, EXACT_CAST)
    store_token_tile_e4m3(dut_ptr, dut_s_ptr, du, tile, pid_n * 128, H, P, EXACT_CAST, num_warps)
    store_rows_e4m3(du_ptr, du_s_ptr, du, rows, row_ok, offs_n, n_ok, H, pid_n, EXACT_CAST)
    gl.store(ds_part_ptr + routed.to(gl.int64) * (H // 128) + pid_n, ds_part, mask=row_ok)


@gluon.jit
def _dswiglu_fp8_kernel(q_ptr, g_ptr, u_ptr, scores_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                        dg_ptr, dg_s_ptr, du_ptr, du_s_ptr, dgt_ptr, dgt_s_ptr, dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr,
                        ds_part_ptr, H, P, EXACT_CAST: gl.constexpr, num_warps: gl.constexpr):
    # q, g, u [N, H] bf16 sorted rows; scores [N] fp32 row order; dg, du e4m3 [N, H] + scales [N, H/128];
    # dgt, dut, hst token tiles e4m3 [H, P] + scales [H, P/128]; ds_part [N, H/128] fp32 row order
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    num_n = H // 128
    tile = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    expert = gl.load(tile_expert_ptr + tile)
    if expert < 0:  # past the real count: the weight gradients never read this tile
        return
    rows, row_ok, offs_n, routed, s = _item(tile, pid_n, expert, tile_row_ptr, offsets_ptr, order_ptr, scores_ptr, ld)
    q = gl.load(q_ptr + rows.to(gl.int64)[:, None] * H + offs_n[None, :], mask=row_ok[:, None], other=0.0)
    dg, du, hs, ds_part = dswiglu_values_bf16(q.to(gl.float32), rows, row_ok, offs_n, H, g_ptr, u_ptr, s, False)
    _store_item(dg, du, hs, ds_part, tile, pid_n, rows, row_ok, offs_n, routed, dg_ptr, dg_s_ptr, du_ptr, du_s_ptr,
                dgt_ptr, dgt_s_ptr, dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr, ds_part_ptr, H, P, EXACT_CAST, num_warps)


@gluon.jit
def _real_items(tile_expert_ptr, num_tiles, num_n, num_warps: gl.constexpr):
    """The work items of the real tiles (`schedule.real_tile_count` * num_n): the tiles with an expert are a
    prefix of the plan's schedule, counted on the device so that no program walks the spare tail."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    count = 0
    for start in range(0, num_tiles, 4096):
        offs = start + gl.arange(0, 4096, layout=layout)
        count += gl.sum((gl.load(tile_expert_ptr + offs, mask=offs < num_tiles, other=-1) >= 0).to(gl.int32), axis=0)
    return count * num_n


@gluon.jit
def _load_item(item, row0, stage, num_n, q_desc, g_desc, u_desc, q_smem, g_smem, u_smem, ready):
    """TMA of work item `item`'s q, g, u blocks (its plan tile's 128 rows from the tile's first row `row0`, 128
    columns) into `stage`. Rows past the expert's end come in too (the next expert's, or TMA's zeros past N):
    the consumer masks them."""
    col0 = (item % num_n) * 128
    bar = ready.index(stage)
    mbarrier.expect(bar, 3 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [row0, col0], bar, q_smem.index(stage))
    _tma_load(g_desc, [row0, col0], bar, g_smem.index(stage))
    _tma_load(u_desc, [row0, col0], bar, u_smem.index(stage))


@gluon.jit
def _item_row0(item, items, num_n, tile_row_ptr):
    """The first row of work item `item`'s plan tile, the item clamped into range."""
    return gl.load(tile_row_ptr + gl.maximum(gl.minimum(item, items - 1), 0) // num_n)


@gluon.jit
def _staged(smem, stage, row_ok, ld: gl.constexpr):
    """An item's q, g or u block from its stage in fp32, rows past the expert's end zero."""
    return gl.where(row_ok[:, None], smem.index(stage).load(ld).to(gl.float32), 0.0)


@gluon.jit
def _dswiglu_fp8_persistent_kernel(q_desc, g_desc, u_desc, scores_ptr, order_ptr, tile_expert_ptr, tile_row_ptr,
                                   offsets_ptr, dg_ptr, dg_s_ptr, du_ptr, du_s_ptr, dgt_ptr, dgt_s_ptr, dut_ptr,
                                   dut_s_ptr, hst_ptr, hst_s_ptr, ds_part_ptr, H, P, num_tiles,
                                   EXACT_CAST: gl.constexpr, num_warps: gl.constexpr):
    # `_dswiglu_fp8_kernel`'s work (one item = one plan tile by 128 columns, the same outputs from the same
    # expressions), one program per multiprocessor walking items pid, pid + G, ...: q, g, u of the next item
    # come in through TMA (two stages in shared memory) while this item is computed and stored, where the
    # one-item programs (16 warps, 128 registers: one per multiprocessor) waited for their loads with every
    # warp idle
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    num_n = H // 128
    items = _real_items(tile_expert_ptr, num_tiles, num_n, num_warps)
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, 128, 128], q_desc.layout)
    g_smem = gl.allocate_shared_memory(g_desc.dtype, [2, 128, 128], g_desc.layout)
    u_smem = gl.allocate_shared_memory(u_desc.dtype, [2, 128, 128], u_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(2):
        mbarrier.init(ready.index(st), count=1)
    fence_async_shared()
    row0 = _item_row0(pid, items, num_n, tile_row_ptr)
    if pid < items:
        _load_item(pid, row0, 0, num_n, q_desc, g_desc, u_desc, q_smem, g_smem, u_smem, ready)
    for i in range(gl.cdiv(items - pid, G)):
        item = pid + i * G
        stage = i % 2
        # every warp has read the other stage (item i - 1) into registers before the TMA refills it
        _cta_barrier()
        tile = item // num_n
        pid_n = item % num_n
        if item + G < items:
            row0_next = _item_row0(item + G, items, num_n, tile_row_ptr)
            _load_item(item + G, row0_next, 1 - stage, num_n, q_desc, g_desc, u_desc, q_smem, g_smem, u_smem, ready)
        expert = gl.load(tile_expert_ptr + tile)
        rows, row_ok, offs_n, routed, s = _item(tile, pid_n, expert, tile_row_ptr, offsets_ptr, order_ptr, scores_ptr,
                                                ld)
        mbarrier.wait(ready.index(stage), (i // 2) & 1)
        q = _staged(q_smem, stage, row_ok, ld)
        g = _staged(g_smem, stage, row_ok, ld)
        u = _staged(u_smem, stage, row_ok, ld)
        dg, du, hs, ds_part = dswiglu_math_bf16(q, g, u, s, False)
        _store_item(dg, du, hs, ds_part, tile, pid_n, rows, row_ok, offs_n, routed, dg_ptr, dg_s_ptr, du_ptr,
                    du_s_ptr, dgt_ptr, dgt_s_ptr, dut_ptr, dut_s_ptr, hst_ptr, hst_s_ptr, ds_part_ptr, H, P,
                    EXACT_CAST, num_warps)
    for st in gl.static_range(2):
        mbarrier.invalidate(ready.index(st))


def dswiglu_fp8(q_NH, g_NH, u_NH, scores_N, plan, row_args, tile_args, ds_part, num_warps: int,
                exact_cast: bool, persistent: bool = False) -> None:
    """Fill `dgrad_swiglu._dswiglu_fp8`'s outputs (allocated there): row_args (dg, dg_scale, du, du_scale),
    tile_args (dgT, its scale, duT, its scale, hsT, its scale; [H, P], P = plan.layout.num_tiles * 128),
    ds_part [N, H / 128]. `persistent`: `_dswiglu_fp8_persistent_kernel` (q, g, u through TMA, one program per
    multiprocessor) where TMA can read them (contiguous bf16 rows), else the one-item kernel."""
    H = g_NH.shape[1]
    num_tiles = plan.layout.num_tiles
    if persistent and all(t.dtype == torch.bfloat16 for t in (q_NH, g_NH, u_NH)) and tma_ok(q_NH, g_NH, u_NH):
        q, g, u = (_descriptor(t, 128, gl.bfloat16) for t in (q_NH, g_NH, u_NH))  # [128, 128] bf16 tiles
        launch(_dswiglu_fp8_persistent_kernel, (min(multiprocessors(q_NH.device), num_tiles * (H // 128)),),
               q, g, u, scores_N, plan.order_N, plan.tile_expert,
               plan.tile_row, plan.offsets_E1, *row_args, *tile_args, ds_part, H, num_tiles * 128, num_tiles,
               EXACT_CAST=exact_cast, num_warps=num_warps)
        return
    launch(_dswiglu_fp8_kernel, (num_tiles * (H // 128),), q_NH, g_NH, u_NH, scores_N, plan.order_N, plan.tile_expert,
           plan.tile_row, plan.offsets_E1, *row_args, *tile_args, ds_part, H, num_tiles * 128, EXACT_CAST=exact_cast,
           num_warps=num_warps)
