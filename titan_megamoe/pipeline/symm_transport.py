"""Expert parallelism, symmetric-memory transport: each rank writes its rows straight into the receiving
rank's buffer, no all-to-all.

One buffer per rank of the EP group, mapped into every peer (torch symmetric memory on CUDA:
`torch.distributed._symmetric_memory.empty` + `rendezvous`, peers' buffers as tensors through
`get_buffer`, NVLink on a multi-GPU host). One set per (process group, device type), shared by every MoE
layer and call: a layer uses it only inside one exchange. An exchange of rows:

  1. barrier: every rank has copied the previous exchange out of its buffer
  2. each rank writes its block for rank q into q's buffer, at the offset the counts matrix gives
     (`Route.counts`: rows from rank s to rank q, known on every rank since `ep_dispatch.route`), with
     a Triton kernel that reads the rows where they are (`kernels.peer_rows.put_rows`: x and dout rows
     by the send order, so no gathered copy is made first)
  3. each rank raises its flag in every peer (`signal_peers`: the exchange's epoch, after its writes)
     and waits until every peer's flag in its own buffer is up (`wait_for_peers`), on the device
  4. each rank copies what it received out of its own buffer
Each buffer starts with the flags (one int32 per rank, `_HEADER` bytes), the rows follow.

Out to the experts' owners (forward x, ids, scores; backward dout): rank r's rows for rank q start in q's
buffer after those of ranks s < r, so the received rows are grouped by source rank in rank order, as the
all-to-all delivers them. Back to the tokens' ranks (y; dx, ds): rank q's rows from source s go to s's
buffer where s's send order put them (after s's rows for ranks < q). Both transports therefore hand the
expert FFN and the combine the same rows in the same order, and the result is bitwise the same.

No token is dropped: a buffer holds the most rows any rank receives in either direction, computed from
the counts matrix, which every rank has, so every rank asks for the same size; when a call needs more the
buffers are reallocated (a collective: every rank takes the same decision at the same exchange) with
headroom, never truncated. Memory per rank: about 1.25x (max over ranks of rows received) x the widest
row, once per process group, not per layer.

Where this stands (2026-12-04): rows are written by a Triton kernel and their arrival is signalled by
per-source flags, but the flags say "all of rank s's rows are here", not per expert, and GEMM1 does not
wait on them yet: nothing overlaps the expert GEMMs. The first barrier is `_SymmetricMemory.barrier`
(signal pads). On CPU (gloo, the CI tests) the same protocol runs on shared-memory files (`/dev/shm`)
mapped by every rank, the kernels in Triton's interpreter, with `dist.barrier` as the barrier: a stand-in
for tests, not a transport for training. torch's CUDA symmetric memory refuses two ranks on one GPU
(docs/ep.md), so the CUDA side runs on one H200 only as one rank; the kernel version has not run on a
GPU yet.
"""

from __future__ import annotations

import math
import os
import uuid

import torch
import torch.distributed as dist

from ..kernels.peer_rows import put_rows, signal_peers, wait_for_peers

_HEADER = 4096  # bytes before the rows: the flags, one int32 per rank (up to 1024 ranks), 16-byte aligned rows
_HEADROOM = 1.25  # reallocate with room to spare: routing shifts a little from step to step
_ALIGN = 1 << 20


