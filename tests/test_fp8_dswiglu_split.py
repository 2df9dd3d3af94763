"""Block FP8 dgrad's elementwise half as two kernels (`_dswiglu_fp8_rows_kernel`, `_dswiglu_fp8_tiles_kernel`)
against the single `_dswiglu_fp8_kernel`: every output bitwise the same (e4m3 bits, scales, ds_part), for
the knob settings `scripts/bench_row_kernels.py --sections fp8_dswiglu` times on the GPU; and both paths
against the quantization of the bf16 path's dg, du, s*h (test_fp8_kernels.py's oracle check, reused).

On CPU the kernels run in Triton's interpreter (tests/conftest.py), where the warps are ignored but the
row blocks and column blocks per program still change which rows and columns each program masks.
"""

import pytest
import torch

from moe_cases import make_case
from test_fp8_kernels import test_fp8_dswiglu_bitwise_quant_of_bf16_path as check_quant_of_bf16_path

from titan_megamoe.kernels import dgrad_swiglu as dg_mod
from titan_megamoe.kernels.routing_meta import build_routing_plan

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"

CASES = [
    # T, H, E, K, routing
    pytest.param(150, 256, 3, 2, "skewed", id="skewed-H256"),  # an expert over 128 rows, two under; N=300
    pytest.param(60, 384, 6, 2, "empty_experts", id="empty-experts-H384"),  # 3 column blocks: odd for pairs
    pytest.param(1, 128, 4, 1, "random", id="T1-K1"),
]

# (rows kernel's block rows, its warps; token-tile kernel's warps, 128-column blocks per program, columns a step)
SPLIT_KNOBS = [
    pytest.param((32, 8, 4, 2, 32), id="rows32-tiles2x128-step32"),
    pytest.param((64, 4, 8, 1, 128), id="rows64-tiles1x128-step128"),
    pytest.param((32, 8, 8, 2, 64), id="rows32-tiles2x128-step64"),
]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    # unwritten elements come out as NaN: an element one path writes and the other skips shows in the bits
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")


def _path(monkeypatch, split, knobs=(32, 8, 4, 2, 32)):
    """The Triton kernels (the Gluon one is the GPU default: test below), split or single, these knobs."""
    block_m, rows_warps, tiles_warps, col_blocks, step = knobs
    monkeypatch.setattr(dg_mod, "_FP8_DSWIGLU_GLUON", None)
    monkeypatch.setattr(dg_mod, "_FP8_DSWIGLU_SPLIT", split)
    monkeypatch.setattr(dg_mod, "_FP8_ROWS_BLOCK_M", block_m)
    monkeypatch.setattr(dg_mod, "_FP8_ROWS_WARPS", rows_warps)
    monkeypatch.setattr(dg_mod, "_FP8_TILES_WARPS", tiles_warps)
    monkeypatch.setattr(dg_mod, "_FP8_TILES_COL_BLOCKS", col_blocks)
    monkeypatch.setattr(dg_mod, "_FP8_TILES_BLOCK_N", step)


