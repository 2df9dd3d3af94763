"""Row transport of the symmetric-memory EP exchange: scatter rows into the peers' buffers, raise this
rank's flag in every peer, wait until every peer's flag is up.

Peers' buffers are addressed by their raw addresses in this process (torch symmetric memory maps every
peer's buffer into each rank: NVLink on a multi-GPU host; the CPU stand-in maps shared-memory files),
passed as int64 and cast to pointers inside the kernels.

`scatter_rows` writes each row straight from where it is (with `index`, row i is source row index[i]:
the token rows of x and dout, read by the send order, no gathered copy first) to its own destination rank
and row, every destination in one launch. Two pieces go into the GEMMs instead of launches of their own:
`wait_for_expert_rows` (GEMM1, dgrad: a program waits for its expert's counter of landed rows) and
`store_rows_to_peers` (GEMM2, dx: the epilogue stores each output row into its token's rank).

Ordering: `signal_peers` is launched after the exchange's `scatter_rows` (or the GEMM storing rows back)
on the same stream, so all of this rank's rows are written before any peer can see its flag; the flag
store is a release at system scope and `wait_for_peers` reads with acquire at system scope, so a rank
that sees a peer's flag also sees that peer's rows. A flag holds the number of the exchange (an epoch
every rank advances in the same order) and is never reset: from the previous exchange it still reads one
less than the epoch waited for. No rank can be a whole exchange ahead (every route's exchanges start with
a barrier), so `< epoch` means "not yet".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast_rne, cdiv, next_power_of_2, row_copy_blocks
from .launch import launch


@triton.jit
def _scatter_rows_kernel(src_ptr, index_ptr, dst_rank_ptr, dst_row_ptr, row_addrs_ptr, dst_expert_ptr,
                         counter_addrs_ptr, n_valid_ptr, n, C, stride_src,
                         HAS_INDEX: tl.constexpr, COUNT: tl.constexpr, VALID_ON_DEVICE: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    if VALID_ON_DEVICE:  # a buffer sized from a bound: the rows past the count on the device are padding
        row_ok = row_ok & (rows < tl.load(n_valid_ptr))
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = row_ok[:, None] & (cols < C)[None, :]
    if HAS_INDEX:
        src_rows = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src_rows = rows.to(tl.int64)
    vals = tl.load(src_ptr + src_rows[:, None] * stride_src + cols[None, :], mask=mask)
    rank = tl.load(dst_rank_ptr + rows, mask=row_ok, other=0)
    dst_row = tl.load(dst_row_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    base = tl.load(row_addrs_ptr + rank, mask=row_ok, other=0).to(tl.pointer_type(src_ptr.dtype.element_ty))
    tl.store(base[:, None] + dst_row[:, None] * C + cols[None, :], vals, mask=mask)
    if COUNT:
        # one count per row and column block, after every thread of the program has stored its part
        # (the barrier), released at system scope: a reader that acquires the count sees the row
        tl.debug_barrier()
        expert = tl.load(dst_expert_ptr + rows, mask=row_ok, other=0)
        counters = tl.load(counter_addrs_ptr + rank, mask=row_ok, other=0).to(tl.pointer_type(tl.int32))
        tl.atomic_add(counters + expert, 1, mask=row_ok, sem="release", scope="sys")


@triton.jit
def store_rows_to_peers(base_ptr, val, rows, row_ok, offs_n, n_ok, dst_offset_ptr, INTERPRET: tl.constexpr):
    """A GEMM epilogue's stores under expert parallelism: the tile's sorted row p goes to base +
    dst_offset[p] elements, i.e. its row in its token's rank's buffer (`PeerRows`), rounded to nearest
    even as `epilogue.store_sorted` rounds. GEMM2 sends the y rows and dx's GEMM the dx rows back this
    way: no [rows, D] output, no copy launch. One base pointer plus per-row offsets by sorted row: in the
    sm_90 compile of GEMM2's 128x256 tile (TMA, warp-specialised) that spills 536 bytes a thread, against
    904 with the offsets indexed by routed row (one more gather) and 1336 with a pointer cast per row
    from each rank's address (routed rows too); the plain local store spills 72."""
    off = tl.load(dst_offset_ptr + rows, mask=row_ok, other=0)
    tl.store(base_ptr + off[:, None] + offs_n[None, :], cast_rne(val, base_ptr.dtype.element_ty, INTERPRET),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def wait_for_expert_rows(arrived_ptr, expected_ptr, expert, INTERPRET: tl.constexpr):
    """A GEMM program's wait, under expert parallelism with symmetric memory, until its expert's rows
    have landed from the peers (`scatter_rows` with counts): the programs of experts whose rows are in
    start while the rest are on their way. The peers' writes come from other GPUs (and this rank's own
    from a launch before this one), so a waiting program holds up nothing that it waits for, whatever
    the grid. Counts wrap around 2**32: compared by their int32 difference; acquire at system scope, so
    the rows counted are visible once the count is: to this thread's ordinary loads, and, after the
    proxy fence, to the TMA loads (the async proxy) that some GEMMs read the rows with (dgrad's GEMM on
    the split configs). Not compiled: the interpreter has no PTX."""
    want = tl.load(expected_ptr + expert)
    seen = tl.atomic_add(arrived_ptr + expert, 0, sem="acquire", scope="sys")
    while want - seen > 0:
        seen = tl.atomic_add(arrived_ptr + expert, 0, sem="acquire", scope="sys")
    if not INTERPRET:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _signal_kernel(flag_addrs_ptr, me, epoch, world, BLOCK: tl.constexpr):
    peers = tl.arange(0, BLOCK)
    ok = peers < world
    flags = tl.load(flag_addrs_ptr + peers, mask=ok, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(flags + me, epoch, mask=ok, sem="release", scope="sys")


@triton.jit
def _wait_kernel(flags_ptr, epoch, world):
    # one scalar spin per peer: Triton 3.6 fails to compile (RemoveLayoutConversions) a spin loop that
    # carries a tensor of all the peers' flags; a flag once up stays up, so waiting in turn is the same
    for peer in range(world):
        seen = tl.atomic_add(flags_ptr + peer, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(flags_ptr + peer, 0, sem="acquire", scope="sys")


def column_blocks(C: int) -> int:
    """How many programs share one row of C elements in `scatter_rows` (each counts the row once)."""
    return cdiv(C, row_copy_blocks(C)[1])


def scatter_rows(rows: torch.Tensor, dst_rank: torch.Tensor, dst_row: torch.Tensor, row_addresses: torch.Tensor,
                 index: torch.Tensor | None = None, counts=None, num_valid: torch.Tensor | None = None) -> None:
    """Row i (rows[index[i]] with `index`, else rows[i]; rows 2-D [*, C]) to row dst_row[i] of rank
    dst_rank[i]'s row area, whose address in this process is row_addresses[dst_rank[i]] (int64 on the
    device; a peer's mapped buffer or this rank's own). One launch for every destination.

    counts = (counter_addresses, dst_expert): after writing its part of row i, each program adds 1 to
    int32 counter dst_expert[i] of rank dst_rank[i] (at counter_addresses[rank]), so a counter reaches
    rows x `column_blocks(C)` once all of an expert's rows have landed.

    num_valid (int32 [1] on the device): only rows i < num_valid are sent, the rest are padding (received
    rows in a buffer sized from a bound, sent back)."""
    n = dst_rank.numel()
    C = rows.shape[1]
    if n == 0 or C == 0:
        return
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    block_r, block_c = row_copy_blocks(C)
    counter_addresses, dst_expert = counts if counts is not None else (row_addresses, dst_rank)
    launch(
        _scatter_rows_kernel, (cdiv(n, block_r), cdiv(C, block_c)),
        rows, index if index is not None else dst_rank, dst_rank, dst_row, row_addresses, dst_expert,
        counter_addresses, num_valid if num_valid is not None else dst_rank, n, C, rows.stride(0),
        HAS_INDEX=index is not None, COUNT=counts is not None, VALID_ON_DEVICE=num_valid is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )


def signal_peers(flag_addresses: torch.Tensor, me: int, epoch: int) -> None:
    """Set flag `me` to `epoch` in every rank's flag array (flag_addresses: int64 [world], on the device)."""
    world = flag_addresses.numel()
    launch(_signal_kernel, (1,), flag_addresses, me, epoch, world, BLOCK=next_power_of_2(world))


def wait_for_peers(flags: torch.Tensor, epoch: int) -> None:
    """Return (on the stream) once every entry of this rank's flags (int32 [world]) has reached `epoch`."""
    launch(_wait_kernel, (1,), flags, epoch, flags.numel())
