"""Expert parallelism, symmetric-memory transport: each rank writes its rows straight into the receiving
rank's buffer, no all-to-all.

One buffer per rank of the EP group, mapped into every peer (torch symmetric memory on CUDA:
`torch.distributed._symmetric_memory.empty` + `rendezvous`, peers' buffers as tensors through
`get_buffer`, NVLink on a multi-GPU host). One set per (process group, device type), shared by every MoE
layer and call. Each buffer: [flags: int32 per rank][counters: int32 per local expert][out region][back
region]. Rows out to the experts' owners (scores, x, dout) land in the out region, rows back to the
tokens' ranks (y, dx, ds) in the back region. An exchange of rows (`exchange_symmetric`):

  1. barrier: every rank is done with the regions' previous rows (copied out or read)
  2. each rank writes every row it sends straight to its destination rank and row, in one Triton launch
     (`kernels.peer_rows.scatter_rows`; x and dout rows are read by the send order where they lie, so
     no gathered copy is made first); destinations follow from the per-expert counts every rank holds
     since `ep_dispatch.route` (`_maps`)
  3. each rank raises its flag in every peer (`signal_peers`: the exchange's epoch, after its writes)
     and waits until every peer's flag in its own buffer is up (`wait_for_peers`), on the device
  4. each rank copies what it received out of its own buffer

Fused into the GEMMs: x and dout go out with per-expert counters (`send_counted`), and GEMM1 and dgrad
wait per expert and read the landing rows in place, overlapping the transfer of the experts still in
flight; y and dx come back from GEMM2's and dx's epilogues (`back_from_gemm`: each output row stored at
its token's rank and send slot), overlapping the GEMM, with no barrier of their own: the back regions are
free once every rank has passed the barrier of the route's exchange out (each rank is done with a region
before its next barrier, in stream order), and the out regions are not written again before the next one.

Out to the experts' owners: the rows land sorted by expert, and within an expert by (source rank, token):
the order the receiving rank's plan gives them under the all-to-all too, so the expert FFN sees the same
rows in the same order and the result is bitwise the same. The receiving plan follows from the counts
alone (`expert_sorted_ids`): no ids travel, and the plan could exist before any row lands. Back to the
tokens' ranks: each row returns to its send slot.
No token is dropped: a region holds the most rows any rank receives in either direction, computed from
the counts matrix, which every rank has, so every rank asks for the same size; when a call needs more the
buffers are reallocated (a collective: every rank takes the same decision at the same exchange out, sized
for the way back too) with headroom, never truncated. Memory per rank: about 2 x 1.25x (max over ranks
of rows received) x the widest row, once per process group, not per layer.

The first barrier is `_SymmetricMemory.barrier` (signal pads). On CPU (gloo, the CI tests) the same
protocol runs on shared-memory files (`/dev/shm`) mapped by every rank, the kernels in Triton's
interpreter, with `dist.barrier` as the barrier: a stand-in for tests, not a transport for training.
torch's CUDA symmetric memory refuses two ranks on one GPU (docs/ep.md), so the CUDA side has run on one
H200 only as one rank (bitwise the single-process op, scripts/symm_mem_one_gpu.py, before the GEMM-fused
return trip and dgrad's wait); no cross-GPU transfer yet.
"""

from __future__ import annotations

import math
import os
import uuid

import torch
import torch.distributed as dist

from ..kernels.grouped_gemm import PeerRows
from ..kernels.peer_rows import column_blocks, scatter_rows, signal_peers, wait_for_peers

# each buffer: [flags: int32 per rank][counters: int32 per local expert][out rows][back rows], the regions
# 16-byte aligned and of equal size (a multiple of _ALIGN)
_FLAGS, _COUNTERS = 4096, 4096  # bytes: up to 1024 ranks, 1024 local experts
_HEADER = _FLAGS + _COUNTERS
_HEADROOM = 1.25  # reallocate with room to spare: routing shifts a little from step to step
_ALIGN = 1 << 20


