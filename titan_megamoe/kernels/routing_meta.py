"""The routing plan in two launches, without a sort: a counting sort by expert, stable in row order.

`titan_megamoe.oracle.routing_plan` builds the same plan with ~30 small torch ops; on the GPU each op costs
host launch time while the GPU sits idle before GEMM1. The previous version sorted with `torch.sort` (after
a clamp and an int16 cast) and ran one Triton kernel for the rest: 167 us of host time on the H200's host
at T=512, against 15-20 us for a Triton launch (docs/kernels.md, host overhead). Now:
  launch 1, one program per chunk of CH rows (`_chunk_rows`): the chunk's histogram over experts (bins 0..E-1; bin E
      counts ids outside [first_expert, first_expert + E), bin E+1 the lanes past N);
  launch 2, programs 0..C-1 (one per chunk): every expert's total and the count in earlier chunks (the
      histograms, summed), so the first sorted position of each (expert, chunk); the chunk sorted in
      registers by (expert, row) (`tl.sort`), and each row's position is that first position plus its
      place in the sorted chunk: order[pos] = row, inv[row] = pos. Rows of an expert keep row order
      (the order stock TorchTitan uses), so the plan is the oracle's, bit for bit.
      Programs C..C+P-1 (P = cdiv(n_tiles, BLOCK_T), at least 1): the tile schedule, each its own
      BLOCK_T tiles (the expert of tile t: how many experts' tile ranges end at or before t); program C
      also writes the offsets and a flag that is 1 when every id was a local expert.
The weight-gradient kernels' per-expert tables (`RoutingPlan.experts_by_load`, `.expert_first_tile`) come
from the offsets in one more launch in the backward (`expert_schedule`; ~10 torch ops before, an argsort
among them: ~125 us of host time per backward on the H100 at 30B-A3B T=512).
Everything lands in one int32 buffer in `PlanLayout`'s order (the op's routing residual), so the backward
reuses it as views. Sizes follow from (N, E, BLOCK_M) on the host: no host sync, graph-capturable.
`titan_megamoe.oracle.routing_plan` is this kernel's oracle in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import PlanLayout, RoutingPlan, RowSource
from .common import INTERPRET, cdiv, new_output, next_power_of_2
from .launch import launch


@triton.jit
def _valid_rows(n, n_valid_ptr, VALID_ON_DEVICE: tl.constexpr):
    """The rows that hold routed rows: all n, or (VALID_ON_DEVICE) the first *n_valid_ptr of a buffer
    sized from a bound, the rest padding."""
    if VALID_ON_DEVICE:
        return tl.load(n_valid_ptr)
    else:
        return n


@triton.jit
def _expert_bins(ids_ptr, chunk, n_valid, first_expert, E, CH: tl.constexpr):
    """The bins of one chunk's rows: a row's local expert, E for an id of no local expert, E+1 past the
    valid rows (past N, or padding)."""
    rows = chunk * CH + tl.arange(0, CH)
    ok = rows < n_valid
    local = tl.load(ids_ptr + rows, mask=ok, other=0) - first_expert
    bins = tl.where((local >= 0) & (local < E), local, E).to(tl.int32)
    return tl.where(ok, bins, E + 1)


@triton.jit
def _chunk_histogram_kernel(ids_ptr, n_valid_ptr, hist_ptr, n, first_expert, E, CH: tl.constexpr,
                            BLOCK_E: tl.constexpr, VALID_ON_DEVICE: tl.constexpr):
    chunk = tl.program_id(0)
    bins = _expert_bins(ids_ptr, chunk, _valid_rows(n, n_valid_ptr, VALID_ON_DEVICE), first_expert, E, CH)
    tl.store(hist_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(bins, BLOCK_E))


@triton.jit
def _place_rows_kernel(
    ids_ptr, n_valid_ptr, hist_ptr, base_ptr, packed_ptr,
    n, first_expert, E, n_chunks, n_tiles,
    BLOCK_M: tl.constexpr, CH: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
    VALID_ON_DEVICE: tl.constexpr,
):
    pid = tl.program_id(0)
    n_valid = _valid_rows(n, n_valid_ptr, VALID_ON_DEVICE)
    inv_ptr = packed_ptr + n
    offsets_ptr = packed_ptr + 2 * n
    tile_expert_ptr = offsets_ptr + E + 1
    tile_row_ptr = tile_expert_ptr + n_tiles
    ok_ptr = tile_row_ptr + n_tiles
    e = tl.arange(0, BLOCK_E)
    # every expert's rows, and (for a chunk program) those in the chunks before this one
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, n_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        h = tl.load(hist_ptr + chunks[:, None] * BLOCK_E + e[None, :], mask=(chunks < n_chunks)[:, None], other=0)
        total += tl.sum(h, axis=0)
        before += tl.sum(tl.where((chunks < pid)[:, None], h, 0), axis=0)
    count = tl.where(e < E, total, 0)
    start_E = tl.cumsum(count, 0) - count  # offsets[e]: the first sorted row of expert e
    if pid < n_chunks:
        bins = _expert_bins(ids_ptr, pid, n_valid, first_expert, E, CH)
        lane = tl.arange(0, CH)
        # sorted by (expert, lane): an expert's rows of this chunk in row order, experts in order
        key = tl.sort(bins * CH + lane)
        sorted_bin = key // CH
        mine = tl.load(hist_ptr + pid * BLOCK_E + e)
        # sorted lane j of expert b goes to start_E[b] + before[b] + (j - first lane of b in the chunk)
        tl.store(base_ptr + pid * BLOCK_E + e, start_E + before - (tl.cumsum(mine, 0) - mine))
        tl.debug_barrier()  # the stores above, visible to the whole program before the gather below
        placed = sorted_bin < E
        pos = tl.load(base_ptr + pid * BLOCK_E + sorted_bin, mask=placed, other=0, cache_modifier=".cg") + lane
        row = pid * CH + key % CH
        tl.store(packed_ptr + pos, row, mask=placed)
        tl.store(inv_ptr + row, pos, mask=placed)
        if VALID_ON_DEVICE:
            # padding rows keep their place (order, inv: the identity), so a gather by the plan's order
            # stays in bounds; no valid row is placed there (they fill positions < n_valid)
            pad = pid * CH + lane
            pad_ok = (pad >= n_valid) & (pad < n)
            tl.store(packed_ptr + pad, pad, mask=pad_ok)
            tl.store(inv_ptr + pad, pad, mask=pad_ok)
    else:
        tp = pid - n_chunks
        if tp == 0:
            tl.store(offsets_ptr + e, tl.where(e < E, start_E, n_valid), mask=e <= E)
            # every row's id a local expert: bin E is empty (offsets[E] == N then)
            tl.store(ok_ptr, (tl.sum(tl.where(e == E, total, 0)) == 0).to(tl.int32))
        tiles_E = (count + BLOCK_M - 1) // BLOCK_M
        tile_end_E = tl.cumsum(tiles_E, 0)
        tile_start_E = tile_end_E - tiles_E
        t = tp * BLOCK_T + tl.arange(0, BLOCK_T)
        # the expert of tile t: how many experts' tile ranges end at or before t
        expert = tl.sum((tile_end_E[None, :] <= t[:, None]).to(tl.int32), axis=1)
        hit = e[None, :] == expert[:, None]
        first = tl.sum(tl.where(hit, start_E[None, :] + (t[:, None] - tile_start_E[None, :]) * BLOCK_M, 0), axis=1)
        valid = expert < E
        tl.store(tile_expert_ptr + t, tl.where(valid, expert, -1), mask=t < n_tiles)
        tl.store(tile_row_ptr + t, tl.where(valid, first, 0), mask=t < n_tiles)


_BLOCK_T = 64


def _chunk_rows(n: int) -> int:
    """Rows per chunk: up to ~128 chunks (each chunk program sums every chunk's histogram), 256 to 4096
    rows (one `tl.sort` in registers). The interpreter sorts element by element in Python, so there
    chunks of 16-128 rows keep the CPU tests fast (a plan of 6 rows: 0.03 s against 0.2 s)."""
    if INTERPRET:
        return min(128, max(16, next_power_of_2(n)))
    return min(4096, max(256, next_power_of_2(cdiv(n, 128))))


def build_routing_plan(expert_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0,
                       num_valid: torch.Tensor | None = None) -> RoutingPlan:
    """The plan of rows routed to local experts [first_expert, first_expert + num_experts), with no host
    synchronisation: `expert_ids` is [T, K] (rows gathered from local tokens, K per token) or [N]
    (contiguous rows, one each), any integer dtype. Sizes follow from (N, E, block_m).

    num_valid (int32 [1] on the device; contiguous rows only): only the first num_valid rows are routed
    rows, the rest padding of a buffer sized from a bound the host knows (EP with a capacity): the plan
    is that of the valid rows (offsets[E] == num_valid, the tiles past theirs -1), and padding rows map
    to themselves in order and inv."""
    assert num_valid is None or expert_ids.dim() == 1, "num_valid applies to contiguous rows"
    rows_per_token = expert_ids.shape[1] if expert_ids.dim() == 2 else 1
    ids_N = expert_ids.reshape(-1)
    n = ids_N.numel()
    source = RowSource.GATHER if expert_ids.dim() == 2 else RowSource.CONTIGUOUS
    layout = PlanLayout(n, num_experts, block_m, rows_per_token, source, first_expert)
    n_tiles = layout.segment_sizes[3]
    ch = _chunk_rows(n)
    n_chunks = cdiv(n, ch)
    block_e = next_power_of_2(num_experts + 2)
    packed = torch.empty(layout.packed_size, dtype=torch.int32, device=ids_N.device)
    scratch = torch.empty(2 * n_chunks * block_e, dtype=torch.int32, device=ids_N.device)  # histograms, bases
    hist, base = scratch[: n_chunks * block_e], scratch[n_chunks * block_e:]
    warps = 8 if ch >= 2048 else 4
    valid = num_valid if num_valid is not None else packed  # unused without VALID_ON_DEVICE
    if n_chunks:
        launch(_chunk_histogram_kernel, (n_chunks,), ids_N, valid, hist, n, first_expert, num_experts, CH=ch,
               BLOCK_E=block_e, VALID_ON_DEVICE=num_valid is not None, num_warps=warps)
    # at least one schedule program, even with no tiles: the first also writes offsets and ids_ok
    n_tile_progs = max(1, cdiv(n_tiles, _BLOCK_T))
    launch(_place_rows_kernel, (n_chunks + n_tile_progs,), ids_N, valid, hist, base, packed, n, first_expert,
           num_experts, n_chunks, n_tiles, BLOCK_M=block_m, CH=ch, BLOCK_E=block_e, BLOCK_C=max(1, 8192 // block_e),
           BLOCK_T=_BLOCK_T, VALID_ON_DEVICE=num_valid is not None, num_warps=warps)
    return RoutingPlan.from_packed(packed, layout)


@triton.jit
def _expert_schedule_kernel(offsets_ptr, by_load_ptr, first_tile_ptr, E, BLOCK_M: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    rows = tl.load(offsets_ptr + e + 1, mask=ok, other=0) - tl.load(offsets_ptr + e, mask=ok, other=0)
    tiles = (rows + BLOCK_M - 1) // BLOCK_M
    tl.store(first_tile_ptr + e, tl.cumsum(tiles, 0) - tiles, mask=ok)
    # each expert's place when sorted by rows, most first, ties in expert order (a stable descending sort):
    # the experts with more rows, plus those before it with as many
    rank = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for j0 in range(0, E, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < E
        rows_j = tl.load(offsets_ptr + j + 1, mask=j_ok, other=0) - tl.load(offsets_ptr + j, mask=j_ok, other=0)
        ahead = (rows_j[None, :] > rows[:, None]) | ((rows_j[None, :] == rows[:, None]) & (j[None, :] < e[:, None]))
        rank += tl.sum((ahead & j_ok[None, :]).to(tl.int32), axis=1)
    tl.store(by_load_ptr + rank, e, mask=ok)


def expert_schedule(offsets_E1: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local experts most rows first (stable), each expert's first M-tile of `block_m` rows), int32 [E]
    each, from a plan's offsets, in one launch (`oracle.expert_schedule_reference` in torch ops)."""
    E = offsets_E1.numel() - 1
    out = new_output((2 * E,), torch.int32, offsets_E1.device)
    if E > 0:
        block_e = next_power_of_2(E)
        launch(_expert_schedule_kernel, (1,), offsets_E1, out, out[E:], E, BLOCK_M=block_m, BLOCK_E=block_e,
               BLOCK_J=max(1, min(block_e, 8192 // block_e)), num_warps=4)
    return out[:E], out[E:]
