"""Routing metadata for the kernels in two launches, no torch sort: order, inverse, offsets, tile schedule.

`titan_megamoe.routing` builds the same metadata with ~30 small torch ops, and an earlier version here
used torch.sort plus one Triton kernel; on the GPU each torch op costs host launch time while the GPU
sits idle before GEMM1 (measured: the forward's host time before GEMM1, not its kernels, was what the
synchronised forward waited for; torch.sort alone is a cast, a clamp and ~6 CUB launches). A stable
counting sort over the small key range (E <= 256 experts) needs no general sort:
  launch 1 (`_bucket_count_kernel`), one program per block of BLOCK_R routed rows: how many rows of the
              block go to each bucket (expert, or bucket E for an id outside [0, E)) -> counts [NB, BLOCK_E];
  launch 2 (`_routing_plan_kernel`):
    programs 0..NB-1: a block's rows go to sorted position  start[bucket] + (rows of that bucket in
              earlier blocks) + (rows of that bucket earlier in this block), the last by a cumulative sum
              over a one-hot [CHUNK, BLOCK_E] tile, chunk by chunk: rows keep token order within an expert
              (stable, as stock TorchTitan's order), writes order[pos] = row and inv[row] = pos;
    programs NB..: the per-M-tile (expert, first row) schedule for BLOCK_T tiles each; the first also
              writes the offsets and a flag that is 1 when every id lies in [0, E).
Rows with an out-of-range id land in bucket E, after every expert's rows: the kernels visit only
[offsets[0], offsets[E]), so a bad id cannot make them read out of bounds, and the flag trips an
asynchronous assert. Every size follows from (N, E, BLOCK_M) on the host: no host sync, and the launches
stay graph-capturable. Everything lands in one int32 buffer (the op's routing residual), so the backward
reuses it as views. The torch version in `titan_megamoe.routing` is these kernels' oracle in the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..routing import max_tiles


class RoutingPlan(NamedTuple):
    order_N: torch.Tensor  # int32 [N]: sorted position -> routed row
    inv_N: torch.Tensor  # int32 [N]: routed row -> sorted position
    offsets_E1: torch.Tensor  # int32 [E+1]
    tile_expert: torch.Tensor  # int32 [n_tiles]: expert of each M-tile, -1 past the real count
    tile_row: torch.Tensor  # int32 [n_tiles]: first sorted row of each M-tile
    ids_ok: torch.Tensor  # int32 [1]: 1 when every expert id was in range


def _segment_sizes(num_rows: int, num_experts: int, block_m: int) -> tuple[int, ...]:
    """Lengths of the RoutingPlan fields in the packed buffer, in order (the kernel writes this layout)."""
    n_tiles = max_tiles(num_rows, num_experts, block_m)
    return (num_rows, num_rows, num_experts + 1, n_tiles, n_tiles, 1)


def packed_size(num_rows: int, num_experts: int, block_m: int) -> int:
    return sum(_segment_sizes(num_rows, num_experts, block_m))


def unpack(packed: torch.Tensor, num_rows: int, num_experts: int, block_m: int) -> RoutingPlan:
    return RoutingPlan(*torch.split(packed, _segment_sizes(num_rows, num_experts, block_m)))


@triton.jit
def _bucket_of(ids_ptr, rows, N, E, BLOCK_E: tl.constexpr):
    """Bucket of each routed row: its expert, E for an id outside [0, E), BLOCK_E (no bucket) past N."""
    ok = rows < N
    ids = tl.load(ids_ptr + rows, mask=ok, other=0)
    bucket = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    return tl.where(ok, bucket, BLOCK_E)


@triton.jit
def _bucket_count_kernel(ids_ptr, counts_ptr, N, E,
                         BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c in tl.static_range(BLOCK_R // CHUNK):
        rows = b * BLOCK_R + c * CHUNK + tl.arange(0, CHUNK)
        bucket = _bucket_of(ids_ptr, rows, N, E, BLOCK_E)
        counts += tl.sum((bucket[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + b * BLOCK_E + e, counts)


@triton.jit
def _bucket_totals(counts_ptr, NB, b, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """(rows per bucket over all blocks, rows per bucket in blocks before b) from counts [NB, BLOCK_E]."""
    e = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c in range(0, NB, BLOCK_B):
        blk = c + tl.arange(0, BLOCK_B)
        cnt = tl.load(counts_ptr + blk[:, None] * BLOCK_E + e[None, :], mask=(blk < NB)[:, None], other=0)
        total += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where((blk < b)[:, None], cnt, 0), axis=0)
    return total, before


@triton.jit
def _routing_plan_kernel(
    ids_ptr, counts_ptr, packed_ptr,
    N, E, n_tiles, NB,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    inv_ptr = packed_ptr + N
    offsets_ptr = packed_ptr + 2 * N
    tile_expert_ptr = offsets_ptr + E + 1
    tile_row_ptr = tile_expert_ptr + n_tiles
    ok_ptr = tile_row_ptr + n_tiles
    e = tl.arange(0, BLOCK_E)
    if pid < NB:
        total, before = _bucket_totals(counts_ptr, NB, pid, BLOCK_E, BLOCK_B)
        # next free sorted position of each bucket for this block's rows, in token order
        nxt = tl.cumsum(total, 0) - total + before
        for c in tl.static_range(BLOCK_R // CHUNK):
            rows = pid * BLOCK_R + c * CHUNK + tl.arange(0, CHUNK)
            bucket = _bucket_of(ids_ptr, rows, N, E, BLOCK_E)
            hot = bucket[:, None] == e[None, :]
            upto = tl.cumsum(hot.to(tl.int32), 0)  # rows of the same bucket up to and including this one
            pos = tl.sum(tl.where(hot, nxt[None, :] + upto - 1, 0), axis=1)
            ok = rows < N
            tl.store(packed_ptr + pos, rows, mask=ok)
            tl.store(inv_ptr + rows, pos, mask=ok)
            nxt += tl.sum(hot.to(tl.int32), axis=0)
    else:
        total, _ = _bucket_totals(counts_ptr, NB, 0, BLOCK_E, BLOCK_B)
        start_E = tl.cumsum(total, 0) - total
        if pid == NB:
            tl.store(offsets_ptr + e, start_E, mask=e <= E)
            tl.store(ok_ptr, (tl.sum(tl.where(e == E, total, 0)) == 0).to(tl.int32))
        tiles_E = tl.where(e < E, (total + BLOCK_M - 1) // BLOCK_M, 0)
        tile_end_E = tl.cumsum(tiles_E, 0)
        tile_start_E = tile_end_E - tiles_E
        t = (pid - NB) * BLOCK_T + tl.arange(0, BLOCK_T)
        # the expert of tile t: how many experts' tile ranges end at or before t
        expert = tl.sum((tile_end_E[None, :] <= t[:, None]).to(tl.int32), axis=1)
        mine = e[None, :] == expert[:, None]
        row = tl.sum(tl.where(mine, start_E[None, :] + (t[:, None] - tile_start_E[None, :]) * BLOCK_M, 0), axis=1)
        valid = expert < E
        tl.store(tile_expert_ptr + t, tl.where(valid, expert, -1), mask=t < n_tiles)
        tl.store(tile_row_ptr + t, tl.where(valid, row, 0), mask=t < n_tiles)


_BLOCK_R = 1024  # routed rows per sort program

def _chunk(block_e: int) -> int:
    """Rows per one-hot tile: [CHUNK, BLOCK_E] int32 is 16K values (64 per thread at 8 warps)."""
    return min(_BLOCK_R, max(16, 16384 // block_e))

_BLOCK_T = 64  # tiles per schedule program
_BLOCK_B = 16  # blocks of counts summed per step


def build_routing_plan(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, RoutingPlan]:
    """(packed int32 buffer, views into it). No host synchronisation; sizes follow from (T, K, E)."""
    ids_N = topk_ids_TK.reshape(-1)
    if not ids_N.is_contiguous():
        ids_N = ids_N.contiguous()
    n = ids_N.numel()
    sizes = _segment_sizes(n, num_experts, block_m)
    device = ids_N.device
    packed = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts + 1)  # + the bucket of out-of-range ids
    nb = triton.cdiv(n, _BLOCK_R)
    counts = torch.empty((max(nb, 1), block_e), dtype=torch.int32, device=device)
    chunk = _chunk(block_e)
    if nb:
        _bucket_count_kernel[(nb,)](ids_N, counts, n, num_experts, BLOCK_R=_BLOCK_R, CHUNK=chunk,
                                    BLOCK_E=block_e, num_warps=8)
    # at least one schedule program, even with no tiles: the first also writes offsets and ids_ok
    n_tile_progs = max(1, triton.cdiv(sizes[3], _BLOCK_T))
    _routing_plan_kernel[(nb + n_tile_progs,)](
        ids_N, counts, packed, n, num_experts, sizes[3], nb,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_T=_BLOCK_T, BLOCK_R=_BLOCK_R, CHUNK=chunk, BLOCK_B=_BLOCK_B,
        num_warps=8,
    )
    return packed, RoutingPlan(*torch.split(packed, sizes))