class _CudaSymmetricBuffers:
    """Torch symmetric memory: this rank's buffer and its peers', mapped (NVLink on a multi-GPU host)."""

    def __init__(self, group, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm, self._group, self._device = symm_mem, group, device
        self.nbytes, self._handle, self._local, self.epoch = 0, None, None, 0

    def allocate(self, nbytes: int) -> None:
        if self._local is not None:
            # the last exchange's copy-out may still be reading the old buffer on the stream, and this
            # allocator need not wait for the stream before freeing: growth is rare, synchronise
            torch.cuda.synchronize(self._device)
            self._handle = self._local = None
        self._local = self._symm.empty(_HEADER + nbytes, dtype=torch.uint8, device=self._device)
        self._local[:_HEADER].zero_()  # the flags; the exchange's first barrier orders this before any signal
        self._handle = self._symm.rendezvous(self._local, self._group.group_name)
        self.nbytes = nbytes
        world = dist.get_world_size(self._group)
        self.addresses = [self._handle.get_buffer(r, (1,), torch.uint8, 0).data_ptr() for r in range(world)]
        self.flags = self._local[:4 * world].view(torch.int32)
        self.flag_addresses = torch.tensor(self.addresses, dtype=torch.int64, device=self._device)

    def view(self, rank: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        """Rank `rank`'s rows as `shape` elements of dtype, starting `offset` elements in."""
        return self._handle.get_buffer(rank, shape, dtype, _HEADER // dtype.itemsize + offset)

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
        self._generation += 1
        path = lambda r: f"{self._prefix}_{self._generation}_{r}"  # noqa: E731
        size = _HEADER + nbytes
        torch.from_file(path(self._rank), shared=True, size=size, dtype=torch.uint8)  # creates it, zeroed
        dist.barrier(group=self._group)
        self._maps = [torch.from_file(path(r), shared=True, size=size, dtype=torch.uint8)
                      for r in range(self._world)]
        dist.barrier(group=self._group)
        os.unlink(path(self._rank))  # the mappings stay valid; nothing is left in /dev/shm
        self.nbytes = nbytes
        self.addresses = [m.data_ptr() for m in self._maps]
        self.flags = self._maps[self._rank][:4 * self._world].view(torch.int32)
        self.flag_addresses = torch.tensor(self.addresses, dtype=torch.int64)

    def view(self, rank: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        flat = self._maps[rank][_HEADER:].view(dtype)
        return flat[offset:offset + math.prod(shape)].view(shape)

    def barrier(self) -> None:
        dist.barrier(group=self._group)


_BUFFERS: dict = {}


def _buffers(group, device: torch.device):
    """The one set of buffers of this process group on this device type (made on first use)."""
    key = (group.group_name, device.type)
    if key not in _BUFFERS:
        _BUFFERS[key] = (_CudaSymmetricBuffers if device.type == "cuda" else _SharedFileBuffers)(group, device)
    return _BUFFERS[key]


def exchange_symmetric(rows: torch.Tensor, counts: list[list[int]], group, back: bool,
                       index: torch.Tensor | None = None) -> torch.Tensor:
    """The rows this rank receives, in the all-to-all's order: out to the experts' owners (rows in send
    order: rows[index] when `index` is given, read in place), or `back` to the tokens' ranks (received
    rows, grouped by source). counts[s][q]: rows rank s sends to rank q in the forward direction."""
    me, world = dist.get_rank(group), len(counts)
    row_shape = tuple(rows.shape[1:])
    row_numel = math.prod(row_shape)
    sent = [sum(c) for c in counts]  # rows each rank routed (its send order's length)
    received = [sum(counts[s][q] for s in range(world)) for q in range(world)]
    if back:  # block for source s: received from s, written where s's send order holds it
        blocks = [(s, sum(counts[p][me] for p in range(s)), counts[s][me], sum(counts[s][:me])) for s in range(world)]
        n_out, most = sent[me], max(sent)
    else:  # block for owner q: this rank's rows for q, after those of ranks before this one
        blocks = [(q, sum(counts[me][:q]), counts[me][q], sum(counts[p][q] for p in range(me))) for q in range(world)]
        n_out, most = received[me], max(received)
    bufs = _buffers(group, rows.device)
    need = most * row_numel * rows.element_size()
    if need > bufs.nbytes:  # every rank computes the same `need`: the reallocation is collective
        bufs.allocate(max(_ALIGN, -(-int(need * _HEADROOM) // _ALIGN) * _ALIGN))
    bufs.barrier()  # peers have copied the previous exchange out of their buffers
    bufs.epoch += 1  # every rank counts the same exchanges in the same order
    rows_2d = rows.reshape(rows.shape[0], row_numel)
    for peer, start, n, offset in blocks:
        if n:
            dst = bufs.addresses[peer] + _HEADER + offset * row_numel * rows.element_size()
            if index is None:
                put_rows(rows_2d[start:start + n], dst)
            else:
                put_rows(rows_2d, dst, index[start:start + n])
    signal_peers(bufs.flag_addresses, me, bufs.epoch)  # after this rank's rows, on the same stream
    wait_for_peers(bufs.flags, bufs.epoch)  # every peer's rows for this rank have landed
    return bufs.view(me, rows.dtype, (n_out, *row_shape), 0).clone()
