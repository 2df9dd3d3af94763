"""Block-FP8 quantizers in Gluon, the GPU defaults in place of `quantize`'s Triton kernels (Triton's
interpreter cannot run Gluon: there the Triton kernels run; both are held to quant.py bit for bit):
- `weight_pair`: W and W^T from one read of each 128x128 block, fp32 weights in one pass too
  (`quantize._WEIGHT_GLUON`; on an H100 1.71x the Triton kernel for bf16 weights, 1.65x for fp32);
- `token_tiles`: the token tiles (`quantize._TOKEN_TILE_GLUON`; 1.36x);
- `store_token_tile_e4m3` (the token tiles and `dswiglu_fp8_gluon`) and `store_rows_e4m3` (`dswiglu_fp8_gluon`): shared stores.

Why: the Triton kernels run at ~1.7 TB/s. The sm_90 compile of the weight kernel shows Triton moving the
input tile through shared memory into the transposed layout and quantizing it there again, and fp32
weights take two passes (a Triton 3.6 miscompile when one program stores both copies from an fp32 tile).
Here the layouts are explicit: 16-byte loads along the rows, the quantization in that layout, the row copy
stored from it, and the transposed copy stored from a layout in which each thread holds 16 consecutive
rows of one column (16-byte stores along its rows). The token tiles move their e4m3 bytes into that
layout (1 byte an element); the weight's W^T moves the input tile and quantizes it again, because moving
the e4m3 tile that was also stored as W wrote wrong bytes on the H100 (docs/kernels.md, "More Gluon").

The scales and casts are quant.py's (`common.e4m3_scale`, `common.to_e4m3`): `EXACT_CAST` rounds in fp32
first, as the Triton kernels do to avoid the miscompile; without it the hardware's saturating
round-to-nearest-even cast does the rounding (fewer instructions). The GPU benchmark
(`bench_row_kernels.py --sections weight_quant token_tiles`) checks each launch bitwise before timing it.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .common import cdiv, e4m3_scale, to_e4m3
from .launch import launch

BLOCK = 128  # the weight scale block, both dimensions (host code)


@gluon.jit
def e4m3_cast(x, inv_scale, EXACT_CAST: gl.constexpr):
    """x * inv_scale in e4m3, saturating: rounded in fp32 first (`common.to_e4m3`) or by the hardware cast.

    The hardware cast (`cvt.rn.satfinite`) needs no clamp before it: the block scale keeps every finite
    |x * inv_scale| <= 448, and the cast saturates anything beyond to +-448 itself (two instructions an
    element fewer; a NaN stays NaN, as in quant.py, where the clamp turned it into -448)."""
    if EXACT_CAST:
        return to_e4m3(x, inv_scale, False)
    return (x * inv_scale).to(gl.float8e4nv)


@gluon.jit
def store_rows_e4m3(data_ptr, scale_ptr, x, rows, row_ok, cols, col_ok, C, col_block, EXACT_CAST: gl.constexpr):
    """x [rows, 128 columns] (fp32, any layout) quantized along each row, one 1x128 block: data [N, C] e4m3
    at `rows`, scale [N, C / 128] at column `col_block`."""
    row_scale, row_inv = e4m3_scale(gl.max(gl.abs(x), axis=1))
    gl.store(data_ptr + rows.to(gl.int64)[:, None] * C + cols[None, :], e4m3_cast(x, row_inv[:, None], EXACT_CAST),
             mask=row_ok[:, None] & col_ok[None, :])
    gl.store(scale_ptr + rows.to(gl.int64) * (C // 128) + col_block, row_scale, mask=row_ok)


@gluon.jit
def store_token_tile_e4m3(data_ptr, scale_ptr, x, tile, col0, C, P, EXACT_CAST: gl.constexpr,
                          num_warps: gl.constexpr):
    """x [128 rows of plan tile `tile`, 128 columns from col0] (fp32; rows past the expert's end zero)
    quantized along each column, one block over the tile's rows, into the token-tile layout
    (`quant.quantize_token_tiles`): data [C, P] e4m3 at columns 128 * tile + row, scale [C, P / 128] at
    [c, tile]. The e4m3 tile (1 byte an element) changes layout through shared memory so that each thread
    stores 16 consecutive rows of one column: 16 bytes along a row of data."""
    st_t: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, num_warps], [0, 1])
    scale, inv = e4m3_scale(gl.max(gl.abs(x), axis=0))
    q_t = gl.convert_layout(e4m3_cast(x, inv[None, :], EXACT_CAST), st_t)
    i_t = gl.arange(0, 128, layout=gl.SliceLayout(1, st_t))
    cols_t = (col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, st_t))).to(gl.int64)
    gl.store(data_ptr + cols_t[None, :] * P + tile * 128 + i_t[:, None], q_t, mask=(cols_t < C)[None, :])
    cols = (col0 + gl.arange(0, 128, layout=scale.type.layout)).to(gl.int64)
    gl.store(scale_ptr + cols * (P // 128) + tile, scale, mask=cols < C)


@gluon.jit
def _weight_pair_kernel(w_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, R, C, stride_e, stride_r, stride_c,
                        WRITE_W: gl.constexpr, EXACT_CAST: gl.constexpr, num_warps: gl.constexpr):
    # w [E, R, C] (strided); data [E, R, C], scale [E, R/128, C/128]; data_t [E, C, R], scale_t [E, C/128, R/128]
    # load: 8 consecutive columns per thread (16 B of bf16), a warp covers 2 rows x 128 columns
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    # transposed store: 16 consecutive rows of one column per thread (16 B of e4m3 along a row of W^T)
    st_t: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, num_warps], [0, 1])
    col_block = gl.program_id(0)
    row_block = gl.program_id(1)
    expert = gl.program_id(2).to(gl.int64)
    rows = row_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    cols = col_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    w_in = gl.load(w_ptr + expert * stride_e + rows[:, None] * stride_r + cols[None, :] * stride_c)
    w = w_in.to(gl.float32)
    scale, inv = e4m3_scale(gl.max(gl.max(gl.abs(w), axis=1), axis=0))
    q = e4m3_cast(w, inv, EXACT_CAST)
    base = expert * R * C  # both copies hold R * C elements per expert
    n_row_blocks = R // 128
    n_col_blocks = C // 128
    blocks = expert * n_row_blocks * n_col_blocks
    if WRITE_W:
        gl.store(data_ptr + base + rows[:, None] * C + cols[None, :], q)
        gl.store(scale_ptr + blocks + row_block * n_col_blocks + col_block, scale)
    # W^T from the *input* tile moved into the store layout and quantized again there (same scale, same
    # values). Moving the e4m3 tile instead (1 byte an element, as the token-tile kernel does) wrote wrong W^T
    # bytes on the H100 whenever the program also stored that tile as W, as fp8 or as uint8 bytes alike
    # (docs/kernels.md, "More Gluon")
    q_t = e4m3_cast(gl.convert_layout(w_in, st_t).to(gl.float32), inv, EXACT_CAST)
    rows_t = row_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, st_t))
    cols_t = col_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, st_t))
    gl.store(data_t_ptr + base + cols_t[None, :] * R + rows_t[:, None], q_t)
    gl.store(scale_t_ptr + blocks + col_block * n_row_blocks + row_block, scale)


@gluon.jit
def _token_tiles_kernel(src_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, data_ptr, scale_ptr, C,
                        num_tiles, rows_per_token, stride_r, stride_c, GATHER: gl.constexpr, EXACT_CAST: gl.constexpr,
                        num_warps: gl.constexpr):
    # one plan tile (128 sorted rows of one expert) x 128 columns: data [C, num_tiles * 128] e4m3 and scale
    # [C, num_tiles], one block per column over the tile's rows, stored transposed
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    tile = gl.program_id(0)
    col_block = gl.program_id(1)
    expert = gl.load(tile_expert_ptr + tile)
    row0 = gl.load(tile_row_ptr + tile)
    # a spare tile (expert -1, first row 0) ends at 0: it has no rows and is written as zeros
    end = gl.where(expert >= 0, gl.load(offsets_ptr + gl.maximum(expert, 0) + 1), 0)
    rows = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    row_ok = rows < end
    if GATHER:
        src = gl.load(order_ptr + rows, mask=row_ok, other=0) // rows_per_token
    else:
        src = rows
    cols = col_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    col_ok = cols < C
    x = gl.load(src_ptr + src.to(gl.int64)[:, None] * stride_r + cols[None, :] * stride_c,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(gl.float32)
    store_token_tile_e4m3(data_ptr, scale_ptr, x, tile, col_block * 128, C, num_tiles * 128, EXACT_CAST, num_warps)


def weight_pair(w_ERC: torch.Tensor, data, scale, data_t, scale_t, write_w: bool, num_warps: int,
                exact_cast: bool) -> None:
    """Fill data_t/scale_t (and data/scale when `write_w`) from w [E, R, C] (R, C multiples of 128; the
    caller checks and allocates, as `quantize._quantize_weight` does)."""
    E, R, C = w_ERC.shape
    launch(_weight_pair_kernel, (C // BLOCK, R // BLOCK, E), w_ERC, data, scale, data_t, scale_t, R, C,
           w_ERC.stride(0), w_ERC.stride(1), w_ERC.stride(2), WRITE_W=write_w, EXACT_CAST=exact_cast,
           num_warps=num_warps)


def token_tiles(src_RC: torch.Tensor, plan, K: int, gather: bool, data, scale, num_warps: int,
                exact_cast: bool) -> None:
    """`quantize._token_tiles`' kernel in Gluon: fill the token tiles `data` [C, P] and `scale` [C, P / 128] from
    src_RC's rows in the plan's order (gathered through plan.order_N // K, or src_RC's own rows when not
    `gather`)."""
    C = src_RC.shape[1]
    launch(_token_tiles_kernel, (plan.layout.num_tiles, cdiv(C, BLOCK)), src_RC, plan.order_N,
           plan.tile_expert, plan.tile_row, plan.offsets_E1, data, scale, C, plan.layout.num_tiles, K,
           src_RC.stride(0), src_RC.stride(1), GATHER=gather, EXACT_CAST=exact_cast, num_warps=num_warps)
