"""The block FP8 quantization kernels (kernels/quantize.py) against quant.py, bit for bit: data and scales
compared as bytes, on the GPU when there is one, else in Triton's CPU interpreter (small shapes).

The inputs are built to hit every branch of the scale policy and the cast: blocks whose amax differs by
up to 2^80, a 1e4x outlier, an all-zero block (scale 1), a block under the scale floor 2^-126, values
that scale below e4m3's smallest normal (subnormal codes and signed zeros), -0.0, and amax right at
448 * 2^k; the tests assert that these codes really occur, so they cannot pass vacuously."""

import pytest
import torch

from titan_megamoe import oracle, quant
from titan_megamoe.kernels.common import new_output
from titan_megamoe.kernels.quantize import (quantize_rows, quantize_sorted_rows, quantize_token_tiles,
                                            quantize_weight_pair, quantize_weight_transposed)
from titan_megamoe.kernels.routing_meta import build_routing_plan
from titan_megamoe.plan import max_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE_FLOOR = 2.0**-126


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _assert_bitwise(q, ref, what: str) -> None:
    assert q.block == ref.block, (what, q.block, ref.block)
    for name in ("data", "scale"):
        a, b = getattr(q, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name, a.dtype, b.dtype, a.shape, b.shape)
        assert a.is_contiguous(), (what, name)
        diff = (_bytes(a) != _bytes(b)).reshape(a.shape[0], -1) if a.numel() else None
        if diff is not None and bool(diff.any()):
            first = diff.nonzero()[0].tolist()
            pytest.fail(f"{what}: {name} differs from quant.py in {int(diff.sum())} bytes, first at {first}")


