"""The plan's source rows copied into expert-sorted order, read once each.

`RoutingPlan.sorted_source_rows` (one `index_select`, the oracle of this kernel) gathers: sorted position
p reads token order[p] // K, so every token row is read K times, from rows scattered over the source (at
Qwen3-30B-A3B T=16384 the 512 MiB copy took 0.26 ms on the H200, profile of cd09d8f). Here each program
reads a block of source rows once and writes each to its K sorted positions (`inv_N[t*K + k]`): one read
of the source and one write of the copy. Weight gradients that read an operand through TMA
(`TileConfig.sorted_copy`) and dgrad's gathered-first split take their copy here.

`padded_sorted_rows`: the same copy with every expert's rows padded by zero rows to whole blocks, for the
resident (persistent) bf16 weight gradients, whose reduction steps must never read another expert's rows
from both operands at once (their loop has no per-step mask; see `wgrad._expert_wgrad_persistent_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import RoutingPlan
from .common import new_output, row_copy_blocks
from .launch import launch
from .schedule import first_token_block


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
    N, D = plan.num_rows, rows_RD.shape[1]
    out = new_output((N, D), rows_RD.dtype, rows_RD.device)
    if N == 0 or D == 0:
        return out
    _launch_copy(_sorted_rows_kernel, rows_RD, plan, out, 0)
    return out


def _launch_copy(kernel, rows_RD: torch.Tensor, plan: RoutingPlan, out: torch.Tensor, more_programs: int, *args,
                 **meta):
    """A copy kernel's launch: a program per block of source rows and of columns (`row_copy_blocks`), plus
    `more_programs` along the rows; arguments (source, inv_N, out, source rows, columns, source row stride,
    *args)."""
    if rows_RD.stride(1) != 1:
        rows_RD = rows_RD.contiguous()
    num_src, D = plan.num_rows // plan.rows_per_token, rows_RD.shape[1]
    block_t, block_d = row_copy_blocks(D)
    launch(
        kernel, (triton.cdiv(num_src, block_t) + more_programs, triton.cdiv(D, block_d)),
        rows_RD, plan.inv_N, out, num_src, D, rows_RD.stride(0), *args, K=plan.rows_per_token, BLOCK_T=block_t,
        BLOCK_D=block_d, num_warps=8, **meta,
    )


@triton.jit
def _padded_sorted_rows_kernel(
    src_ptr, inv_ptr, out_ptr, num_src, D, stride_src, offsets_ptr, num_experts,
    K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Programs [0, cdiv(num_src, BLOCK_T)) copy source rows as `_sorted_rows_kernel` does, to row
    BLOCK + p + (the padding of the experts before p's); the next num_experts programs write expert e's padding
    rows, the last one the leading zero block."""
    pid = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    lo = tl.load(offsets_ptr + e, mask=e_ok, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=e_ok, other=0)
    pad = (hi - lo + BLOCK - 1) // BLOCK * BLOCK - (hi - lo)  # each expert's zero rows (0 for e >= num_experts)
    n_copy = tl.cdiv(num_src, BLOCK_T)
    if pid < n_copy:
        src = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        src_ok = src < num_src
        mask = src_ok[:, None] & d_ok[None, :]
        rows = tl.load(src_ptr + src.to(tl.int64)[:, None] * stride_src + offs_d[None, :], mask=mask)
        for k in tl.static_range(K):
            pos = tl.load(inv_ptr + src * K + k, mask=src_ok, other=0)
            # the experts that end at or before p are exactly the experts before p's (empty ones add no pad)
            shift = tl.sum(tl.where(hi[None, :] <= pos[:, None], pad[None, :], 0), axis=1)
            dst = (BLOCK + pos + shift).to(tl.int64)
            tl.store(out_ptr + dst[:, None] * D + offs_d[None, :], rows, mask=mask)
    else:
        expert = pid - n_copy  # num_experts: the leading zero block, the rows an empty expert's step reads
        mine = e == expert
        count = tl.sum(tl.where(mine, hi - lo, 0), axis=0)
        start = tl.where(expert < num_experts,
                         BLOCK + BLOCK * first_token_block(offsets_ptr, expert, BLOCK, BLOCK_E) + count, 0)
        n_zero = tl.where(expert < num_experts, tl.sum(tl.where(mine, pad, 0), axis=0), BLOCK)
        r = tl.arange(0, BLOCK)
        zeros = tl.zeros((BLOCK, BLOCK_D), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + (start + r).to(tl.int64)[:, None] * D + offs_d[None, :], zeros,
                 mask=(r < n_zero)[:, None] & d_ok[None, :])


def padded_rows_bound(plan: RoutingPlan, block: int) -> int:
    """Rows of `padded_sorted_rows(.., block)`: the leading zero block and every expert padded to whole blocks
    (at most block - 1 zero rows each), a bound the host knows without reading the counts."""
    return block + plan.num_rows + plan.layout.num_experts * (block - 1)


def padded_sorted_rows(rows_RD: torch.Tensor, plan: RoutingPlan, block: int) -> torch.Tensor:
    """[padded_rows_bound(plan, block), D]: `block` zero rows, then each expert's rows in sorted order (the
    values of `sorted_rows`) followed by zero rows up to a whole number of blocks; expert e starts at row
    block * (1 + schedule.first_token_block(e)). Rows past the last expert's padding are not written (the
    bound covers any routing; nothing reads them)."""
    E = plan.layout.num_experts
    out = new_output((padded_rows_bound(plan, block), rows_RD.shape[1]), rows_RD.dtype, rows_RD.device)
    if rows_RD.shape[1] == 0:
        return out
    # E + 1 more programs: each expert's zero rows, and the leading zero block
    _launch_copy(_padded_sorted_rows_kernel, rows_RD, plan, out, E + 1, plan.offsets_E1, E, BLOCK=block,
                 BLOCK_E=triton.next_power_of_2(E))
    return out
