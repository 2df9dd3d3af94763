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


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T,E,K,block_m", [(1, 4, 1, 16), (3, 8, 2, 16), (257, 16, 4, 16), (1000, 60, 4, 128),
                                           (64, 256, 16, 16), (700, 7, 3, 128),
                                           # N over several 1024-row permutation programs and 64-tile schedule programs
                                           (1500, 256, 3, 16), (2500, 7, 2, 128)])
def test_routing_kernel_matches_torch_routing(routing, T, E, K, block_m):
    """The one-launch Triton routing plan equals the torch oracle (`routing.build_routing` + `tile_schedule`)."""
    from titan_megamoe.kernels.routing_meta import build_routing_plan, packed_size

    ids = make_ids(T, E, min(K, E), routing, torch.Generator().manual_seed(T + E)).to(DEVICE)
    ref = build_routing(ids, E)
    ref_expert, ref_row = tile_schedule(ref.offsets_E1, T * K, block_m)
    packed, plan = build_routing_plan(ids, E, block_m)
    assert packed.numel() == packed_size(T * K, E, block_m) and packed.dtype == torch.int32
    assert torch.equal(plan.order_N, ref.order_N)
    assert torch.equal(plan.inv_N, ref.inv_N)
    assert torch.equal(plan.offsets_E1, ref.offsets_E1)
    assert torch.equal(plan.tile_expert, ref_expert)
    valid = ref_expert >= 0
    assert torch.equal(plan.tile_row[valid], ref_row[valid])
    assert int(plan.ids_ok) == 1


# 2**16 + 1 and -2**16 would wrap to valid ids in the int16 sort keys without the clamp
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bad_id", [-1, 4, 100, 2**16 + 1, -(2**16)])
def test_routing_kernel_flags_out_of_range_ids(bad_id, dtype):
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    ids = torch.tensor([[0, 1], [2, 3], [1, bad_id]], device=DEVICE, dtype=dtype)
    _, plan = build_routing_plan(ids, 4, 16)
    assert int(plan.ids_ok) == 0
