"""Routing metadata for the kernels in one launch after the sort: offsets, inverse order, tile schedule.

`titan_megamoe.oracle.routing_plan` builds the same plan with ~30 small torch ops; on the GPU each op costs
host launch time while the GPU sits idle before GEMM1 (measured: the forward's host time, not its
kernels, was the gap to the target). Here the sort stays a torch op and one Triton kernel does the rest:
  programs 0..P-1 (P = cdiv(n_tiles, BLOCK_T), at least 1): each finds offsets[e] = #(sorted ids < e)
              by a vectorised binary search, the per-expert tile counts and their cumulative sum, then
              writes the (expert, first row) of its own BLOCK_T tiles only; program 0 also writes the
              offsets and a flag that is 1 when every id lies in [0, E) (offsets[0] == 0, offsets[E] == N);
  programs P+: order (int64 from the sort) -> int32, and inv[order[p]] = p.
The schedule used to be one program looping over every chunk, and that serial loop was the kernel's
latency (52 us on an H200 at N=131072, E=128, BLOCK_M=128: 18 chunks), on the critical path before
GEMM1. Repeating the cheap search in every schedule program cuts that to one search and one chunk.
P follows from (N, E, BLOCK_M) on the host: no host sync, and the launch stays graph-capturable.
Everything lands in one int32 buffer in `PlanLayout`'s order (the op's routing residual), so the
backward reuses it as views. `titan_megamoe.oracle.routing_plan` is this kernel's oracle in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import PlanLayout, RoutingPlan, RowSource


@triton.jit
def _lower_bound(sorted_ptr, n, n_iter, target):
    """Per lane: the number of sorted values < target (binary search, all lanes in lockstep)."""
    lo = tl.zeros_like(target)
    hi = tl.zeros_like(target) + n
    for _ in range(n_iter):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(sorted_ptr + mid, mask=active, other=0)
        right = active & (v < target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (v >= target), mid, hi)
    return lo


@triton.jit
def _routing_meta_kernel(
    sorted_ptr, order64_ptr, packed_ptr,
    N, E, n_tiles, n_iter, n_tile_progs,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    inv_ptr = packed_ptr + N
    offsets_ptr = packed_ptr + 2 * N
    tile_expert_ptr = offsets_ptr + E + 1
    tile_row_ptr = tile_expert_ptr + n_tiles
    ok_ptr = tile_row_ptr + n_tiles
    if pid < n_tile_progs:
        e = tl.arange(0, BLOCK_E)
        start_E = _lower_bound(sorted_ptr, N, n_iter, e)
        end_E = _lower_bound(sorted_ptr, N, n_iter, e + 1)
        if pid == 0:
            tl.store(offsets_ptr + e, start_E, mask=e <= E)
            first = tl.sum(tl.where(e == 0, start_E, 0))
            last = tl.sum(tl.where(e == E, start_E, 0))
            tl.store(ok_ptr, ((first == 0) & (last == N)).to(tl.int32))
        tiles_E = tl.where(e < E, (end_E - start_E + BLOCK_M - 1) // BLOCK_M, 0)
        tile_end_E = tl.cumsum(tiles_E, 0)
        tile_start_E = tile_end_E - tiles_E
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        # the expert of tile t: how many experts' tile ranges end at or before t
        expert = tl.sum((tile_end_E[None, :] <= t[:, None]).to(tl.int32), axis=1)
        mine = e[None, :] == expert[:, None]
        row = tl.sum(tl.where(mine, start_E[None, :] + (t[:, None] - tile_start_E[None, :]) * BLOCK_M, 0), axis=1)
        valid = expert < E
        tl.store(tile_expert_ptr + t, tl.where(valid, expert, -1), mask=t < n_tiles)
        tl.store(tile_row_ptr + t, tl.where(valid, row, 0), mask=t < n_tiles)
    else:
        p = (pid - n_tile_progs) * BLOCK + tl.arange(0, BLOCK)
        ok = p < N
        routed = tl.load(order64_ptr + p, mask=ok, other=0).to(tl.int32)
        tl.store(packed_ptr + p, routed, mask=ok)
        tl.store(inv_ptr + routed, p, mask=ok)


_BLOCK = 1024
_BLOCK_T = 64


def build_routing_plan(expert_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0) -> RoutingPlan:
    """The plan of rows routed to local experts [first_expert, first_expert + num_experts), with no host
    synchronisation: `expert_ids` is [T, K] (rows gathered from local tokens, K per token) or [N]
    (contiguous rows, one each). Sizes follow from (N, E, block_m)."""
    rows_per_token = expert_ids.shape[1] if expert_ids.dim() == 2 else 1
    ids_N = expert_ids.reshape(-1)
    n = ids_N.numel()
    if first_expert:
        ids_N = ids_N - first_expert
    # stable: within an expert, rows keep token order (the order stock TorchTitan uses). Radix sort
    # passes follow the key width (8 bits each): int64 ids take 8 passes and ~18 launches, int16 keys 2.
    # Out-of-range ids clamp to -1 or E, which the kernel's ids_ok flag still catches.
    if num_experts < 2**15 - 1 and ids_N.dtype != torch.int16:
        ids_N = ids_N.clamp(-1, num_experts).to(torch.int16)
    sorted_N, order_N = torch.sort(ids_N, stable=True)
    source = RowSource.GATHER if expert_ids.dim() == 2 else RowSource.CONTIGUOUS
    layout = PlanLayout(n, num_experts, block_m, rows_per_token, source, first_expert)
    sizes = layout.segment_sizes
    packed = torch.empty(layout.packed_size, dtype=torch.int32, device=ids_N.device)
    # at least one schedule program, even with no tiles: program 0 also writes offsets and ids_ok
    n_tile_progs = max(1, triton.cdiv(sizes[3], _BLOCK_T))
    _routing_meta_kernel[(n_tile_progs + triton.cdiv(n, _BLOCK),)](
        sorted_N, order_N, packed, n, num_experts, sizes[3], max(n, 1).bit_length(), n_tile_progs,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts + 1), BLOCK_T=_BLOCK_T, BLOCK=_BLOCK,
        num_warps=4,
    )
    return RoutingPlan.from_packed(packed, layout)
