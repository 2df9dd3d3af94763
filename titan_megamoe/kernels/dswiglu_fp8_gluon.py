"""Block-FP8 dgrad's elementwise half in Gluon, as one kernel: the dSwiGLU of one plan tile by 128 columns,
dg and du quantized along the rows (dx's operands), dg, du and s*h along the tokens (the weight gradients'
token tiles), and ds's share: the GPU default in place of `dgrad_swiglu`'s Triton kernels
(`dgrad_swiglu._FP8_DSWIGLU_GLUON`; Triton's interpreter runs those). On an H100 (2026-12-05) 1.06x the
Triton pair and 1.28x the Triton single kernel at 30B-A3B T=16384, bitwise the same outputs.

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

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .epilogue import dswiglu_values_bf16
from .launch import launch
from .quantize_gluon import store_rows_e4m3, store_token_tile_e4m3


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
    rows = gl.load(tile_row_ptr + tile) + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    row_ok = rows < gl.load(offsets_ptr + expert + 1)  # rows past the expert's end: zeros (token-tile padding)
    offs_n = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    n_ok = offs_n < H
    routed = gl.load(order_ptr + rows, mask=row_ok, other=0)
    s = gl.load(scores_ptr + routed, mask=row_ok, other=0.0)
    q = gl.load(q_ptr + rows.to(gl.int64)[:, None] * H + offs_n[None, :], mask=row_ok[:, None], other=0.0)
    dg, du, hs, ds_part = dswiglu_values_bf16(q.to(gl.float32), rows, row_ok, offs_n, H, g_ptr, u_ptr, s, False)
    store_token_tile_e4m3(hst_ptr, hst_s_ptr, hs, tile, pid_n * 128, H, P, EXACT_CAST, num_warps)
    store_token_tile_e4m3(dgt_ptr, dgt_s_ptr, dg, tile, pid_n * 128, H, P, EXACT_CAST, num_warps)
    store_rows_e4m3(dg_ptr, dg_s_ptr, dg, rows, row_ok, offs_n, n_ok, H, pid_n, EXACT_CAST)
    store_token_tile_e4m3(dut_ptr, dut_s_ptr, du, tile, pid_n * 128, H, P, EXACT_CAST, num_warps)
    store_rows_e4m3(du_ptr, du_s_ptr, du, rows, row_ok, offs_n, n_ok, H, pid_n, EXACT_CAST)
    gl.store(ds_part_ptr + routed.to(gl.int64) * num_n + pid_n, ds_part, mask=row_ok)


def dswiglu_fp8(q_NH, g_NH, u_NH, scores_N, plan, row_args, tile_args, ds_part, num_warps: int,
                exact_cast: bool) -> None:
    """Fill `dgrad_swiglu._dswiglu_fp8`'s outputs (allocated there): row_args (dg, dg_scale, du, du_scale),
    tile_args (dgT, its scale, duT, its scale, hsT, its scale; [H, P], P = plan.layout.num_tiles * 128),
    ds_part [N, H / 128]."""
    H = g_NH.shape[1]
    num_tiles = plan.layout.num_tiles
    launch(_dswiglu_fp8_kernel, (num_tiles * (H // 128),), q_NH, g_NH, u_NH, scores_N, plan.order_N, plan.tile_expert,
           plan.tile_row, plan.offsets_E1, *row_args, *tile_args, ds_part, H, num_tiles * 128, EXACT_CAST=exact_cast,
           num_warps=num_warps)
