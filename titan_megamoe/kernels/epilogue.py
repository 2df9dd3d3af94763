"""Epilogues: what the GEMMs do with an accumulator tile before (or instead of) storing it.

All math in fp32; stores round to the output's dtype (round-to-nearest-even, `cast_rne`).
"""

import triton
import triton.language as tl

from .common import cast_rne, e4m3_scale, to_e4m3


@triton.jit
def swiglu(g, u):
    """h = silu(g) * u."""
    return g * tl.sigmoid(g) * u


@triton.jit
def store_sorted(ptr, val, rows, row_ok, offs_n, n_ok, width, INTERPRET: tl.constexpr):
    """Store a [BLOCK_M, BLOCK_N] tile at expert-sorted rows of a [N, width] matrix."""
    off = rows.to(tl.int64)[:, None] * width + offs_n[None, :]
    tl.store(ptr + off, cast_rne(val, ptr.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def scatter_routed(ptr, val, order_ptr, rows, row_ok, offs_n, n_ok, width, INTERPRET: tl.constexpr):
    """Store a tile of sorted rows p at rows order(p) of a [N, width] matrix (routed-row order), so a
    per-token combine reads each token's K rows contiguously."""
    dest = tl.load(order_ptr + rows, mask=row_ok, other=0)
    store_sorted(ptr, val, dest, row_ok, offs_n, n_ok, width, INTERPRET)


@triton.jit
def _dswiglu_values(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s):
    """(dg, du, s*h, this block's share of ds = <q, h>) in fp32 for one [BLOCK_M, BLOCK_N] block of q."""
    n_ok = offs_n < H
    tile_off = rows.to(tl.int64)[:, None] * H + offs_n[None, :]
    tile_ok = row_ok[:, None] & n_ok[None, :]
    g = tl.load(g_ptr + tile_off, mask=tile_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + tile_off, mask=tile_ok, other=0.0).to(tl.float32)
    return dswiglu_math(q, g, u, s)


@triton.jit
def dswiglu_math(q, g, u, s):
    """`_dswiglu_values` on loaded tiles (fp32; zeros where a row is masked): the one expression every
    dSwiGLU kernel evaluates, so their outputs agree bit for bit."""
    sig = tl.sigmoid(g)
    silu = g * sig
    h = silu * u
    dh = q * s[:, None]
    dg = dh * u * (sig + silu * (1.0 - sig))
    return dg, dh * silu, h * s[:, None], tl.sum(q * h, axis=1)


@triton.jit
def dswiglu(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET: tl.constexpr):
    """Backward through the score and SwiGLU for one [BLOCK_M, BLOCK_N] block of q = dout W2_e (the
    gradient of h before the score s): writes dg, du and s*h (dW2's right operand) at sorted rows and
    returns this block's share of ds = <q, h>. h = silu(g) * u is recomputed from the saved g, u."""
    # s*h is dW2's right operand (dW2_e = sum_p dout_t^T s_p h_p): written here, where h is already in
    # registers, so the weight-gradient GEMM needs no per-row scaling in its main loop
    dg, du, hs, ds_part = _dswiglu_values(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s)
    n_ok = offs_n < H
    store_sorted(hs_ptr, hs, rows, row_ok, offs_n, n_ok, H, INTERPRET)
    store_sorted(du_ptr, du, rows, row_ok, offs_n, n_ok, H, INTERPRET)
    store_sorted(dg_ptr, dg, rows, row_ok, offs_n, n_ok, H, INTERPRET)
    return ds_part


@triton.jit
def store_token_tile(data_ptr, scale_ptr, val, tile, offs_n, n_ok, P, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize a [BLOCK_M = 128, BLOCK_N] tile of one plan tile's rows into the weight gradients'
    token-tile layout (`quant.quantize_token_tiles`): data [C, P] e4m3 at columns 128*tile + row, one
    scale per column of the tile, at [c, tile] of a [C, P / 128] scale. Rows past the expert's end must
    hold zeros (they are padding of the layout)."""
    scale, inv = e4m3_scale(tl.max(tl.abs(val), axis=0))
    data = tl.trans(to_e4m3(val, inv[None, :], INTERPRET))  # [BLOCK_N, BLOCK_M]: stores along tokens
    cols = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(data_ptr + offs_n.to(tl.int64)[:, None] * P + cols[None, :], data, mask=n_ok[:, None])
    tl.store(scale_ptr + offs_n.to(tl.int64) * (P // BLOCK_M) + tile, scale, mask=n_ok)


@triton.jit
def dswiglu_values_bf16(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s, INTERPRET: tl.constexpr):
    """`_dswiglu_values` with dg, du and s*h rounded to bf16 (still in fp32): what the bf16 path stores,
    and what block FP8 quantizes (as the emulation does)."""
    dg, du, hs, ds_part = _dswiglu_values(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s)
    return _round_bf16(dg, du, hs, ds_part, INTERPRET)


@triton.jit
def dswiglu_math_bf16(q, g, u, s, INTERPRET: tl.constexpr):
    """`dswiglu_math` with `dswiglu_values_bf16`'s rounding, on loaded tiles."""
    dg, du, hs, ds_part = dswiglu_math(q, g, u, s)
    return _round_bf16(dg, du, hs, ds_part, INTERPRET)


@triton.jit
def bf16_value(x, INTERPRET: tl.constexpr):
    """x rounded to bf16 and widened back to fp32: the value of dg, du or s*h that block FP8 quantizes."""
    return cast_rne(x, tl.bfloat16, INTERPRET).to(tl.float32)


@triton.jit
def _round_bf16(dg, du, hs, ds_part, INTERPRET: tl.constexpr):
    return bf16_value(dg, INTERPRET), bf16_value(du, INTERPRET), bf16_value(hs, INTERPRET), ds_part


@triton.jit
def _store_row_block(data_ptr, scale_ptr, scale, inv, v0, rows, row_ok, offs_n0, H, block, INTERPRET: tl.constexpr,
                     v1=None, offs_n1=None):
    store_sorted(data_ptr, to_e4m3(v0, inv[:, None], INTERPRET), rows, row_ok, offs_n0, offs_n0 < H, H, INTERPRET)
    if v1 is not None:
        store_sorted(data_ptr, to_e4m3(v1, inv[:, None], INTERPRET), rows, row_ok, offs_n1, offs_n1 < H, H, INTERPRET)
    tl.store(scale_ptr + rows.to(tl.int64) * (H // 128) + block, scale, mask=row_ok)


@triton.jit
def store_rows_fp8(data_ptr, scale_ptr, v, rows, row_ok, offs_n, H, block, INTERPRET: tl.constexpr):
    """Quantize one 128-wide block of rows, v [BLOCK_M, 128] (1x128 scales, [N, H/128])."""
    scale, inv = e4m3_scale(tl.max(tl.abs(v), axis=1))
    _store_row_block(data_ptr, scale_ptr, scale, inv, v, rows, row_ok, offs_n, H, block, INTERPRET)


@triton.jit
def store_row_halves_fp8(data_ptr, scale_ptr, v0, v1, rows, row_ok, offs_n0, offs_n1, H, block,
                         INTERPRET: tl.constexpr):
    """`store_rows_fp8` of a block held as two column halves [BLOCK_M, 64]."""
    scale, inv = e4m3_scale(tl.maximum(tl.max(tl.abs(v0), axis=1), tl.max(tl.abs(v1), axis=1)))
    _store_row_block(data_ptr, scale_ptr, scale, inv, v0, rows, row_ok, offs_n0, H, block, INTERPRET, v1, offs_n1)