def _bits(t):
    """A tensor's bit pattern (NaN-safe for torch.equal)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def _outputs(q, g, u, scores, plan):
    dg, du, tiles, ds_part = dg_mod._dswiglu_fp8(q, g, u, scores, plan)
    names = ["dg rows", "dg row scales", "du rows", "du row scales"]
    out = [dg.data, dg.scale, du.data, du.scale]
    for name, t in zip(("dg", "du", "s*h"), tiles):
        names += [f"{name} token tiles", f"{name} token-tile scales"]
        out += [t.data, t.scale]
    return dict(zip(names + ["ds_part"], out + [ds_part]))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid of -1e3 g
@pytest.mark.parametrize("knobs", SPLIT_KNOBS)
@pytest.mark.parametrize("T,H,E,K,routing", CASES)
def test_split_is_bitwise_the_single_kernel(monkeypatch, knobs, T, H, E, K, routing):
    case = make_case(T, 128, H, E, K, routing, device=DEVICE, seed=T + H)
    plan = build_routing_plan(case.ids, E, 128)
    N = plan.num_rows
    gen = torch.Generator().manual_seed(T + H)
    q, g, u = (torch.randn(N, H, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3))
    q[0, :128] = 0  # an all-zero 1x128 block of dg and du: scale 1
    g[-1, -128:] *= 1e3  # saturating sigmoids, large s*h
    scores = case.scores.reshape(-1).float()

    _path(monkeypatch, split=False)
    want = _outputs(q, g, u, scores, plan)
    _path(monkeypatch, split=True, knobs=knobs)
    got = _outputs(q, g, u, scores, plan)

    real = int(plan.tile_expert.ge(0).sum())
    for name, w in want.items():
        assert torch.equal(_bits(got[name]), _bits(w)), name
        # every real row and every real tile's column was written (spare tiles are left alone by both)
        written = w[:, :real * 128] if "token tiles" in name else w[:, :real] if "token-tile" in name else w
        assert not written.float().isnan().any(), name


@pytest.mark.parametrize("split", [True, False], ids=["split", "single"])
@pytest.mark.parametrize("T,H,E,K,routing", [
    pytest.param(150, 256, 3, 2, "skewed", id="skewed-H256"),
    pytest.param(60, 384, 6, 2, "empty_experts", id="empty-experts-H384"),
])
def test_both_paths_quantize_the_bf16_path(monkeypatch, split, T, H, E, K, routing):
    _path(monkeypatch, split)
    check_quant_of_bf16_path(T, 128, H, E, K, routing)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
# (warps, exact cast, persistent)
@pytest.mark.parametrize("variant", [(8, False, False), (16, True, False), (16, False, True), (8, False, True)])
@pytest.mark.parametrize("T,H,E,K,routing", CASES + [
    # several items per program of the persistent kernel (~1000 items over the GPU's ~132 programs): both
    # pipeline stages, their barrier phases flipping, an expert's last partial tile
    pytest.param(4000, 384, 16, 8, "skewed", id="T4000-several-items-per-program",
                 marks=pytest.mark.skipif(not GPU, reason="GPU only (the interpreter runs the Triton kernels)")),
])
def test_gluon_kernel_is_bitwise_the_single_kernel(monkeypatch, variant, T, H, E, K, routing):
    """The one-kernel Gluon dSwiGLU (`dswiglu_fp8_gluon`, the GPU default) writes the Triton single kernel's
    bits (ds_part to fp32 rounding), outputs poisoned, spare tiles left alone by both; the persistent variant
    (q, g, u through TMA) is checked to have launched. In the interpreter the Triton kernels run (Gluon compiles
    for GPUs only)."""
    from titan_megamoe.kernels.common import INTERPRET

    case = make_case(T, 128, H, E, K, routing, device=DEVICE, seed=T + H)
    plan = build_routing_plan(case.ids, E, 128)
    N = plan.num_rows
    gen = torch.Generator().manual_seed(T + H)
    q, g, u = (torch.randn(N, H, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3))
    q[0, :128] = 0
    g[-1, -128:] *= 1e3
    scores = case.scores.reshape(-1).float()
    monkeypatch.setattr(dg_mod, "_FP8_DSWIGLU_GLUON", variant)
    if INTERPRET:  # the interpreter runs the Triton kernels: the launches name them
        launched = []
        real = dg_mod.launch
        monkeypatch.setattr(dg_mod, "launch", lambda fn, *a, **kw: (launched.append(fn), real(fn, *a, **kw)))
        _outputs(q, g, u, scores, plan)
        assert launched == [dg_mod._dswiglu_fp8_rows_kernel, dg_mod._dswiglu_fp8_tiles_kernel], launched
        return
    from titan_megamoe.kernels import dswiglu_fp8_gluon

    launched = []
    real = dswiglu_fp8_gluon.launch
    monkeypatch.setattr(dswiglu_fp8_gluon, "launch", lambda fn, *a, **kw: (launched.append(fn), real(fn, *a, **kw)))
    got = _outputs(q, g, u, scores, plan)
    persistent = dswiglu_fp8_gluon._dswiglu_fp8_persistent_kernel
    assert launched == [persistent if variant[2] else dswiglu_fp8_gluon._dswiglu_fp8_kernel], launched
    _path(monkeypatch, split=False)
    want = _outputs(q, g, u, scores, plan)
    for name, w in want.items():
        if name == "ds_part":  # fp32 sums over 128 columns: the summation order may differ (its rounding only)
            torch.testing.assert_close(got[name], w, rtol=0, atol=1e-5 * float(w.abs().max()))
        else:
            assert torch.equal(_bits(got[name]), _bits(w)), name


def test_gluon_kernel_host_path(monkeypatch):
    """The Gluon launcher's host code with the launch stubbed (runs on CPU): grid and argument order."""
    from titan_megamoe.kernels import dswiglu_fp8_gluon

    calls = []
    monkeypatch.setattr(dswiglu_fp8_gluon, "launch", lambda fn, grid, *args, **kw: calls.append((fn, grid, args, kw)))
    case = make_case(60, 128, 384, 6, 2, "empty_experts", device=DEVICE, seed=1)
    plan = build_routing_plan(case.ids, 6, 128)
    q = torch.zeros(plan.num_rows, 384, device=DEVICE)
    rows, tiles = [torch.empty(i, device=DEVICE) for i in range(4)], [torch.empty(i, device=DEVICE) for i in range(6)]
    ds = torch.empty(9, device=DEVICE)
    dswiglu_fp8_gluon.dswiglu_fp8(q, q, q, q[:, 0], plan, rows, tiles, ds, 8, False, False)
    (fn, grid, args, kw), = calls
    assert fn is dswiglu_fp8_gluon._dswiglu_fp8_kernel and grid == (plan.layout.num_tiles * 3,)
    assert list(args[8:12]) == rows and list(args[12:18]) == tiles and args[18] is ds
    assert args[19:] == (384, plan.layout.num_tiles * 128) and kw == dict(EXACT_CAST=False, num_warps=8)
    # the persistent kernel (bf16 q, g, u through TMA)
    qb = torch.zeros(plan.num_rows, 384, device=DEVICE, dtype=torch.bfloat16)
    calls.clear()
    dswiglu_fp8_gluon.dswiglu_fp8(qb, qb, qb, q[:, 0], plan, rows, tiles, ds, 8, False, True)
    (fn, grid, args, kw), = calls
    assert fn is dswiglu_fp8_gluon._dswiglu_fp8_persistent_kernel
    assert kw == dict(EXACT_CAST=False, num_warps=8)

