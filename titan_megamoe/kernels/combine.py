"""Deterministic per-token combine: out_t = sum_k s_tk * y_{t*K+k}, summed in fp32 in a fixed order.

Rows arrive in routed-row order (GEMM2 and the dx GEMM scatter there), so each token's K rows are
contiguous. This is the local combine stage; an expert-parallel dispatcher brings the rows back first. No atomics: the forward is bitwise reproducible. Used with scores for the forward output
and without (s = 1) for dx.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, cast_rne, cdiv, new_output, next_power_of_2
from .launch import launch


@triton.jit
def _combine_kernel(
    y_ptr, scores_ptr, out_ptr, D,
    TOP_K: tl.constexpr, HAS_SCORES: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        y = tl.load(y_ptr + (t * TOP_K + k) * D + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_SCORES:
            y = y * tl.load(scores_ptr + t * TOP_K + k)
        acc += y
    tl.store(out_ptr + t * D + offs, cast_rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


def combine(y_ND: torch.Tensor, scores_TK: torch.Tensor | None, top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    N, D = y_ND.shape
    T = N // top_k
    out = new_output((T, D), out_dtype, y_ND.device)
    if T == 0:
        return out
    block_d = min(1024, next_power_of_2(D))
    scores = scores_TK if scores_TK is not None else y_ND
    launch(_combine_kernel, (T, cdiv(D, block_d)), y_ND, scores, out, D, TOP_K=top_k,
           HAS_SCORES=scores_TK is not None, BLOCK_D=block_d, INTERPRET=INTERPRET, num_warps=4)
    return out
