"""The block-FP8 weight quantizer in Gluon: W and W^T in e4m3 from one read of each 128x128 block, the
transposed copy stored through an explicit layout change (an experiment beside `quantize`'s Triton
kernel, launched only where `quantize._WEIGHT_GLUON` asks for it; GPU only).

Why: the Triton kernel (`quantize._quantize_weight_pair_kernel`) runs at ~1.7 TB/s of the ~4 TB/s the
H200's copies reach (462 us for Qwen3-30B-A3B's w1, 3 such weights in every `fp8` forward). Its sm_90
compile shows why: Triton moves the *input* tile (bf16, 32 KB) through shared memory into the
transposed layout and quantizes it a second time there (64 e4m3 conversions per thread for 64
elements), and fp32 weights take two passes (a Triton 3.6 miscompile when one program stores both
copies from an fp32 tile). Here the program quantizes each element once, in the layout it was loaded
in (16-byte loads along the row), stores W from there, and moves the 1-byte e4m3 tile (16 KB) into a
layout where each thread holds 16 consecutive rows of one column: 16-byte stores along W^T's rows.

The numerics are `quant.quantize_weight`'s, bit for bit (`common.e4m3_scale`, `common.to_e4m3`):
`EXACT_CAST` rounds in fp32 first, as the Triton kernel does to avoid the miscompile; without it the
hardware's saturating round-to-nearest-even cast does the rounding (fewer instructions; the GPU
benchmark checks both bitwise before timing either).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .common import E4M3_MAX, e4m3_scale, to_e4m3
from .launch import launch

BLOCK = 128  # the weight scale block, both dimensions (host code)


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
    w = gl.load(w_ptr + expert * stride_e + rows[:, None] * stride_r + cols[None, :] * stride_c).to(gl.float32)
    scale, inv = e4m3_scale(gl.max(gl.max(gl.abs(w), axis=1), axis=0))
    if EXACT_CAST:
        q = to_e4m3(w, inv, False)
    else:
        q = gl.minimum(gl.maximum(w * inv, -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)
    base = expert * R * C  # both copies hold R * C elements per expert
    n_row_blocks = R // 128
    n_col_blocks = C // 128
    blocks = expert * n_row_blocks * n_col_blocks
    if WRITE_W:
        gl.store(data_ptr + base + rows[:, None] * C + cols[None, :], q)
        gl.store(scale_ptr + blocks + row_block * n_col_blocks + col_block, scale)
    q_t = gl.convert_layout(q, st_t)  # 1-byte elements through shared memory, not the input tile
    rows_t = row_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, st_t))
    cols_t = col_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, st_t))
    gl.store(data_t_ptr + base + cols_t[None, :] * R + rows_t[:, None], q_t)
    gl.store(scale_t_ptr + blocks + col_block * n_row_blocks + row_block, scale)


def weight_pair(w_ERC: torch.Tensor, data, scale, data_t, scale_t, write_w: bool, num_warps: int,
                exact_cast: bool) -> None:
    """Fill data_t/scale_t (and data/scale when `write_w`) from w [E, R, C] (R, C multiples of 128; the
    caller checks and allocates, as `quantize._quantize_weight` does)."""
    E, R, C = w_ERC.shape
    launch(_weight_pair_kernel, (C // BLOCK, R // BLOCK, E), w_ERC, data, scale, data_t, scale_t, R, C,
           w_ERC.stride(0), w_ERC.stride(1), w_ERC.stride(2), WRITE_W=write_w, EXACT_CAST=exact_cast,
           num_warps=num_warps)
