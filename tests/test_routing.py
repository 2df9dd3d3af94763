"""Routing metadata invariants and the tile schedule, on CPU."""

import pytest
import torch

from moe_cases import ROUTINGS, make_ids
from titan_megamoe.routing import build_routing, check_routing_invariants, max_tiles, tile_schedule


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (3, 8, 2), (257, 16, 4), (1000, 60, 4), (64, 256, 16)])
def test_routing_invariants(routing, T, E, K):
    ids = make_ids(T, E, min(K, E), routing, torch.Generator().manual_seed(T * E))
    r = build_routing(ids, E)
    check_routing_invariants(r, ids, E)


@pytest.mark.parametrize("block_m", [16, 128])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_tile_schedule_covers_every_row_once(block_m, routing):
    T, E, K = 300, 12, 3
    ids = make_ids(T, E, K, routing, torch.Generator().manual_seed(1))
    r = build_routing(ids, E)
    tile_expert, tile_row = tile_schedule(r.offsets_E1, T * K, block_m)
    assert tile_expert.numel() == max_tiles(T * K, E, block_m)
    covered = torch.zeros(T * K, dtype=torch.int64)
    for e, start in zip(tile_expert.tolist(), tile_row.tolist()):
        if e < 0:
            continue
        end = min(start + block_m, int(r.offsets_E1[e + 1]))
        assert int(r.offsets_E1[e]) <= start < end, "a tile must start inside its expert"
        covered[start:end] += 1
    assert torch.equal(covered, torch.ones_like(covered)), "every sorted row in exactly one tile"
    valid = tile_expert >= 0
    assert bool(valid[: int(valid.sum())].all()), "valid tiles come first"
