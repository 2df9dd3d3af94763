"""Routing metadata built on the device with no host synchronisation.

A routed row n = t*K + k is token t's k-th choice. Kernels work on rows in expert-sorted order:
sorted position p holds routed row ``order_N[p]``; ``inv_N[n]`` is the inverse. Expert e owns the
sorted positions ``offsets_E1[e] : offsets_E1[e+1]``. Every size is known on the host from (T, K, E),
so the metadata (and the op) can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    order_N: torch.Tensor  # int32 [N]: sorted position -> routed row
    inv_N: torch.Tensor  # int32 [N]: routed row -> sorted position
    offsets_E1: torch.Tensor  # int32 [E+1]: first sorted position of each expert, offsets[E] == N


def build_routing(topk_ids_TK: torch.Tensor, num_experts: int) -> Routing:
    ids_N = topk_ids_TK.reshape(-1)
    n = ids_N.numel()
    # stable sort: within an expert, rows keep token order (the same order stock TorchTitan uses)
    sorted_ids_N, order_N = torch.sort(ids_N.to(torch.int32), stable=True)
    experts = torch.arange(num_experts + 1, device=ids_N.device, dtype=torch.int32)
    offsets_E1 = torch.searchsorted(sorted_ids_N, experts, right=False).to(torch.int32)
    inv_N = torch.empty_like(order_N)
    inv_N[order_N] = torch.arange(n, device=ids_N.device, dtype=order_N.dtype)
    return Routing(order_N.to(torch.int32), inv_N.to(torch.int32), offsets_E1)


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Host-known upper bound on sum_e ceil(count_e / block_m)."""
    if num_rows == 0:
        return 0
    return min(-(-num_rows // block_m) + num_experts - 1, num_rows)


def tile_schedule(offsets_E1: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per M-tile (expert, first sorted row); tiles past the real count get expert -1.

    Returns int32 tensors of length ``max_tiles(N, E, block_m)``.
    """
    num_experts = offsets_E1.numel() - 1
    n_tiles = max_tiles(num_rows, num_experts, block_m)
    device = offsets_E1.device
    counts_E = (offsets_E1[1:] - offsets_E1[:-1]).to(torch.int64)
    tiles_E = (counts_E + block_m - 1) // block_m
    tile_end_E = torch.cumsum(tiles_E, 0)
    tile_ids = torch.arange(n_tiles, device=device, dtype=torch.int64)
    expert = torch.searchsorted(tile_end_E, tile_ids, right=True)
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first_tile = tile_end_E[e] - tiles_E[e]
    row_start = offsets_E1[e].to(torch.int64) + (tile_ids - first_tile) * block_m
    tile_expert = torch.where(valid, e, torch.full_like(e, -1)).to(torch.int32)
    return tile_expert, row_start.to(torch.int32)


def check_routing_invariants(routing: Routing, topk_ids_TK: torch.Tensor, num_experts: int) -> None:
    """Assert the metadata invariants (debug and tests; synchronises)."""
    ids_N = topk_ids_TK.reshape(-1).to(torch.int64)
    n = ids_N.numel()
    order = routing.order_N.to(torch.int64)
    inv = routing.inv_N.to(torch.int64)
    off = routing.offsets_E1.to(torch.int64)
    assert off.numel() == num_experts + 1 and int(off[0]) == 0 and int(off[-1]) == n, "offsets must span [0, N]"
    assert bool((off[1:] >= off[:-1]).all()), "offsets must be non-decreasing"
    counts = torch.bincount(ids_N, minlength=num_experts)
    assert torch.equal(off[1:] - off[:-1], counts), "offsets must match per-expert counts"
    assert torch.equal(torch.sort(order).values, torch.arange(n, device=order.device)), "order must be a permutation"
    assert torch.equal(inv[order], torch.arange(n, device=order.device)), "inv must invert order"
    expert_of_pos = torch.repeat_interleave(torch.arange(num_experts, device=off.device), counts)
    assert torch.equal(ids_N[order], expert_of_pos), "sorted rows must be grouped by expert"