def _hard_values(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """[..., R, C] (R >= 4, C a multiple of 128), on CPU: the special blocks sit in the first 4 rows of every
    matrix (in its first two column blocks)."""
    gen = torch.Generator().manual_seed(seed)
    *lead, R, C = shape
    # a 2^16 spread inside each block (wider than e4m3's normal range: some values scale to subnormals
    # or round to zero), then a random power of two per 1x128 block: very different scales
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 4, shape, generator=gen).float())
    block_exp = torch.randint(-40, 40, (*lead, R, C // 128, 1), generator=gen).float()
    x = (x.unflatten(-1, (C // 128, 128)) * torch.exp2(block_exp)).flatten(-2)
    x[..., 0, :128] = 0.0  # an all-zero row block
    second = slice(128, 256) if C >= 256 else slice(0, 128)
    x[..., 1, second] = torch.randn(128, generator=gen)
    x[..., 1, second.start + 2] = 1e4 * x[..., 1, second].abs().median()  # an outlier: the rest of its block ~0
    x[..., 2, :128] = torch.randn(128, generator=gen) * 1e-3  # scaled below 2^-6 next to a 1: subnormal codes
    x[..., 2, 0] = 1.0
    x[..., 2, 1:4] = -0.0
    x[..., 2, 4] = -(2.0**-16)  # with scale 2^-8: -2^-8 of e4m3's units, rounds to -0
    x[..., 3, :128] = torch.randn(128, generator=gen) * 1e-39  # amax under 448 * 2^-126: the scale floor
    if C >= 256:
        x[..., 3, 128] = 448.0 * 2.0**5  # amax exactly 448 * 2^k: scale 2^k, 448 saturates nothing
        x[..., 3, 129:256] = x[..., 3, 129:256].clamp(-1000, 1000)
    return x.to(dtype)


def _assert_codes_covered(data: torch.Tensor, scale: torch.Tensor) -> None:
    """The special values did reach the comparison (guards against a generator that stops producing them)."""
    b = _bytes(data).reshape(-1)
    assert bool(((b & 0x78) == 0).logical_and((b & 0x07) != 0).any()), "no e4m3 subnormal codes"
    assert bool((b == 0x80).any()), "no -0 codes"
    assert bool(((b & 0x7F) == 0x7E).any()), "no +-448 codes"
    s = scale.cpu()
    assert bool((s == 1.0).any()) and bool((s == SCALE_FLOOR).any()), "no all-zero block or floor-scale block"
    assert float(s.max()) / float(s[s != SCALE_FLOOR].min()) > 2.0**40, "scales do not spread"


# ------------------------------------------------------------------------------------------------ rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [4, 45, 64])  # 45: not a multiple of the 32 rows per program
def test_quantize_rows_matches_quant(dtype, rows):
    x = _hard_values((rows, 384), dtype, seed=rows)
    q = quantize_rows(x.to(DEVICE))
    _assert_bitwise(q, quant.quantize_activation(x), f"rows {rows} {dtype}")
    _assert_codes_covered(q.data, q.scale)
    zero_block = _bytes(q.data)[0, :128]
    assert float(q.scale[0, 0]) == 1.0 and not bool(zero_block.any()), "all-zero block: scale 1, data 0"
    assert float(q.scale[3, 0]) == SCALE_FLOOR


def test_quantize_rows_empty_and_strided():
    q = quantize_rows(torch.zeros(0, 256, dtype=torch.bfloat16, device=DEVICE))
    assert q.data.shape == (0, 256) and q.scale.shape == (0, 2) and q.data.dtype == quant.E4M3
    # a transposed view (column stride 45): the launcher reads strides, the output is contiguous
    x_RC = _hard_values((45, 256), torch.float32, seed=3)
    view_RC = x_RC.t().contiguous().to(DEVICE).t()
    assert view_RC.stride() == (1, 45)
    _assert_bitwise(quantize_rows(view_RC), quant.quantize_activation(x_RC), "strided rows")


def test_quantize_rows_bad_shapes():
    with pytest.raises(ValueError, match=r"C \(columns\) must be a multiple of 128, got 200.*pad them"):
        quantize_rows(torch.zeros(4, 200, device=DEVICE))
    with pytest.raises(ValueError, match="expected a 2-D operand"):
        quantize_rows(torch.zeros(2, 4, 128, device=DEVICE))
    with pytest.raises(TypeError, match="dtype torch.int32 is not supported"):
        quantize_rows(torch.zeros(4, 128, dtype=torch.int32, device=DEVICE))


# ------------------------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 128, 256), (2, 256, 128), (256, 384)])
def test_quantize_weight_pair_matches_quant(dtype, shape):
    w = _hard_values(shape, dtype, seed=len(shape))
    w.view(-1, *shape[-2:])[0, -128:, -128:] = 0.0  # an all-zero 128x128 block (the first expert's last)
    W, Wt = quantize_weight_pair(w.to(DEVICE))
    _assert_bitwise(W, quant.quantize_weight(w), f"W {shape} {dtype}")
    _assert_bitwise(Wt, quant.quantize_weight(w.transpose(-2, -1).contiguous()), f"W^T {shape} {dtype}")
    _assert_bitwise(quantize_weight_transposed(w.to(DEVICE)), quant.quantize_weight(w.transpose(-2, -1).contiguous()),
                    f"W^T alone {shape} {dtype}")
    first_W, first_Wt = (W.data, Wt.scale) if len(shape) == 2 else (W.data[0], Wt.scale[0])
    assert float(first_Wt[-1, -1]) == 1.0 and not bool(_bytes(first_W[-128:, -128:]).any()), "zero block"
    # the cast's corner cases occur in the weight blocks too
    b = _bytes(W.data).reshape(-1)
    assert bool((b == 0x80).any()) and bool(((b & 0x78) == 0).logical_and((b & 0x07) != 0).any())


@pytest.mark.parametrize("launch", [(4, 1), (8, 2), (8, 4)])
def test_quantize_weight_pair_launch_shapes_change_no_bit(monkeypatch, launch):
    """The launch shape (warps, blocks per program along C) changes no bit; a C whose block count it does not
    divide falls back to fewer blocks per program (3 blocks: 1)."""
    from titan_megamoe.kernels import quantize as q
    monkeypatch.setattr(q, "_WEIGHT_LAUNCH", {torch.bfloat16: launch, torch.float32: launch})
    for shape, dtype in [((2, 128, 512), torch.bfloat16), ((1, 256, 384), torch.bfloat16), ((1, 128, 512), torch.float32)]:
        w = _hard_values(shape, dtype, seed=7)
        W, Wt = quantize_weight_pair(w.to(DEVICE))
        _assert_bitwise(W, quant.quantize_weight(w), f"W {shape} {launch}")
        _assert_bitwise(Wt, quant.quantize_weight(w.transpose(-2, -1).contiguous()), f"W^T {shape} {launch}")
    assert q._weight_launch(torch.bfloat16, 3) == (launch[0], 1)
    assert q._weight_launch(torch.bfloat16, 8) == launch


def test_quantize_weight_pair_strided_and_empty():
    w = _hard_values((2, 256, 128), seed=5)  # w^T as a view: strides (R*C, 1, R)
    W, Wt = quantize_weight_pair(w.to(DEVICE).transpose(1, 2))
    _assert_bitwise(W, quant.quantize_weight(w.transpose(1, 2).contiguous()), "strided W")
    _assert_bitwise(Wt, quant.quantize_weight(w), "strided W^T")
    W, Wt = quantize_weight_pair(torch.zeros(0, 128, 256, device=DEVICE))
    assert W.data.shape == (0, 128, 256) and Wt.scale.shape == (0, 2, 1)


@pytest.mark.parametrize("variant", [(8, False), (4, True)])  # (warps, exact cast): the shipped bf16, fp32 ones
def test_gluon_weight_quantizer_matches_quant(monkeypatch, variant):
    """The Gluon weight quantizer (`quantize_gluon.weight_pair`, the GPU default: one pass for bf16 and fp32)
    is quant.py bit for bit, outputs poisoned: both dtypes, 2-D and per-expert, a strided view, W^T alone.
    In the interpreter the Triton kernel runs (the tests above)."""
    from titan_megamoe.kernels import quantize as q
    from titan_megamoe.kernels.common import INTERPRET

    monkeypatch.setattr(q, "_WEIGHT_GLUON", {torch.bfloat16: variant, torch.float32: variant})
    if INTERPRET:  # the Triton kernel runs: a Gluon launch here would fail the call
        from titan_megamoe.kernels import quantize_gluon

        monkeypatch.setattr(quantize_gluon, "weight_pair", None)
        W, _ = quantize_weight_pair(_hard_values((1, 128, 256), seed=3))
        assert W.data.shape == (1, 128, 256)
        return
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")
    for shape, dtype in [((3, 128, 256), torch.bfloat16), ((2, 256, 384), torch.float32), ((256, 128), torch.bfloat16),
                         ((1, 384, 256), torch.float32)]:
        w = _hard_values(shape, dtype, seed=len(shape) + shape[-1])
        W, Wt = quantize_weight_pair(w.to(DEVICE))
        _assert_bitwise(W, quant.quantize_weight(w), f"gluon W {shape} {dtype} {variant}")
        _assert_bitwise(Wt, quant.quantize_weight(w.transpose(-2, -1).contiguous()), f"gluon W^T {shape} {dtype}")
        _assert_bitwise(quantize_weight_transposed(w.to(DEVICE)),
                        quant.quantize_weight(w.transpose(-2, -1).contiguous()), f"gluon W^T alone {shape} {dtype}")
        b = _bytes(W.data).reshape(-1)  # the cast's corner cases occur
        assert bool((b == 0x80).any()) and bool(((b & 0x78) == 0).logical_and((b & 0x07) != 0).any())
    w = _hard_values((2, 256, 128), seed=5)  # w^T as a view: strides (R*C, 1, R)
    W, Wt = quantize_weight_pair(w.to(DEVICE).transpose(1, 2))
    _assert_bitwise(W, quant.quantize_weight(w.transpose(1, 2).contiguous()), "gluon strided W")
    _assert_bitwise(Wt, quant.quantize_weight(w), "gluon strided W^T")


def test_quantize_weight_pair_bad_shapes():
    with pytest.raises(ValueError, match=r"R \(rows\) must be a multiple of 128, got 192.*pad them"):
        quantize_weight_pair(torch.zeros(2, 192, 256, device=DEVICE))
    with pytest.raises(ValueError, match=r"C \(columns\) must be a multiple of 128, got 100"):
        quantize_weight_pair(torch.zeros(128, 100, device=DEVICE))
    with pytest.raises(ValueError, match=r"expected a weight \[R, C\] or one per expert \[E, R, C\]"):
        quantize_weight_pair(torch.zeros(128, device=DEVICE))


# ------------------------------------------------------------------------------------------------ token tiles


def _routing(case: str):
    """(ids [T, K] or [N], E) of a named routing case, on CPU."""
    gen = torch.Generator().manual_seed(len(case))
    if case == "uniform_k2":
        return torch.randint(0, 4, (70, 2), generator=gen), 4
    if case == "k1":
        return torch.randint(0, 3, (90, 1), generator=gen), 3
    if case == "empty_experts":  # experts 1, 2 and 4 get no rows
        return torch.randint(0, 2, (60, 2), generator=gen) * 3, 5
    if case == "one_hot_expert":  # 300 rows = 2 * 128 + 44 of expert 2: spare tiles at the end
        return torch.full((150, 2), 2), 4
    if case == "skewed":
        probs = torch.tensor([0.70, 0.02, 0.0, 0.18, 0.10])
        return torch.multinomial(probs, 200 * 2, replacement=True, generator=gen).reshape(200, 2), 5
    if case == "exact_128_and_129":  # expert 0: one full tile, expert 1: a full tile and a 1-row tile
        ids = torch.cat([torch.zeros(128), torch.ones(129), torch.full((7,), 2)]).long()
        return ids[torch.randperm(ids.numel(), generator=gen)].reshape(-1, 1), 3
    if case == "contiguous":  # 1-D ids: an EP dispatcher's received rows, one each
        return torch.randint(0, 3, (100,), generator=gen), 3
    if case == "no_rows":
        return torch.zeros(0, 2, dtype=torch.long), 4
    raise KeyError(case)


def _token_tile_reference(src_RC, ids, E):
    plan = oracle.routing_plan(ids, E, block_m=128)
    return quant.quantize_token_tiles(src_RC[plan.order_N.long() // plan.rows_per_token], plan), plan


def _sorted_rows_case(case: str, seed: int):
    """(src on CPU, its token tiles and sorted rows by quant.py, the oracle's plan, the kernels' plan)."""
    ids, E = _routing(case)
    src = _hard_values((max(ids.shape[0], 4), 256), seed=seed)[: ids.shape[0]]
    ref_tiles, plan_ref = _token_tile_reference(src, ids, E)
    ref_rows = quant.quantize_activation(src[plan_ref.order_N.long() // plan_ref.rows_per_token])
    return src, ref_tiles, ref_rows, plan_ref, build_routing_plan(ids.to(DEVICE), E, 128)


def _assert_spare_tiles_empty(q, plan):
    """Columns of tiles with no expert: data 0 and scale 1; columns past an expert's last row: data 0."""
    expert_T = plan.tile_expert.cpu().long()
    data = _bytes(q.data).reshape(q.data.shape)
    for t in (expert_T < 0).nonzero().flatten().tolist():
        assert not bool(data[:, 128 * t:128 * t + 128].any()) and bool((q.scale[:, t].cpu() == 1.0).all()), t
    end_T = plan.offsets_E1.cpu().long()[expert_T.clamp_min(0) + 1]
    used_T = (end_T - plan.tile_row.cpu().long()).clamp(0, 128)
    for t in ((expert_T >= 0) & (used_T < 128)).nonzero().flatten().tolist():
        assert not bool(data[:, 128 * t + int(used_T[t]):128 * t + 128].any()), t


@pytest.mark.parametrize("case", ["uniform_k2", "k1", "empty_experts", "one_hot_expert", "skewed",
                                  "exact_128_and_129", "contiguous", "no_rows"])
def test_quantize_token_tiles_matches_quant(case):
    ids, E = _routing(case)
    K = ids.shape[1] if ids.dim() == 2 else 1
    src = _hard_values((max(ids.shape[0], 4), 256), seed=E)[: ids.shape[0]]
    src[:, 255] = 0.0  # a column that is zero in every tile: scale 1 everywhere
    ref, plan_ref = _token_tile_reference(src, ids, E)
    assert ref.data.shape == (256, 128 * max_tiles(ids.numel(), E, 128))
    results = []
    for plan in (build_routing_plan(ids.to(DEVICE), E, 128), oracle.routing_plan(ids.to(DEVICE), E, block_m=128)):
        assert plan.rows_per_token == K
        q = quantize_token_tiles(src.to(DEVICE), plan)
        _assert_bitwise(q, ref, f"token tiles {case}")
        results.append(q)
    _assert_bitwise(results[0], results[1], f"{case}: kernel plan vs oracle plan")
    _assert_spare_tiles_empty(results[0], plan_ref)
    if ids.numel():
        assert bool((results[0].scale[255].cpu() == 1.0).all())
        if case in ("one_hot_expert", "empty_experts", "exact_128_and_129"):
            assert bool((plan_ref.tile_expert < 0).any()), "the case must leave spare tiles"


def test_quantize_token_tiles_tile_boundaries_and_dtypes():
    """Expert 0 has exactly 128 rows (one full tile), expert 1 129 (the 129th alone in its tile, a block
    of one row); fp32 source, and C = 160 (not a multiple of the 128 columns per program)."""
    ids, E = _routing("exact_128_and_129")
    src = _hard_values((ids.shape[0], 256), torch.float32, seed=7)[:, :160]
    ref, plan_ref = _token_tile_reference(src, ids, E)
    assert plan_ref.offsets_E1.tolist()[:3] == [0, 128, 257] and plan_ref.tile_expert.tolist()[:4] == [0, 1, 1, 2]
    q = quantize_token_tiles(src.to(DEVICE), build_routing_plan(ids.to(DEVICE), E, 128))
    _assert_bitwise(q, ref, "fp32, C=160")
    # the 129th row's block is that one value: its scale alone decides it
    row = src[plan_ref.order_N.long()[256]]
    assert torch.equal(q.scale[:, 2].cpu(), quant.power_of_two_scale(row.abs()))


def test_quantize_token_tiles_sorted_rows():
    ids, E = _routing("skewed")
    plan = build_routing_plan(ids.to(DEVICE), E, 128)
    rows_NC = _hard_values((ids.numel(), 128), seed=11)  # rows already in sorted order (h, dg, du)
    ref = quant.quantize_token_tiles(rows_NC, oracle.routing_plan(ids, E, block_m=128))
    _assert_bitwise(quantize_token_tiles(rows_NC.to(DEVICE), plan, sorted_rows=True), ref, "sorted rows")


def test_quantize_token_tiles_bad_arguments():
    ids, E = _routing("uniform_k2")
    src = torch.zeros(ids.shape[0], 128, device=DEVICE)
    with pytest.raises(ValueError, match="must be 128 rows.*got block_m=64; build the plan with block_m=128"):
        quantize_token_tiles(src, build_routing_plan(ids.to(DEVICE), E, 64))
    with pytest.raises(ValueError, match=r"src_RC has 69 rows but the plan needs N / rows_per_token = 140 / 2"):
        quantize_token_tiles(src[:69], build_routing_plan(ids.to(DEVICE), E, 128))


@pytest.mark.parametrize("variant", [(4, True), (8, False)])  # (warps, exact cast)
def test_gluon_token_tile_quantizer_matches_quant(monkeypatch, variant):
    """The Gluon token-tile quantizer (`quantize_gluon.token_tiles`) is quant.py bit for bit, outputs
    poisoned: every routing case (empty experts, spare tiles, a 1-row tile, contiguous rows, no rows),
    gathered and sorted source rows, fp32 source with C = 160, for launch shapes beside the shipped one (which
    the tests above run on a GPU); the Gluon kernel is checked to have launched. In the interpreter the Triton
    kernel runs."""
    from titan_megamoe.kernels import quantize as q
    from titan_megamoe.kernels.common import INTERPRET

    monkeypatch.setattr(q, "_TOKEN_TILE_GLUON", variant)
    if INTERPRET:  # Gluon compiles for GPUs only: the interpreter runs the Triton kernel (the tests above)
        return
    from titan_megamoe.kernels import quantize_gluon

    launched = []
    real = quantize_gluon.launch
    monkeypatch.setattr(quantize_gluon, "launch", lambda fn, *a, **kw: (launched.append(kw), real(fn, *a, **kw)))
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")
    for case in ["uniform_k2", "k1", "empty_experts", "one_hot_expert", "skewed", "exact_128_and_129", "contiguous",
                 "no_rows"]:
        src, ref_tiles, _, plan_ref, plan = _sorted_rows_case(case, seed=_routing(case)[1])
        _assert_bitwise(quantize_token_tiles(src.to(DEVICE), plan), ref_tiles, f"gluon tiles {case}")
        sorted_src = src[plan_ref.order_N.long() // plan_ref.rows_per_token]
        _assert_bitwise(quantize_token_tiles(sorted_src.to(DEVICE), plan, sorted_rows=True), ref_tiles,
                        f"gluon sorted-row tiles {case}")
    ids, E = _routing("exact_128_and_129")
    src = _hard_values((ids.shape[0], 256), torch.float32, seed=7)[:, :160]
    ref, _ = _token_tile_reference(src, ids, E)
    _assert_bitwise(quantize_token_tiles(src.to(DEVICE), build_routing_plan(ids.to(DEVICE), E, 128)), ref,
                    "gluon fp32, C=160")
    assert launched and all(kw["num_warps"] == variant[0] and kw["EXACT_CAST"] == variant[1] for kw in launched)


def test_gluon_token_tile_quantizer_host_path(monkeypatch):
    """The launcher's host code with the launch stubbed (runs on CPU): grid, the outputs in the kernel's
    order, flags."""
    from titan_megamoe.kernels import quantize_gluon

    calls = []
    monkeypatch.setattr(quantize_gluon, "launch", lambda fn, grid, *args, **kw: calls.append((fn, grid, args, kw)))
    ids, E = _routing("uniform_k2")
    plan = build_routing_plan(ids.to(DEVICE), E, 128)
    src = torch.zeros(ids.shape[0], 384, device=DEVICE)
    data, scale = torch.empty(1, device=DEVICE), torch.empty(2, device=DEVICE)
    quantize_gluon.token_tiles(src, plan, 2, True, data, scale, 4, False)
    (fn, grid, args, kw), = calls
    assert fn is quantize_gluon._token_tiles_kernel and grid == (plan.layout.num_tiles, 3)
    assert args[5] is data and args[6] is scale
    assert args[7:] == (384, plan.layout.num_tiles, 2, 384, 1)
    assert kw == dict(GATHER=True, EXACT_CAST=False, num_warps=4)


@pytest.mark.parametrize("case", ["uniform_k2", "one_hot_expert", "exact_128_and_129", "contiguous", "no_rows"])
def test_quantize_sorted_rows_matches_quant(case):
    """Rows gathered into sorted order in 1x128 blocks."""
    src, _, ref_rows, _, plan = _sorted_rows_case(case, seed=_routing(case)[1] + 1)
    _assert_bitwise(quantize_sorted_rows(src.to(DEVICE), plan), ref_rows, f"sorted rows {case}")


# ------------------------------------------------------------------------------------------------ poison


def test_every_output_element_is_written(monkeypatch):
    """Under TITAN_MEGAMOE_POISON=1 outputs start as NaN: an element a kernel skips (a spare tile's data or
    scale, rows past R, ...) would stay NaN and differ from quant.py."""
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")
    assert bool(new_output((4,), quant.E4M3, DEVICE).float().isnan().all()), "poisoning must be active"
    x = _hard_values((45, 256), seed=13)
    _assert_bitwise(quantize_rows(x.to(DEVICE)), quant.quantize_activation(x), "poisoned rows")
    w = _hard_values((2, 128, 256), seed=14)
    W, Wt = quantize_weight_pair(w.to(DEVICE))
    _assert_bitwise(W, quant.quantize_weight(w), "poisoned W")
    _assert_bitwise(Wt, quant.quantize_weight(w.transpose(1, 2).contiguous()), "poisoned W^T")
    ids, E = _routing("one_hot_expert")
    src = _hard_values((ids.shape[0], 256), seed=15)
    ref, plan_ref = _token_tile_reference(src, ids, E)
    assert int((plan_ref.tile_expert < 0).sum()) >= 3, "spare tiles with expert -1 must be written too"
    plan = build_routing_plan(ids.to(DEVICE), E, 128)
    _assert_bitwise(quantize_token_tiles(src.to(DEVICE), plan), ref, "poisoned token tiles")
    alone = quantize_sorted_rows(src.to(DEVICE), plan)  # per-token quantization + gather
    _assert_bitwise(alone, quant.quantize_activation(src[plan_ref.order_N.long() // 2]), "poisoned gathered rows")


# ------------------------------------------------------------------------------------------------ sm_90 compile

_SM90_QUANTIZERS = r"""
import json, sys
import torch
sys.path.insert(0, "scripts")
from sm90_resources import compile_sm90
from titan_megamoe.kernels import quantize as q

tiles_sig = dict(src_ptr="*bf16", order_ptr="*i32", tile_expert_ptr="*i32", tile_row_ptr="*i32", offsets_ptr="*i32",
                 data_ptr="*fp8e4nv", scale_ptr="*fp32", C="i32", num_tiles="i32", rows_per_token="i32", stride_r="i32", stride_c="i32")
tiles = dict(GATHER=True, BLOCK_M=128, BLOCK_C=q._TOKEN_TILE_COLS, INTERPRET=False)
weight_sig = dict(w_ptr="*bf16", data_ptr="*fp8e4nv", scale_ptr="*fp32", data_t_ptr="*fp8e4nv", scale_t_ptr="*fp32",
                  R="i32", C="i32", stride_e="i32", stride_r="i32", stride_c="i32")
jobs = {
    "rows": (q._quantize_rows_kernel, dict(x_ptr="*bf16", data_ptr="*fp8e4nv", scale_ptr="*fp32", R="i32", C="i32",
             stride_r="i32", stride_c="i32"), dict(BLOCK_R=q._ROWS_PER_PROGRAM, BLOCK_C=128, INTERPRET=False), 4),
    **{f"gather rows {c}": (q._gather_rows_kernel, dict(q_ptr="*fp8e4nv", q_scale_ptr="*fp32", order_ptr="*i32",
                            data_ptr="*fp8e4nv", scale_ptr="*fp32", N="i32", C="i32", rows_per_token="i32"),
                            dict(BLOCK_R=q._GATHER_ROWS, BLOCK_C=c, SCALE_BLOCK=128), q._GATHER_WARPS)
       for c in (q._GATHER_COLS, 512, 256, 128)},
    "sorted token tiles": (q._quantize_token_tiles_kernel, tiles_sig,
                           dict(tiles, GATHER=False, COL_BLOCKS=2), q._TOKEN_TILE_WARPS),
    "weight pair fp32 W": (q._quantize_weight_pair_kernel, dict(weight_sig, w_ptr="*fp32"),
                           dict(WRITE_W=True, WRITE_WT=False, BLOCK=128, COL_BLOCKS=q._WEIGHT_LAUNCH[torch.float32][1],
                                INTERPRET=False), q._WEIGHT_LAUNCH[torch.float32][0]),
    "weight pair fp32 W^T": (q._quantize_weight_pair_kernel, dict(weight_sig, w_ptr="*fp32"),
                             dict(WRITE_W=False, WRITE_WT=True, BLOCK=128, COL_BLOCKS=q._WEIGHT_LAUNCH[torch.float32][1],
                                  INTERPRET=False), q._WEIGHT_LAUNCH[torch.float32][0]),
    "token tiles": (q._quantize_token_tiles_kernel, tiles_sig, dict(tiles, COL_BLOCKS=2), q._TOKEN_TILE_WARPS),
    "weight pair": (q._quantize_weight_pair_kernel, weight_sig,
                    dict(WRITE_W=True, WRITE_WT=True, BLOCK=128, COL_BLOCKS=q._WEIGHT_LAUNCH[torch.bfloat16][1],
                         INTERPRET=False), q._WEIGHT_LAUNCH[torch.bfloat16][0]),
    "weight W^T": (q._quantize_weight_pair_kernel, weight_sig,
                   dict(WRITE_W=False, WRITE_WT=True, BLOCK=128, COL_BLOCKS=q._WEIGHT_LAUNCH[torch.bfloat16][1],
                        INTERPRET=False), q._WEIGHT_LAUNCH[torch.bfloat16][0]),
}
print(json.dumps({name: compile_sm90(fn, sig, const, set(), warps, 1)["usage"]
                  for name, (fn, sig, const, warps) in jobs.items()}))
"""


def test_quantizers_compile_for_sm90():
    """Every quantizer launch configuration compiles for sm_90 (on the CPU, no GPU needed). The interpreter runs code the
    compiler rejects: a kernel reading a plain module global (not a constexpr) passed every CPU test and
    failed to compile on the H200 (2026-12-04)."""
    from moe_cases import sm90_compile_results

    usage = sm90_compile_results(_SM90_QUANTIZERS)
    assert len(usage) == 11, sorted(usage)
    assert all("REG:" in u for u in usage.values()), usage


_SM90_GLUON_WEIGHT = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import gluon_weight_quant
from sm90_resources import gluon_token_tiles
jobs = {f"weight {dtype} {warps}": gluon_weight_quant(dtype, warps, exact) for dtype, warps, exact in
        [("bf16", 8, False), ("fp32", 4, True)]}  # the shipped launches (quantize._WEIGHT_GLUON)
jobs.update({f"tiles{' exact' * exact} {warps}": gluon_token_tiles(warps, exact) for warps, exact in
             [(4, False), (4, True)]})  # the shipped launch (quantize._TOKEN_TILE_GLUON) and its exact cast
print(json.dumps({k: {f: r[f] for f in ("usage", "e4m3_casts", "global_stores")} for k, r in jobs.items()}))
"""


def test_gluon_quantizers_compile_to_one_cast_per_element():
    """Compiled for sm_90 on the CPU: no spill, each element cast to e4m3 once per copy (two per cvt
    instruction), and the transposed copy (W^T, token tiles) stored 16 bytes at a time along its rows."""
    from moe_cases import sm90_compile_results, stack_bytes

    for name, r in sm90_compile_results(_SM90_GLUON_WEIGHT, timeout=300).items():
        per_thread = 128 * 128 // (32 * int(name.split()[-1]))
        copies = 2 if "weight" in name else 1  # a weight's W^T is cast from the moved input tile
        assert stack_bytes(r["usage"]) == 0, f"{name}: register spills: {r['usage']}"
        assert r["e4m3_casts"] == copies * per_thread // 2, f"{name}: {r['e4m3_casts']} casts, {per_thread} elements"
        assert r["global_stores"].get(".v4.b32") == per_thread // 16, f"{name}: stores {r['global_stores']}"


def test_gluon_weight_quantizer_host_path(monkeypatch):
    """The launcher's host code with the launch stubbed (runs on CPU): grid, strides and flags as the kernel
    expects them. The Gluon row GEMM's first GPU call failed in such host code (2026-12-05)."""
    from titan_megamoe.kernels import quantize_gluon

    calls = []
    monkeypatch.setattr(quantize_gluon, "launch", lambda fn, grid, *args, **kw: calls.append((fn, grid, args, kw)))
    # [3, 256, 512], strides (R*C, 1, 256)
    w = torch.zeros(3, 512, 256, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)
    outs = [torch.empty(0, device=DEVICE) for _ in range(4)]
    quantize_gluon.weight_pair(w, *outs, write_w=False, num_warps=8, exact_cast=True)
    (fn, grid, args, kw), = calls
    assert fn is quantize_gluon._weight_pair_kernel and grid == (4, 2, 3)
    assert args[5:] == (256, 512, 256 * 512, 1, 256)
    assert kw == dict(WRITE_W=False, EXACT_CAST=True, num_warps=8)
