"""The Gluon block-FP8 row GEMM (`kernels.fp8_rows_gluon`: GEMM2, dgrad's q, dx with the promotion
overlapped) against the Triton kernel it stands in for, and its config rules.

Gluon does not run in Triton's CPU interpreter, so on CPU the kernel is compiled for sm_90 (what the
overlap is: the main loop waits with one wgmma group still in flight) and the config checks run; on a
GPU its outputs are compared with the Triton kernel's on the same quantized operands, outputs poisoned.
"""

import pytest
import torch

from moe_cases import GEMM1_ONE_PASS_STACK, make_ids, sm90_compile_results, stack_bytes

from titan_megamoe.kernels import configs
from titan_megamoe.kernels.configs import TileConfig, override_tile_config

GPU = torch.cuda.is_available()

_SM90_GLUON = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import gluon_rows, gluon_rows_ws
jobs = {"gemm2 64x128 4 warps": gluon_rows(), "dgrad q 64x128 4 warps": gluon_rows(sorted_out=True),
        "gemm2 128x128 8 warps": gluon_rows(block_m=128, num_warps=8),
        "gemm2 persistent, warp-specialised": gluon_rows_ws(),
        "dgrad q persistent, warp-specialised": gluon_rows_ws(sorted_out=True),
        "gemm2 persistent, warp-specialised, 256 columns": gluon_rows_ws(block_n=256, stages=4),
        "dgrad q persistent, warp-specialised, 256 columns": gluon_rows_ws(block_n=256, stages=3, sorted_out=True)}
