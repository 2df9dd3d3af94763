"""Tile schedules: which piece of work a program does.

Row-tiled kernels (GEMM1, GEMM2, dgrad, dx) walk the routing plan's M-tile list: each tile is
BLOCK_M expert-sorted rows of one expert. The weight-gradient kernels tile each expert's output matrix
and reduce over that expert's rows.
"""

import triton.language as tl
import triton


@triton.jit
def row_tile(pid, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M: tl.constexpr,
             SUB_TILES: tl.constexpr = 1, GROUP_M: tl.constexpr = 1, num_pids=None):
    """The work of program `pid` in a row-tiled kernel: (expert, N-tile, first sorted row, sorted rows,
    row mask).

    A program covers BLOCK_M rows: a whole plan tile (SUB_TILES = 1) or one of its SUB_TILES equal
    parts (plan block_m = SUB_TILES * BLOCK_M). Smaller programs let several share a multiprocessor,
    which is how block FP8 hides each K block's scaling (a program's MMA waits for it) behind another
    program's MMAs. GROUP_M = 1: N-tiles vary fastest, so consecutive programs reuse the same rows from
    L2, and every row tile streams its expert's whole weight. That weight outgrows L2 at large experts
    (W1 and W3 of a Mixtral-like expert: 235 MB against the H200's 50 MB), so GROUP_M > 1 walks groups of
    GROUP_M row programs down each N column before moving right: a weight tile is read once per group,
    the group's rows stay in L2. Programs compute the same tiles in either order (bitwise the same).
    expert < 0 marks nothing to do: a tile past the real count (the grid is sized at the host-known
    bound) or a part past its expert's last row; the caller returns at once (a persistent caller runs a
    part masked instead: its rows are all out of range). `num_pids`: how many
    program ids there are (a persistent kernel's tile count; default the grid's size).
    """
    if GROUP_M == 1:
        pid_m = pid // num_n
        pid_n = pid % num_n
    else:
        if num_pids is None:
            num_pids = tl.num_programs(0)
        num_m = num_pids // num_n
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_size
        pid_n = (pid % width) // group_size
    tile = pid_m // SUB_TILES
    expert = tl.load(tile_expert_ptr + tile)
    row_start = tl.load(tile_row_ptr + tile) + (pid_m % SUB_TILES) * BLOCK_M
    row_end = tl.load(offsets_ptr + tl.maximum(expert, 0) + 1)
    if SUB_TILES > 1:
        expert = tl.where(row_start < row_end, expert, -1)
    rows = row_start + tl.arange(0, BLOCK_M)
    return expert, pid_n, row_start, rows, rows < row_end


@triton.jit
def real_tile_count(tile_expert_ptr, num_tiles, CHUNK: tl.constexpr = 1024):
    """How many of the plan's `num_tiles` (its host-known bound) tiles are real: the tiles with an
    expert (>= 0) are a prefix of the schedule. A persistent kernel counts them on the device (a few
    1024-wide loads) so its programs never walk the empty tail."""
    count = 0
    for start in range(0, num_tiles, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        count += tl.sum((tl.load(tile_expert_ptr + offs, mask=offs < num_tiles, other=-1) >= 0).to(tl.int32))
    return count


@triton.jit
def expert_output_tile(pid, M, N, expert_slot_ptr, offsets_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The work of program `pid` in a weight-gradient kernel: (expert, first and last sorted row of the
    expert, output rows, output columns).

    Programs enumerate (expert slot, m-tile, n-tile) with n fastest, so neighbours share A rows. Slots
    map to experts heaviest first (`expert_slot_ptr`, an on-device argsort of the counts): the long
    reductions start first and short ones fill in behind them.
    """
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_mn = tl.cdiv(M, BLOCK_M) * tiles_n
    slot = pid // tiles_mn
    rem = pid % tiles_mn
    pid_m = rem // tiles_n
    pid_n = rem % tiles_n
    expert = tl.load(expert_slot_ptr + slot)
    lo = tl.load(offsets_ptr + expert)
    hi = tl.load(offsets_ptr + expert + 1)
    offs_m = tl.max_contiguous(tl.multiple_of(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), BLOCK_M), BLOCK_M)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    return expert, lo, hi, pid_m, pid_n, offs_m, offs_n
