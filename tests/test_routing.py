"""Routing metadata invariants and the tile schedule, on CPU."""

import pytest
import torch

from moe_cases import ROUTINGS, make_ids
from titan_megamoe.oracle import check_routing_invariants, routing_plan, tile_schedule
from titan_megamoe.plan import max_tiles


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (3, 8, 2), (257, 16, 4), (1000, 60, 4), (64, 256, 16)])
def test_routing_invariants(routing, T, E, K):
    ids = make_ids(T, E, min(K, E), routing, torch.Generator().manual_seed(T * E))
    r = routing_plan(ids, E, block_m=16)
    check_routing_invariants(r, ids)


@pytest.mark.parametrize("block_m", [16, 128])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_tile_schedule_covers_every_row_once(block_m, routing):
    T, E, K = 300, 12, 3
    ids = make_ids(T, E, K, routing, torch.Generator().manual_seed(1))
    r = routing_plan(ids, E, block_m)
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


# every routing on the small shapes; on the larger ones, whose chunks (16-128 rows in the interpreter,
# 256-4096 on the GPU) are what they add and which cost 5-11 s each in the interpreter, skewed and empty
# experts in turn (each at one E < 16 and one E >= 60)
_SMALL = [(T, E, K, bm, r) for T, E, K, bm in [(1, 4, 1, 16), (3, 8, 2, 16), (257, 16, 4, 16), (64, 256, 16, 16)]
          for r in ROUTINGS]
_LARGE = [(1000, 60, 4, 128, "skewed"), (700, 7, 3, 128, "empty_experts"), (1500, 256, 3, 16, "empty_experts"),
          (2500, 7, 2, 128, "skewed")]


@pytest.mark.parametrize("T,E,K,block_m,routing", _SMALL + _LARGE + [
    # 4096-row chunks (the GPU only: hours in the interpreter)
    pytest.param(40000, 128, 8, 128, r, marks=pytest.mark.skipif(DEVICE == "cpu", reason="4096-row chunks: GPU only"))
    for r in ROUTINGS])
def test_routing_kernel_matches_torch_routing(T, E, K, block_m, routing):
    """The Triton routing plan (a counting sort in two launches) equals the torch oracle (`oracle.routing_plan`)."""
    from titan_megamoe.kernels.routing_meta import build_routing_plan
    from titan_megamoe.plan import PlanLayout

    ids = make_ids(T, E, min(K, E), routing, torch.Generator().manual_seed(T + E)).to(DEVICE)
    ref = routing_plan(ids, E, block_m)
    ref_expert, ref_row = ref.tile_expert, ref.tile_row
    plan = build_routing_plan(ids, E, block_m)
    packed = plan.packed
    assert packed.numel() == PlanLayout(T * K, E, block_m, K).packed_size and packed.dtype == torch.int32
    assert plan.layout == ref.layout
    assert torch.equal(plan.order_N, ref.order_N)
    assert torch.equal(plan.inv_N, ref.inv_N)
    assert torch.equal(plan.offsets_E1, ref.offsets_E1)
    assert torch.equal(plan.tile_expert, ref_expert)
    valid = ref_expert >= 0
    assert torch.equal(plan.tile_row[valid], ref_row[valid])
    assert int(plan.ids_ok) == 1


# ids far outside the range (2**16 + 1, -2**16) must not wrap into it
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bad_id", [-1, 4, 100, 2**16 + 1, -(2**16)])
def test_routing_kernel_flags_out_of_range_ids(bad_id, dtype):
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    ids = torch.tensor([[0, 1], [2, 3], [1, bad_id]], device=DEVICE, dtype=dtype)
    plan = build_routing_plan(ids, 4, 16)
    assert int(plan.ids_ok) == 0


@pytest.mark.parametrize("source", ["gather", "contiguous"])
def test_plan_for_local_experts_of_a_rank(source):
    """An EP rank owns experts [first, first + E_local): its plan maps global ids to local ones, over
    token-gathered rows ([T, K] ids) or a contiguous buffer of received rows ([N] ids, one row each)."""
    from titan_megamoe.kernels.routing_meta import build_routing_plan
    from titan_megamoe.plan import RowSource

    gen = torch.Generator().manual_seed(3)
    first, local = 8, 4
    ids = first + make_ids(50, local, 2, "skewed", gen)
    if source == "contiguous":
        ids = ids.reshape(-1)[torch.randperm(100, generator=gen)]
    ids = ids.to(DEVICE)
    plan = build_routing_plan(ids, local, 16, first_expert=first)
    ref = routing_plan(ids, local, 16, first_expert=first)
    check_routing_invariants(plan, ids)
    assert plan.layout == ref.layout and plan.layout.rows_per_token == (2 if source == "gather" else 1)
    assert plan.layout.source is RowSource(source)
    for name in ("order_N", "inv_N", "offsets_E1", "tile_expert"):
        assert torch.equal(getattr(plan, name), getattr(ref, name)), name
    assert int(plan.ids_ok) == 1
    # a global id of another rank's expert is out of this rank's range
    bad = ids.clone()
    bad.view(-1)[0] = first - 1
    assert int(build_routing_plan(bad, local, 16, first_expert=first).ids_ok) == 0