print(json.dumps({k: {f: r[f] for f in ("qgmma", "usage", "wgmma_waits")} for k, r in jobs.items()}))
"""


def test_gluon_rows_compile_with_one_wgmma_group_in_flight():
    """Compiled for sm_90 on the CPU: FP8 wgmma, no spill, and inside the K loop a wait that leaves one
    group outstanding (`wgmma.wait_group 1`: block k's MMA runs while block k-1's product is scaled), the
    last block waited for fully. The Triton kernels wait for 0 after every MMA."""
    got = sm90_compile_results(_SM90_GLUON, timeout=300)
    for name, r in got.items():
        assert r["qgmma"] > 0, f"{name}: no QGMMA in the SASS"
        # 256 columns: a few 32-bit values kept on the stack at the kernel's entry (168 registers a thread until
        # the partitions take theirs) and around each item's start and store, none in the K loop: 8 bytes in
        # Triton 3.6's compile, 24 in 3.9's. 128 columns with the row scales staged (`STAGED_SCALES`): one
        # shared-memory offset computed at the entry, reloaded at each item (8 bytes). A bound: more is a
        # regression
        allowed = 32 if "256" in name else 8 if "warp-specialised" in name else 0
        assert stack_bytes(r["usage"]) <= allowed, f"{name}: register spills: {r['usage']}"
        # the warp-specialised loop waits for each MMA (its two consumer warpgroups, one wait each in the
        # PTX, cover each other); with 256 columns each consumer waits for two MMAs and, between them, once
        # with nothing in flight (the first promotion ordered before the second MMA)
        want = (["0"] * 6 if "256" in name else ["0", "0"]) if "warp-specialised" in name else ["1", "0"]
        assert r["wgmma_waits"] == want, f"{name}: wgmma waits {r['wgmma_waits']}, want {want}"


@pytest.mark.parametrize("kernel,cfg,message", [
    ("wgrad_w2", TileConfig(128, 128, 128, 8, 4, tma=True, gluon=True),
     "warp_specialize=True for the weight gradients"),
    ("wgrad_w13", TileConfig(128, 64, 128, 8, 4, tma=True, gluon=True, warp_specialize=True),
     "block_n 128 for the weight gradients"),
    ("gemm1_swiglu", TileConfig(64, 128, 128, 4, 4, tma=True, gluon=True), "block_n 64 for gemm1"),
    ("gemm2", TileConfig(64, 128, 128, 4, 4, gluon=True), "tma=True"),
    ("gemm2", TileConfig(64, 128, 64, 4, 4, tma=True, gluon=True), "block_k 128"),
    ("gemm2", TileConfig(64, 128, 128, 8, 4, tma=True, gluon=True), "16 * num_warps"),
    ("dgrad_swiglu", TileConfig(64, 128, 128, 4, 4, tma=True, gluon=True), "split=True for dgrad"),
    ("dx", TileConfig(64, 256, 128, 4, 4, tma=True, gluon=True), "block_n dividing 128"),
    ("dx", TileConfig(64, 128, 128, 4, 4, tma=True, gluon=True, warp_specialize=True), "block_m 128 and num_warps 8"),
    ("gemm1_swiglu", TileConfig(128, 64, 128, 8, 4, tma=True, warp_specialize=True), "to the gluon kernels only"),
    ("gemm1_swiglu", TileConfig(64, 64, 128, 4, 4, tma=True, gluon=True, warp_specialize=True), "block_m 128"),
    ("wgrad_w2", TileConfig(128, 256, 128, 8, 4, tma=True, gluon=True, warp_specialize=True),
     "block_n 128 for the weight gradients"),
    ("gemm1_swiglu", TileConfig(128, 256, 128, 8, 3, tma=True, gluon=True, warp_specialize=True),
     "or 128 with warp_specialize"),
])
def test_gluon_config_rules(kernel, cfg, message):
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        with override_tile_config(kernel, cfg):
            pass


@pytest.mark.parametrize("kernel,block_n", [("gemm2", 256), ("dgrad_swiglu", 256), ("dx", 256), ("gemm1_swiglu", 128)])
def test_gluon_wide_ws_configs_accepted(kernel, block_n):
    """The warp-specialised kernels' wide items: 256 columns for the row GEMMs, GEMM1's 128 in one pass."""
    cfg = TileConfig(128, block_n, 128, 8, 3, tma=True, split=kernel == "dgrad_swiglu", gluon=True,
                     warp_specialize=True)
    with override_tile_config(kernel, cfg):
        pass


def test_gluon_config_rejected_for_bf16_table_entries(tmp_path):
    import json

    from titan_megamoe.kernels.configs import use_tile_table

    path = tmp_path / "table.json"
    cfg = TileConfig(64, 128, 128, 4, 4, tma=True, gluon=True).to_record()
    path.write_text(json.dumps({"configs": {"bf16": {"2048x768": {"gemm2": cfg}}}}))
    with pytest.raises(ValueError, match="not to bf16"):
        use_tile_table(path)
    path.write_text(json.dumps({"configs": {"fp8": {"2048x768": {"gemm2": cfg}}}}))
    try:
        assert use_tile_table(path)
    finally:
        use_tile_table(None)


def test_gluon_config_stops_in_the_interpreter():
    """Forced onto a launch the interpreter runs, the gluon config is an error that names why, not a quiet
    switch to the Triton kernel."""
    if GPU:
        pytest.skip("checks the interpreter's message; the GPU runs the kernel (test below)")
    from titan_megamoe.kernels.grouped_gemm import expert_down_proj
    from titan_megamoe.kernels.quantize import quantize_rows, quantize_weight_pair
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    T, K, E, D, H = 8, 2, 4, 128, 128
    ids = make_ids(T, E, K, "random", torch.Generator().manual_seed(0))
    plan = build_routing_plan(ids, E, 128)
    h = quantize_rows(torch.randn(T * K, H, dtype=torch.bfloat16))
    w2, _ = quantize_weight_pair(torch.randn(E, D, H, dtype=torch.bfloat16))
    with override_tile_config("gemm2", TileConfig(64, 64, 128, 4, 1, tma=True, gluon=True)):
        with pytest.raises(ValueError, match="cannot run Gluon"):
            expert_down_proj(h, w2, plan, torch.bfloat16, "fp8")


GPU_CASES = [  # T, D, H, E, K, routing
    pytest.param(16384, 2048, 768, 128, 8, "random", id="30b-a3b"),
    pytest.param(4096, 4096, 1536, 128, 8, "skewed", id="235b-a22b-skewed"),
    pytest.param(777, 512, 256, 40, 5, "empty_experts", id="odd-empty-experts"),
    pytest.param(300, 256, 384, 8, 2, "one_expert", id="one-hot-expert"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="Gluon kernels need a CUDA GPU (Triton's interpreter cannot run them)")
@pytest.mark.parametrize("shape", [(64, 128, 4, 4, False), (128, 128, 8, 3, False), (64, 64, 4, 3, False),
                                   (128, 128, 8, 4, True), (128, 64, 8, 2, True), (128, 256, 8, 3, True),
                                   (128, 256, 8, 2, True), (128, 128, 8, 4, True, True), (128, 256, 8, 3, True, True),
                                   (128, 256, 8, 3, True, None, 4), (128, 128, 8, 4, True, True, 3)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("T,D,H,E,K,routing", GPU_CASES)
def test_gluon_rows_match_the_triton_kernel(monkeypatch, T, D, H, E, K, routing, shape):
    """GEMM2, dgrad's q and dx through the Gluon kernels (ws: the persistent warp-specialised one) equal the
    Triton kernel's outputs on the same quantized operands to within one bf16 rounding (both add the K blocks' scaled products in the same
    order into fp32), every row written (outputs NaN-poisoned first). 256 columns: where N is no multiple of 256
    (dgrad's q at H=384) the launch takes 128-column tiles. A sixth field: the warp-specialised kernel's row
    scales staged by its producer (`fp8_rows_ws_gluon.STAGED_SCALES`) or not (None: the default); a seventh:
    group_m (items in groups of rows down each column block). The Triton kernel runs its own tiles
    (`configs._GPU_DEFAULTS_FP8_TRITON`), whatever the table or the defaults ship."""
    from titan_megamoe.kernels import fp8_rows_ws_gluon
    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels.quantize import quantize_rows, quantize_weight_pair
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")
    block_m, block_n, warps, stages, ws, *rest = shape
    staged, group_m = rest[0] if rest else None, rest[1] if len(rest) > 1 else 1
    if staged is not None:
        monkeypatch.setattr(fp8_rows_ws_gluon, "STAGED_SCALES", staged)
    torch.manual_seed(T)
    ids = make_ids(T, E, K, routing, torch.Generator().manual_seed(T)).cuda()
    plan = build_routing_plan(ids, E, 128)
    N = T * K
    w1, w3 = (torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16) / D**0.5 for _ in range(2))
    w2 = torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16) / H**0.5
    (_, w1t), (_, w3t), (w2q, w2t) = (quantize_weight_pair(w) for w in (w1, w3, w2))
    dout, h, dg, du = (quantize_rows(torch.randn(N, c, device="cuda", dtype=torch.bfloat16)) for c in (D, H, H, H))
    calls = {
        "dgrad_swiglu": lambda: gg.expert_h_grad(dout, w2t, plan, torch.bfloat16, "fp8"),
        "gemm2": lambda: gg.expert_down_proj(h, w2q, plan, torch.bfloat16, "fp8"),
        "dx": lambda: gg.expert_input_grad(dg, du, w1t, w3t, plan, torch.bfloat16, "fp8"),
    }
    for kernel, call in calls.items():
        with override_tile_config(kernel, configs._GPU_DEFAULTS_FP8_TRITON[kernel]):
            want = call()
        cfg = TileConfig(block_m, block_n, 128, warps, stages, tma=True, split=kernel == "dgrad_swiglu", gluon=True,
                         warp_specialize=ws, group_m=group_m)
        with override_tile_config(kernel, cfg):
            got = call()
        assert not got.isnan().any(), f"{kernel}: rows left unwritten (NaN poison)"
        diff = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)
        assert diff.max() <= 2**-7, f"{kernel}: max relative difference {diff.max():.3e} from the Triton kernel"


@pytest.mark.parametrize("two_pairs", [False, True])
def test_gluon_launcher_host_path(monkeypatch, two_pairs):
    """Everything `fp8_row_gemm` and `fp8_row_gemm_ws` do on the host, on CPU with the launch stubbed (the
    kernels need a GPU): descriptors over the right matrices and blocks, the grid over (plan tiles x sub-tiles
    x N-tiles) or one program per multiprocessor, the K blocks of both pairs, the output returned."""
    from titan_megamoe.kernels import fp8_rows_gluon as m
    from titan_megamoe.kernels.quantize import quantize_rows, quantize_weight_pair
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    T, K, E, D, H = 40, 2, 4, 256, 384
    dev = "cuda" if GPU else "cpu"  # the operands are made by real kernels; only the Gluon launch is stubbed
    ids = make_ids(T, E, K, "skewed", torch.Generator().manual_seed(1)).to(dev)
    plan = build_routing_plan(ids, E, 128)
    a = quantize_rows(torch.randn(T * K, H, dtype=torch.bfloat16, device=dev))
    _, wt = quantize_weight_pair(torch.randn(E, H, D, dtype=torch.bfloat16, device=dev))  # W^T [E, D, H]: n = D, k = H
    seen = {}
    monkeypatch.setattr(m, "launch", lambda kernel, grid, *args, **kw: seen.update(kernel=kernel, grid=grid, args=args,
                                                                                     kw=kw))
    pair2 = dict(a2=a, b2=wt) if two_pairs else {}
    out = m.fp8_row_gemm(a, wt, plan, D, torch.bfloat16, block_m=64, block_n=128, num_warps=4, stages=3, **pair2)
    assert out.shape == (T * K, D) and out.dtype == torch.bfloat16
    assert seen["kernel"] is m._fp8_rows_kernel
    assert seen["grid"] == (plan.layout.num_tiles * 2 * (D // 128),)
    descs = seen["args"][:4]
    assert [list(d.block_shape) for d in descs] == [[64, 128], [128, 128]] * 2
    assert list(descs[1].shape) == [E * D, H]  # the weight viewed as a matrix, expert e at rows e * D
    N, KD, ND, NK1 = seen["args"][-4:]
    assert (N, KD, ND) == (T * K, H, D) and NK1 == (2 if two_pairs else 1) * H // 128
    assert seen["kw"] == dict(SORTED_OUT=False, BLOCK_M=64, SUB_TILES=2, BLOCK_N=128, STAGES=3, num_warps=4)

    from titan_megamoe.kernels import fp8_rows_ws_gluon as ws

    monkeypatch.setattr(ws, "launch", lambda kernel, grid, *args, **kw: seen.update(kernel=kernel, grid=grid, args=args,
                                                                                      kw=kw))
    monkeypatch.setattr(ws, "multiprocessors", lambda device: 3)
    out = ws.fp8_row_gemm_ws(a, wt, plan, D, torch.bfloat16, stages=4, **pair2)
    assert out.shape == (T * K, D) and seen["kernel"] is ws._fp8_rows_ws_kernel
    items = plan.layout.num_tiles * (D // 128)
    assert seen["grid"] == (min(items, 3),) and seen["args"][-1] == items  # one program per multiprocessor
    assert [list(d.block_shape) for d in seen["args"][:4]] == [[64, 128], [128, 128]] * 2  # A in 64-row halves
    assert seen["args"][-2] == (2 if two_pairs else 1) * H // 128
    # 12 warps at launch (two consumer warpgroups and the producer's): 65536 / (12 * 32) registers, down to 8
    assert seen["kw"]["maxnreg"] == 168 and seen["kw"]["num_warps"] == 4
    # 256-column items: the weight tile 256 rows, half as many items
    ws.fp8_row_gemm_ws(a, wt, plan, D, torch.bfloat16, block_n=256, stages=3, **pair2)
    assert [list(d.block_shape) for d in seen["args"][:4]] == [[64, 128], [256, 128]] * 2
    assert seen["args"][-1] == plan.layout.num_tiles * (D // 256) and seen["kw"]["BLOCK_N"] == 256
    # the row scales staged by the producer: its registers for the copies' addresses
    for staged in (False, True):
        ws.fp8_row_gemm_ws(a, wt, plan, D, torch.bfloat16, stages=4, staged_scales=staged, **pair2)
        assert seen["kw"]["STAGED_SCALES"] is staged
        assert seen["kw"]["PRODUCER_REGS"] == (ws.STAGING_PRODUCER_REGS if staged else ws.PRODUCER_REGS)


# ------------------------------------------------------------------------------------------------ GEMM1

_SM90_GLUON_GEMM1 = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import gluon_gemm1, gluon_gemm1_ws
jobs = {"64 rows 4 warps": gluon_gemm1(), "128 rows 8 warps": gluon_gemm1(128, 8, 3),
        "persistent, warp-specialised": gluon_gemm1_ws(),
        "persistent, warp-specialised, one pass": gluon_gemm1_ws(stages=3, block_n=128)}
print(json.dumps({k: {f: r[f] for f in ("qgmma", "usage", "wgmma_waits")} for k, r in jobs.items()}))
"""


def test_gluon_gemm1_compiles_with_two_wgmma_groups_in_flight():
    """Compiled for sm_90 on the CPU: FP8 wgmma, and in each half's K loop a wait that leaves K block k's
    two MMAs (gate, up) in flight while block k-1's products are scaled; each half's last block waited for
    fully. The warp-specialised kernel (one MMA for gate and up) waits for each, in each consumer's two
    halves; in one pass (128 columns) for the gate's MMA, once with nothing in flight (its promotion ordered
    before the up MMA) and for the up's. No spill in them, but for the one-pass kernel's 8 bytes
    (`moe_cases.GEMM1_ONE_PASS_STACK`)."""
    for name, r in sm90_compile_results(_SM90_GLUON_GEMM1, timeout=300).items():
        assert r["qgmma"] > 0, f"{name}: no QGMMA in the SASS"
        want = (["0"] * 6 if "one pass" in name else ["0"] * 4) if "warp-specialised" in name else ["2", "0", "2", "0"]
        assert r["wgmma_waits"] == want, f"{name}: wgmma waits {r['wgmma_waits']}"
        if "warp-specialised" in name:
            allowed = GEMM1_ONE_PASS_STACK if "one pass" in name else 0
            assert stack_bytes(r["usage"]) <= allowed, f"{name}: spills: {r['usage']}"


def test_gluon_gemm1_config_stops_in_the_interpreter():
    if GPU:
        pytest.skip("checks the interpreter's message; the GPU runs the kernel (test below)")
    from titan_megamoe.kernels.gemm1_swiglu import gemm1_swiglu
    from titan_megamoe.kernels.quantize import quantize_sorted_rows, quantize_weight_pair
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    T, K, E, D, H = 8, 2, 4, 128, 128
    plan = build_routing_plan(make_ids(T, E, K, "random", torch.Generator().manual_seed(0)), E, 128)
    x = quantize_sorted_rows(torch.randn(T, D, dtype=torch.bfloat16), plan)
    w1, _ = quantize_weight_pair(torch.randn(E, H, D, dtype=torch.bfloat16))
    with override_tile_config("gemm1_swiglu", TileConfig(64, 64, 128, 4, 1, tma=True, gluon=True)):
        with pytest.raises(ValueError, match="cannot run Gluon"):
            gemm1_swiglu(x, w1, w1, plan, torch.bfloat16, "fp8", sorted_rows=True)


def test_gluon_gemm1_launcher_host_path(monkeypatch):
    """`fp8_gemm1` on the host, on CPU with the launch stubbed: descriptors, grid (plan tiles x sub-tiles x
    128-column blocks), the outputs it returns."""
    from titan_megamoe.kernels import fp8_gemm1_gluon as m
    from titan_megamoe.kernels.quantize import quantize_sorted_rows, quantize_weight_pair
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    T, K, E, D, H = 40, 2, 4, 256, 384
    dev = "cuda" if GPU else "cpu"  # the operands are made by real kernels; only the Gluon launch is stubbed
    plan = build_routing_plan(make_ids(T, E, K, "skewed", torch.Generator().manual_seed(1)).to(dev), E, 128)
    x = quantize_sorted_rows(torch.randn(T, D, dtype=torch.bfloat16, device=dev), plan)
    w1, _ = quantize_weight_pair(torch.randn(E, H, D, dtype=torch.bfloat16, device=dev))
    seen = {}
    monkeypatch.setattr(m, "launch", lambda kernel, grid, *args, **kw: seen.update(kernel=kernel, grid=grid, args=args,
                                                                                     kw=kw))
    g, u, h = m.fp8_gemm1(x, w1, w1, plan, block_m=64, num_warps=4, stages=3)
    assert g.shape == u.shape == h.data.shape == (T * K, H) and h.scale.shape == (T * K, H // 128)
    assert seen["kernel"] is m._fp8_gemm1_kernel and seen["grid"] == (plan.layout.num_tiles * 2 * (H // 128),)
    descs = seen["args"][:3]
    assert [list(d.block_shape) for d in descs] == [[64, 128], [64, 128], [64, 128]]
    assert list(descs[1].shape) == [E * H, D]
    assert seen["args"][-3:] == (T * K, D, H)
    assert seen["kw"] == dict(BLOCK_M=64, SUB_TILES=2, STAGES=3, num_warps=4)

    from titan_megamoe.kernels import fp8_gemm1_ws_gluon as ws
    from titan_megamoe.kernels import fp8_rows_ws_gluon  # its launch_ws launches every warp-specialised kernel

    monkeypatch.setattr(fp8_rows_ws_gluon, "launch", lambda kernel, grid, *args, **kw: seen.update(
        kernel=kernel, grid=grid, args=args, kw=kw))
    monkeypatch.setattr(fp8_rows_ws_gluon, "multiprocessors", lambda device: 5)
    g, u, h = ws.fp8_gemm1_ws(x, w1, w1, plan, stages=4)
    assert g.shape == u.shape == h.data.shape == (T * K, H) and h.scale.shape == (T * K, H // 128)
    items = plan.layout.num_tiles * (H // 128)
    assert seen["kernel"] is ws._fp8_gemm1_ws_kernel and seen["grid"] == (min(items, 5),)
    assert [list(d.block_shape) for d in seen["args"][:3]] == [[64, 128], [64, 128], [64, 128]]
    assert seen["args"][-4:] == (T * K, D, H, items) and seen["kw"]["maxnreg"] == 168
    assert seen["kw"]["BLOCK_N"] == 64
    ws.fp8_gemm1_ws(x, w1, w1, plan, stages=3, block_n=128)  # one pass: W1's and W3's tiles of 128 rows
    assert [list(d.block_shape) for d in seen["args"][:3]] == [[64, 128], [128, 128], [128, 128]]
    assert seen["args"][-1] == items and seen["kw"]["BLOCK_N"] == 128


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="Gluon kernels need a CUDA GPU (Triton's interpreter cannot run them)")
@pytest.mark.parametrize("shape", [(64, 64, 4, 4, False), (128, 64, 8, 3, False), (128, 64, 8, 4, True),
                                   (128, 64, 8, 2, True), (128, 128, 8, 3, True), (128, 128, 8, 2, True),
                                   (128, 128, 8, 3, True, 4), (128, 64, 8, 3, True, 16)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("T,D,H,E,K,routing", GPU_CASES)
def test_gluon_gemm1_matches_the_triton_kernel(monkeypatch, T, D, H, E, K, routing, shape):
    """GEMM1 through the Gluon kernels (ws: the persistent warp-specialised one): g and u within one bf16 rounding of the Triton kernel's on the same
    quantized operands, h's e4m3 rows dequantized within 1% (L2) of the Triton kernel's (a bf16 rounding
    of g or u may move an h code), every row written (outputs NaN-poisoned first). A sixth field: group_m.
    The Triton kernel runs its own tiles (`configs._GPU_DEFAULTS_FP8_TRITON`)."""
    from titan_megamoe.kernels.gemm1_swiglu import gemm1_swiglu
    from titan_megamoe.kernels.quantize import quantize_sorted_rows, quantize_weight_pair
    from titan_megamoe.kernels.routing_meta import build_routing_plan
    from titan_megamoe.quant import dequantize

    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")
    block_m, block_n, warps, stages, ws, *group_m = shape
    torch.manual_seed(T)
    plan = build_routing_plan(make_ids(T, E, K, routing, torch.Generator().manual_seed(T)).cuda(), E, 128)
    x = quantize_sorted_rows(torch.randn(T, D, device="cuda", dtype=torch.bfloat16), plan)
    w1, w3 = (quantize_weight_pair(torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16) / D**0.5)[0]
              for _ in range(2))

    def call():
        return gemm1_swiglu(x, w1, w3, plan, torch.bfloat16, "fp8", sorted_rows=True)

    with override_tile_config("gemm1_swiglu", configs._GPU_DEFAULTS_FP8_TRITON["gemm1_swiglu"]):
        want = call()
    cfg = TileConfig(block_m, block_n, 128, warps, stages, tma=True, gluon=True, warp_specialize=ws,
                     group_m=group_m[0] if group_m else 1)
    with override_tile_config("gemm1_swiglu", cfg):
        got = call()
    for name, a, b in (("g", got[0], want[0]), ("u", got[1], want[1])):
        assert not a.isnan().any(), f"{name}: rows left unwritten (NaN poison)"
        diff = (a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-2)
        assert diff.max() <= 2**-7, f"{name}: max relative difference {diff.max():.3e} from the Triton kernel"
    h_got, h_want = dequantize(got[2]).float(), dequantize(want[2]).float()
    assert not h_got.isnan().any() and not got[2].scale.isnan().any(), "h: rows left unwritten (NaN poison)"
    assert (h_got - h_want).norm() <= 1e-2 * h_want.norm()


@pytest.mark.parametrize("rows,dtype_name", [(64, "float8e4nv"), (128, "float8e4nv"), (128, "bfloat16"),
                                             (256, "float8e4nv")])
def test_descriptor_layout_is_gluons_default_made_once(rows, dtype_name):
    """The Gluon descriptors' shared-memory layout comes from a cache (`_tile_layout`): equal to what
    `NVMMASharedLayout.get_default_for` makes for those tiles, and the same object on every call."""
    from triton.experimental.gluon import language as gl

    from titan_megamoe.kernels.fp8_rows_gluon import SCALE_BLOCK, _descriptor

    dtype = getattr(gl, dtype_name)
    t = torch.empty(2, 256, 384, dtype=torch.bfloat16 if dtype_name == "bfloat16" else torch.float8_e4m3fn)
    first, again = _descriptor(t, rows, dtype), _descriptor(t[1:], rows, dtype)
    assert first.layout == gl.NVMMASharedLayout.get_default_for([rows, SCALE_BLOCK], dtype)
    assert again.layout is first.layout
    assert list(first.block_shape) == [rows, SCALE_BLOCK] and list(first.shape) == [512, 384]
