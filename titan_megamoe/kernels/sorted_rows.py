"""The plan's source rows copied into expert-sorted order, read once each.

`RoutingPlan.sorted_source_rows` (one `index_select`, the oracle of this kernel) gathers: sorted position
p reads token order[p] // K, so every token row is read K times, from rows scattered over the source (at
Qwen3-30B-A3B T=16384 the 512 MiB copy took 0.26 ms on the H200, profile of cd09d8f). Here each program
reads a block of source rows once and writes each to its K sorted positions (`inv_N[t*K + k]`): one read
of the source and one write of the copy. Weight gradients that read an operand through TMA
(`TileConfig.sorted_copy`) and dgrad's gathered-first split take their copy here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import RoutingPlan
from .common import cdiv, new_output, row_copy_blocks
from .launch import launch


@triton.jit
def _sorted_rows_kernel(
    src_ptr, inv_ptr, out_ptr, num_src, D, stride_src,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    src = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    src_ok = src < num_src
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = src_ok[:, None] & (offs_d < D)[None, :]
    rows = tl.load(src_ptr + src.to(tl.int64)[:, None] * stride_src + offs_d[None, :], mask=mask)
    for k in tl.static_range(K):
        pos = tl.load(inv_ptr + src * K + k, mask=src_ok, other=0)
        tl.store(out_ptr + pos.to(tl.int64)[:, None] * D + offs_d[None, :], rows, mask=mask)


def sorted_rows(rows_RD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """[N, D] copy of the plan's source rows in sorted order: position p holds source row order[p] // K
    (the same values as `plan.sorted_source_rows(rows_RD)`)."""
    N, K = plan.num_rows, plan.rows_per_token
    D = rows_RD.shape[1]
    out = new_output((N, D), rows_RD.dtype, rows_RD.device)
    if N == 0 or D == 0:
        return out
    if rows_RD.stride(1) != 1:
        rows_RD = rows_RD.contiguous()
    num_src = N // K
    block_t, block_d = row_copy_blocks(D)
    launch(
        _sorted_rows_kernel, (cdiv(num_src, block_t), cdiv(D, block_d)),
        rows_RD, plan.inv_N, out, num_src, D, rows_RD.stride(0), K=K, BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=8,
    )
    return out
