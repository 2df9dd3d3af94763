"""Epilogues: what the GEMMs do with an accumulator tile before (or instead of) storing it.

All math in fp32; stores round to the output's dtype (round-to-nearest-even, `cast_rne`).
"""

import triton
import triton.language as tl

from .common import cast_rne


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
def dswiglu(q, rows, row_ok, offs_n, H, g_ptr, u_ptr, s, dg_ptr, du_ptr, hs_ptr, INTERPRET: tl.constexpr):
    """Backward through the score and SwiGLU for one [BLOCK_M, BLOCK_N] block of q = dout W2_e (the
    gradient of h before the score s): writes dg, du and s*h (dW2's right operand) at sorted rows and
    returns this block's share of ds = <q, h>. h = silu(g) * u is recomputed from the saved g, u."""
    n_ok = offs_n < H
    tile_off = rows.to(tl.int64)[:, None] * H + offs_n[None, :]
    tile_ok = row_ok[:, None] & n_ok[None, :]
    g = tl.load(g_ptr + tile_off, mask=tile_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + tile_off, mask=tile_ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    h = silu * u
    ds_part = tl.sum(q * h, axis=1)
    # s*h is dW2's right operand (dW2_e = sum_p dout_t^T s_p h_p): written here, where h is already in
    # registers, so the weight-gradient GEMM needs no per-row scaling in its main loop
    tl.store(hs_ptr + tile_off, cast_rne(h * s[:, None], hs_ptr.dtype.element_ty, INTERPRET), mask=tile_ok)
    dh = q * s[:, None]
    tl.store(du_ptr + tile_off, cast_rne(dh * silu, du_ptr.dtype.element_ty, INTERPRET), mask=tile_ok)
    dg = dh * u * (sig + silu * (1.0 - sig))
    tl.store(dg_ptr + tile_off, cast_rne(dg, dg_ptr.dtype.element_ty, INTERPRET), mask=tile_ok)
    return ds_part