@pytest.mark.parametrize("valid,bound", [(37, 60), (0, 8), (50, 50), (3, 300)])
def test_plan_of_the_valid_rows_of_a_padded_buffer(valid, bound):
    """EP with a capacity: `bound` received rows of which the first `valid` (a count on the device) are
    real: the plan is that of the valid rows (offsets, tiles), the tiles past theirs -1, padding rows map to
    themselves in order and inv, and the padding's ids (whatever they are) flag nothing."""
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    gen = torch.Generator().manual_seed(valid)
    first, local = 10, 5
    ids = torch.sort(first + torch.randint(0, local, (valid,), generator=gen)).values
    padded = torch.cat([ids, torch.full((bound - valid,), first + local)])  # one past this rank's experts
    ref = build_routing_plan(ids.to(DEVICE), local, 16, first_expert=first)
    plan = build_routing_plan(padded.to(DEVICE), local, 16, first_expert=first,
                              num_valid=torch.tensor([valid], dtype=torch.int32, device=DEVICE))
    assert plan.num_rows == bound
    assert torch.equal(plan.order_N[:valid], ref.order_N) and torch.equal(plan.inv_N[:valid], ref.inv_N)
    pad = torch.arange(valid, bound, dtype=torch.int32, device=DEVICE)
    assert torch.equal(plan.order_N[valid:], pad) and torch.equal(plan.inv_N[valid:], pad)
    assert torch.equal(plan.offsets_E1, ref.offsets_E1) and int(plan.offsets_E1[-1]) == valid
    n = ref.layout.num_tiles
    assert torch.equal(plan.tile_expert[:n], ref.tile_expert) and bool((plan.tile_expert[n:] == -1).all())
    real = ref.tile_expert >= 0
    assert torch.equal(plan.tile_row[:n][real], ref.tile_row[real])
    assert int(plan.ids_ok) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,E,K,D,source", [(1, 4, 1, 8, "gather"), (37, 5, 3, 40, "gather"),
                                            (300, 16, 8, 72, "gather"), (90, 6, 1, 24, "contiguous"),
                                            (0, 4, 2, 16, "gather")])
def test_sorted_rows_kernel_equals_the_gather(T, E, K, D, source, dtype):
    """`kernels.sorted_rows` (each source row read once, written to its K sorted positions) holds exactly
    what the oracle's gather `RoutingPlan.sorted_source_rows` holds, skewed routing, odd sizes, a strided
    source (a column slice), K = 1 and no rows at all included."""
    from titan_megamoe.kernels.routing_meta import build_routing_plan
    from titan_megamoe.kernels.sorted_rows import sorted_rows

    gen = torch.Generator().manual_seed(T + D)
    ids = make_ids(T, E, K, "skewed", gen)
    if source == "contiguous":
        ids = ids.reshape(-1)
    rows = T * K if source == "contiguous" else T
    wide = torch.randn(rows, D + 8, generator=gen).to(dtype)
    src = wide[:, 3:3 + D].to(DEVICE)  # row stride D + 8, not contiguous
    plan = build_routing_plan(ids.to(DEVICE), E, 16)
    got = sorted_rows(src, plan)
    assert got.shape == (T * K, D) and got.dtype == dtype
    assert torch.equal(got, plan.sorted_source_rows(src))


def test_experts_by_load_is_heaviest_first_and_computed_once():
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    ids = torch.tensor([[2, 0], [2, 1], [2, 0], [3, 2]], device=DEVICE)  # counts 2, 1, 4, 1
    plan = build_routing_plan(ids, 4, 16)
    assert plan.experts_by_load.tolist() == [2, 0, 1, 3] and plan.experts_by_load.dtype == torch.int32
    assert plan.experts_by_load is plan.experts_by_load


@pytest.mark.parametrize("E,block_m", [(1, 16), (5, 16), (60, 64), (128, 128), (300, 32)])
@pytest.mark.parametrize("loads", ["ties", "random", "one_hot", "empty"])
def test_expert_schedule_kernel_matches_its_torch_oracle(E, block_m, loads, monkeypatch):
    """Both per-expert tables from one launch against the torch ops they replaced: stable among equal
    loads (the ties case has many), empty experts, one expert with every row, E past one BLOCK_J block.
    The output starts poisoned (int32 min), so an entry the kernel does not write fails."""
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")
    from titan_megamoe.kernels.routing_meta import expert_schedule
    from titan_megamoe.oracle import expert_schedule_reference

    gen = torch.Generator().manual_seed(E + block_m)
    rows = {"ties": torch.randint(0, 3, (E,), generator=gen) * block_m,
            "random": torch.randint(0, 5 * block_m, (E,), generator=gen),
            "one_hot": torch.zeros(E, dtype=torch.int64).index_fill_(0, torch.tensor([E // 2]), 999),
            "empty": torch.zeros(E, dtype=torch.int64)}[loads]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), rows.cumsum(0)]).to(torch.int32).to(DEVICE)
    got, want = expert_schedule(offsets, block_m), expert_schedule_reference(offsets, block_m)
    for g, w in zip(got, want):
        assert g.dtype == torch.int32 and torch.equal(g, w)


def test_expert_first_tile_counts_the_tiles_before_each_expert():
    """Each expert's first M-tile: the tiles (block_m rows of one expert) of the experts before it, an empty
    expert starting where the next one does; computed once per plan."""
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    counts = [3, 0, 20, 16, 1]  # tiles of 16 rows: 1, 0, 2, 1, 1
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])[torch.randperm(sum(counts))].view(-1, 1)
    plan = build_routing_plan(ids.to(DEVICE), len(counts), 16)
    assert plan.expert_first_tile.tolist() == [0, 1, 1, 3, 4] and plan.expert_first_tile.dtype == torch.int32
    assert plan.expert_first_tile is plan.expert_first_tile
    # the same as the tiles' own experts: expert e's first tile is the first tile whose expert is e
    tile_expert = plan.tile_expert.tolist()
    for e, c in enumerate(counts):
        if c:
            assert tile_expert.index(e) == plan.expert_first_tile[e]