def _address_tables(buffer_addresses: list[int], region_bytes: int, device):
    """Every rank's buffer address in this process -> (its flags', its counters', its out region's, its
    back region's addresses), int64 on the device: the tables the transport kernels index by rank."""
    flags = torch.tensor(buffer_addresses, dtype=torch.int64, device=device)
    return flags, flags + _FLAGS, flags + _HEADER, flags + _HEADER + region_bytes


def _region_offset(dtype: torch.dtype, offset: int, back: bool, region_bytes: int) -> int:
    """Elements of dtype from the start of the rows to element `offset` of the out or back region."""
    return ((region_bytes if back else 0) + offset * dtype.itemsize) // dtype.itemsize


class _CudaSymmetricBuffers:
    """Torch symmetric memory: this rank's buffer and its peers', mapped (NVLink on a multi-GPU host)."""

    def __init__(self, group, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm, self._group, self._device = symm_mem, group, device
        self.nbytes, self._handle, self._local, self.epoch = 0, None, None, 0

    def allocate(self, nbytes: int) -> None:
        """`nbytes` per region (out and back)."""
        if self._local is not None:
            # the last exchange's copy-out may still be reading the old buffer on the stream, and this
            # allocator need not wait for the stream before freeing: growth is rare, synchronise
            torch.cuda.synchronize(self._device)
            self._handle = self._local = None
        self._local = self._symm.empty(_HEADER + 2 * nbytes, dtype=torch.uint8, device=self._device)
        self._local[:_HEADER].zero_()  # the flags; the exchange's first barrier orders this before any signal
        self._handle = self._symm.rendezvous(self._local, self._group.group_name)
        self.nbytes = nbytes
        world = dist.get_world_size(self._group)
        self.flags = self._local[:4 * world].view(torch.int32)
        self.counters = self._local[_FLAGS:_HEADER].view(torch.int32)
        self.counted = None  # what each counter reads once every exchange so far has landed (on the device)
        self.flag_addresses, self.counter_addresses, self.row_addresses, self.back_addresses = _address_tables(
            [self._handle.get_buffer(r, (1,), torch.uint8, 0).data_ptr() for r in range(world)], nbytes, self._device)

    def view(self, rank: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int, back: bool = False):
        """Rank `rank`'s out (or back) region as `shape` elements of dtype, starting `offset` elements in."""
        return self._handle.get_buffer(rank, shape, dtype,
                                       _HEADER // dtype.itemsize + _region_offset(dtype, offset, back, self.nbytes))

    def barrier(self) -> None:
        self._handle.barrier(channel=0)


class _SharedFileBuffers:
    """CPU stand-in for the tests: one shared-memory file per rank, mapped by every rank of the group."""

    def __init__(self, group, device: torch.device):
        self._group = group
        self._rank, self._world = dist.get_rank(group), dist.get_world_size(group)
        token = [uuid.uuid4().hex if self._rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        self._prefix = f"/dev/shm/titan_megamoe_symm_{token[0]}"
        self.nbytes, self._generation, self._maps, self.epoch = 0, 0, [], 0

    def allocate(self, nbytes: int) -> None:
        """`nbytes` per region (out and back)."""
        self._generation += 1
        path = lambda r: f"{self._prefix}_{self._generation}_{r}"  # noqa: E731
        size = _HEADER + 2 * nbytes
        torch.from_file(path(self._rank), shared=True, size=size, dtype=torch.uint8)  # creates it, zeroed
        dist.barrier(group=self._group)
        self._maps = [torch.from_file(path(r), shared=True, size=size, dtype=torch.uint8)
                      for r in range(self._world)]
        dist.barrier(group=self._group)
        os.unlink(path(self._rank))  # the mappings stay valid; nothing is left in /dev/shm
        self.nbytes = nbytes
        self.flags = self._maps[self._rank][:4 * self._world].view(torch.int32)
        self.counters = self._maps[self._rank][_FLAGS:_HEADER].view(torch.int32)
        self.counted = None
        self.flag_addresses, self.counter_addresses, self.row_addresses, self.back_addresses = _address_tables(
            [m.data_ptr() for m in self._maps], nbytes, "cpu")

    def view(self, rank: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int, back: bool = False):
        flat = self._maps[rank][_HEADER:].view(dtype)
        start = _region_offset(dtype, offset, back, self.nbytes)
        return flat[start:start + math.prod(shape)].view(shape)

    def barrier(self) -> None:
        dist.barrier(group=self._group)


_BUFFERS: dict = {}


def _buffers(group, device: torch.device):
    """The one set of buffers of this process group on this device type (made on first use)."""
    key = (group.group_name, device.type)
    if key not in _BUFFERS:
        _BUFFERS[key] = (_CudaSymmetricBuffers if device.type == "cuda" else _SharedFileBuffers)(group, device)
    return _BUFFERS[key]


def _counts(r) -> tuple[torch.Tensor, int, int, torch.Tensor]:
    """(expert counts [ranks, global experts], this rank, local experts per rank, rows this rank receives
    per local expert), on the device, made once per route."""
    if "counts" not in r.cache:
        C, me, E = r.counts_WG.to(torch.int64), dist.get_rank(r.group), r.num_local_experts
        r.cache["counts"] = (C, me, E, C[:, me * E:(me + 1) * E].sum(0))
    return r.cache["counts"]


def _sizes(r) -> tuple[int, int, int, int]:
    """Host-known row counts: (rows this rank receives, the most any rank receives, rows this rank sends,
    the most any rank sends). Exact from the host counts; with a capacity, the capacity for the first
    two (the rows past a rank's count are padding) and this rank's routed rows for the others (`route`
    checks on the device that every rank routes as many)."""
    if "sizes" not in r.cache:
        if r.capacity is not None:
            n = r.send_order_N.numel()
            r.cache["sizes"] = (r.capacity, r.capacity, n, n)
        else:
            received = [sum(col) for col in zip(*r.counts)]  # per rank: counts[s][q] rows s sends to q
            sent = [sum(row) for row in r.counts]
            me = dist.get_rank(r.group)
            r.cache["sizes"] = (received[me], max(received), sent[me], max(sent))
    return r.cache["sizes"]


def _num_valid(r) -> torch.Tensor | None:
    """With a capacity: int32 [1] on the device, the rows this rank receives (the rest of its `_sizes`
    rows are padding); None with exact sizes."""
    if r.capacity is None:
        return None
    if "valid" not in r.cache:
        r.cache["valid"] = _counts(r)[3].sum().to(torch.int32).view(1)
    return r.cache["valid"]


def expert_sorted_ids(r) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global expert of each row this rank receives (the rows land sorted by expert, `_maps`) and
    `_num_valid` (with a capacity the ids past it are padding: one past this rank's last expert)."""
    _, me, E, per_expert = _counts(r)
    rows = torch.arange(_sizes(r)[0], device=per_expert.device)
    local = torch.searchsorted(per_expert.cumsum(0), rows, right=True)
    return me * E + local, _num_valid(r)


def _maps(r, back: bool):
    """Where each row goes, (destination rank [n] int32, destination row [n] int64, out: the destination's
    local expert [n] int32), on the device, from the counts every rank holds; no host sync.

    Out to the experts' owners, row i of this rank's send order (global expert g, sorted by expert) lands
    at expert g's rows on rank g // E, after the rows of g from lower ranks: each owner's rows end up
    sorted by expert, and within an expert by (source rank, token), the order its plan would give them.
    Back, a received row (expert g, from rank s, the j-th of those) returns to send slot j of g on s
    (with a capacity, the padding rows past the count get some in-range destination and are not sent)."""
    key = "back" if back else "out"
    if key in r.cache:
        return r.cache[key]
    C, me, E, _ = _counts(r)
    W, G = C.shape
    device = C.device
    send_start = C.cumsum(1) - C  # [s, g]: first send slot of expert g on rank s
    if not back:
        totals = C.sum(0)  # rows of each expert, all sources
        start = (totals.view(W, E).cumsum(1) - totals.view(W, E)).reshape(G)  # expert g's first row on its owner
        before = C.cumsum(0) - C  # [s, g]: rows of g from ranks below s
        g = r.send_ids_N.to(torch.int64)
        base = start + before[me] - send_start[me]
        maps = ((g // E).to(torch.int32), base[g] + torch.arange(g.numel(), device=device), (g % E).to(torch.int32))
    else:
        lengths = C[:, me * E:(me + 1) * E].T.reshape(-1)  # received segments (local expert e, source s), e-major
        seg_end = lengths.cumsum(0)
        seg_rank = torch.arange(W, device=device).repeat(E)
        seg_slot = send_start[:, me * E:(me + 1) * E].T.reshape(-1)
        p = torch.arange(_sizes(r)[0], device=device)
        seg = torch.searchsorted(seg_end, p, right=True).clamp_(max=W * E - 1)
        maps = (seg_rank[seg].to(torch.int32), seg_slot[seg] - (seg_end - lengths)[seg] + p, None)
    r.cache[key] = maps
    return maps


def _send(rows: torch.Tensor, r, back: bool, index: torch.Tensor | None, count: bool):
    """Steps 1-3a of an exchange: barrier, every row to its place in the out (or back) region (and,
    `count`, the destination's per-expert counters raised), this rank's flag raised in every peer.
    Returns (buffers, this rank's received rows as they land in its buffer)."""
    assert index is None or not back, "rows go back from where they were received, not by an index"
    me = dist.get_rank(r.group)
    row_numel = math.prod(rows.shape[1:])
    dst_rank, dst_row, dst_expert = _maps(r, back)
    n_out = _sizes(r)[2 if back else 0]  # rows this rank gets
    world = dist.get_world_size(r.group)
    if world > _FLAGS // 4 or r.num_local_experts > _COUNTERS // 4:
        raise ValueError(f"ep_transport='symm_mem' supports up to {_FLAGS // 4} EP ranks and {_COUNTERS // 4} local "
                         f"experts per rank, got {world} and {r.num_local_experts}; use "
                         f"ep_transport='all_to_all'")
    bufs = _buffers(r.group, rows.device)
    need = _region_bytes(r, row_numel * rows.element_size())
    if need > bufs.nbytes:  # every rank computes the same `need`: the reallocation is collective
        # with a capacity the need is already a bound (it changes only with the rows a rank routes)
        headroom = 1.0 if r.capacity is not None else _HEADROOM
        bufs.allocate(max(_ALIGN, -(-int(need * headroom) // _ALIGN) * _ALIGN))
    bufs.barrier()  # peers have copied the previous exchange out of their buffers
    bufs.epoch += 1  # every rank counts the same exchanges in the same order
    counts = (bufs.counter_addresses, dst_expert) if count else None
    addresses = bufs.back_addresses if back else bufs.row_addresses
    scatter_rows(rows.reshape(rows.shape[0], row_numel), dst_rank, dst_row, addresses, index, counts,
                 num_valid=_num_valid(r) if back else None)
    signal_peers(bufs.flag_addresses, me, bufs.epoch)  # after this rank's rows, on the same stream
    return bufs, bufs.view(me, rows.dtype, (n_out, *rows.shape[1:]), 0, back)


def _region_bytes(r, row_bytes: int) -> int:
    """Bytes a region needs for rows of row_bytes in this route, either direction (the most rows any rank
    receives, out or back): an exchange out sizes the back region too, so that the GEMM writing the rows
    back (`back_from_gemm`, which cannot reallocate under a running GEMM1) finds room."""
    _, most_received, _, most_sent = _sizes(r)
    return max(most_received, most_sent) * row_bytes


def exchange_symmetric(rows: torch.Tensor, r, back: bool, index: torch.Tensor | None = None) -> torch.Tensor:
    """The rows this rank receives: out to the experts' owners (rows in send order: rows[index] when
    `index` is given, read in place), sorted by expert; or `back` to the tokens' ranks, in send order."""
    bufs, received = _send(rows, r, back, index, count=False)
    wait_for_peers(bufs.flags, bufs.epoch)  # every peer's rows for this rank have landed
    return received.clone()


def send_counted(rows: torch.Tensor, r, index: torch.Tensor):
    """Out to the experts' owners, as `exchange_symmetric`, but returns at once with (the rows as they
    land, in this rank's buffer; (arrived, expected) per local expert, for `gemm1_swiglu(arrivals=...)`;
    `finish`, which waits for every peer and returns the rows copied out of the buffer). Between the two,
    only reads of the landing rows that first wait on their expert's count are safe, or reads by a later
    kernel on the stream once every expert's count has been waited for (the weight gradients read dout's
    landing rows after dgrad, without `finish`)."""
    bufs, landing = _send(rows, r, False, index, count=True)
    _, _, E, per_expert = _counts(r)
    landed = per_expert * column_blocks(math.prod(rows.shape[1:]))
    if bufs.counted is None:  # new buffers: their counters start at zero
        bufs.counted = torch.zeros(_COUNTERS // 4, dtype=torch.int64, device=landing.device)
    # counters are never reset: they count modulo 2**32, and GEMM1 compares with wrap-around arithmetic;
    # what each will read is tracked on the device, so no count is read on the host
    bufs.counted[:E] = (bufs.counted[:E] + landed) % 2**32
    expected = (((bufs.counted[:E] + 2**31) % 2**32) - 2**31).to(torch.int32)
    arrivals = (bufs.counters[:E], expected)

    def finish() -> torch.Tensor:
        wait_for_peers(bufs.flags, bufs.epoch)
        return landing.clone()

    return landing, arrivals, finish


def back_from_gemm(r, plan, dtype: torch.dtype, row_shape: tuple[int, ...]):
    """Back to the tokens' ranks, stored by a GEMM's epilogue (GEMM2's y rows, dx's rows) straight into
    their ranks' back regions: returns (`PeerRows` for the GEMM's `peers`; `finish`, to call once the GEMM
    is launched, which raises this rank's flag after it, waits for every peer's and returns the rows this
    rank got back, in send order: a view of its buffer, to be copied before the next exchange).

    No barrier before the GEMM writes: the back region is free once every rank has passed the barrier
    that began the exchange out (rows out of the same route, made just before), since each rank copies a
    region's rows out before its next barrier. The exchange out sized the region for these rows."""
    me = dist.get_rank(r.group)
    dst_rank, dst_row, _ = _maps(r, back=True)
    n_back = _sizes(r)[2]
    bufs = _buffers(r.group, dst_rank.device)
    row_numel = math.prod(row_shape)
    need = _region_bytes(r, row_numel * dtype.itemsize)
    assert need <= bufs.nbytes, "the exchange out of this route sizes the back region first"
    key = ("offsets", dtype, row_numel, bufs.nbytes)
    if key not in r.cache:
        # element offsets from this rank's back region to each row's place in its destination's (regions
        # are element-aligned: 1 MiB multiples apart, mapped at page boundaries), by the plan's sorted row
        # (with a capacity the padding rows' offsets are in range, unused: no tile covers them)
        region_offset = (bufs.back_addresses - bufs.back_addresses[me]) // dtype.itemsize
        r.cache[key] = (region_offset[dst_rank] + dst_row * row_numel)[plan.order_N]
    peers = PeerRows(bufs.view(me, dtype, (max(n_back, 1), *row_shape), 0, back=True), r.cache[key])

    def finish() -> torch.Tensor:
        bufs.epoch += 1
        signal_peers(bufs.flag_addresses, me, bufs.epoch)  # after the GEMM's stores, on the same stream
        wait_for_peers(bufs.flags, bufs.epoch)
        return bufs.view(me, dtype, (n_back, *row_shape), 0, back=True)

    return peers, finish
