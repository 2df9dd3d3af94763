"""The persistent warp-specialised Gluon bf16 row GEMM (`kernels.bf16_rows_ws_gluon`: GEMM2, dgrad's q, dx)
against the Triton kernels it would stand in for.

Gluon does not run in Triton's CPU interpreter, so on CPU the kernel is compiled for sm_90 (bf16 wgmma, no
spill, one MMA kept in flight); on a GPU its outputs are compared with the Triton kernels' on the same
operands, outputs poisoned.
"""

import re

import pytest
import torch

from moe_cases import make_ids, sm90_compile_results

GPU = torch.cuda.is_available()

_SM90 = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import gluon_bf16_rows_ws
jobs = {"gemm2 256 columns, 3 stages": gluon_bf16_rows_ws(256, 3, b_trans=True),
        "gemm2 256 columns, 4 stages": gluon_bf16_rows_ws(256, 4, b_trans=True),
        "dx 256 columns, 3 stages": gluon_bf16_rows_ws(256, 3, b_trans=False),
        "dgrad q 128 columns, 4 stages, group_m 8": gluon_bf16_rows_ws(128, 4, b_trans=False, sorted_out=True,
                                                                        group_m=8)}
print(json.dumps({k: {f: r[f] for f in ("hgmma", "usage", "wgmma_waits", "smem")} for k, r in jobs.items()}))
"""


def test_bf16_rows_ws_compile():
    """Compiled for sm_90 on the CPU: bf16 wgmma (HGMMA), no spill, within Hopper's 227 KB of shared memory,
    and in each consumer's K loop a wait that leaves one MMA in flight, the item's last one waited for fully
    (two consumers: the pattern twice in the PTX)."""
    got = sm90_compile_results(_SM90, timeout=300)
    for name, r in got.items():
        assert r["hgmma"] > 0, f"{name}: no HGMMA in the SASS"
        stack = re.search(r"STACK:(\d+)", r["usage"])
        assert stack is not None and int(stack.group(1)) == 0, f"{name}: register spills: {r['usage']}"
        assert r["smem"] <= 227 * 1024, f"{name}: {r['smem']} bytes of shared memory"
        assert r["wgmma_waits"] == ["1", "0", "1", "0"] or sorted(r["wgmma_waits"]) == ["0", "0", "1", "1"], \
            f"{name}: wgmma waits {r['wgmma_waits']}"


GPU_CASES = [  # T, D, H, E, K, routing
    pytest.param(16384, 2048, 768, 128, 8, "random", id="30b-a3b"),
    pytest.param(4096, 4096, 1536, 128, 8, "skewed", id="235b-a22b-skewed"),
    # D = 832: a last column block of 64 (256 columns) and an odd H; T*K no multiple of 128
    pytest.param(777, 832, 320, 40, 5, "empty_experts", id="odd-empty-experts"),
    pytest.param(300, 256, 384, 8, 2, "one_expert", id="one-hot-expert"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="Gluon kernels need a CUDA GPU (Triton's interpreter cannot run them)")
@pytest.mark.parametrize("block_n,stages,group_m", [(256, 3, 1), (256, 4, 1), (128, 4, 1), (256, 3, 8)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("T,D,H,E,K,routing", GPU_CASES)
def test_bf16_rows_ws_match_the_triton_kernels(monkeypatch, T, D, H, E, K, routing, block_n, stages, group_m):
    """GEMM2, dgrad's q and dx equal the Triton kernels' outputs on the same operands to within one bf16
    rounding (both sum the K blocks of 64 in order into fp32), every row written (outputs NaN-poisoned)."""
    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels.bf16_rows_ws_gluon import BLOCK_K, bf16_row_gemm_ws
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    if H % BLOCK_K.value or D % BLOCK_K.value:
        pytest.skip("K blocks of 64")
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")
    torch.manual_seed(T)
    ids = make_ids(T, E, K, routing, torch.Generator().manual_seed(T)).cuda()
    plan = build_routing_plan(ids, E, 128)
    N = T * K
    w1, w3 = (torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16) / D**0.5 for _ in range(2))
    w2 = torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16) / H**0.5
    dout, h, dg, du = (torch.randn(N, c, device="cuda", dtype=torch.bfloat16) for c in (D, H, H, H))
    bf = torch.bfloat16
    knobs = dict(plan=plan, block_n=block_n, stages=stages, group_m=group_m)
    cases = {
        "gemm2": (gg.expert_down_proj(h, w2, plan, bf, "bf16"), bf16_row_gemm_ws(h, w2, nd=D, b_trans=True, **knobs)),
        "dgrad q": (gg.expert_h_grad(dout, w2, plan, bf, "bf16"),
                    bf16_row_gemm_ws(dout, w2, nd=H, b_trans=False, sorted_out=True, **knobs)),
        "dx": (gg.expert_input_grad(dg, du, w1, w3, plan, bf, "bf16"),
               bf16_row_gemm_ws(dg, w1, nd=D, b_trans=False, a2=du, b2=w3, **knobs)),
    }
    for name, (want, got) in cases.items():
        assert not got.isnan().any(), f"{name}: rows left unwritten (NaN poison)"
        diff = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)
        assert diff.max() <= 2**-7, f"{name}: max relative difference {diff.max():.3e} from the Triton kernel"


@pytest.mark.parametrize("two_pairs", [False, True])
def test_bf16_rows_ws_launcher_host_path(monkeypatch, two_pairs):
    """Everything `bf16_row_gemm_ws` does on the host, on CPU with the launch stubbed (the kernel needs a GPU):
    descriptors over the right matrices and blocks for both weight layouts, one program per multiprocessor,
    the K blocks of both pairs, the output returned."""
    from titan_megamoe.kernels import fp8_rows_ws_gluon as ws
    from titan_megamoe.kernels.bf16_rows_ws_gluon import _bf16_rows_ws_kernel, bf16_row_gemm_ws
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    T, K, E, D, H = 40, 2, 4, 256, 384
    dev = "cuda" if GPU else "cpu"
    plan = build_routing_plan(make_ids(T, E, K, "skewed", torch.Generator().manual_seed(1)).to(dev), E, 128)
    a = torch.randn(T * K, H, dtype=torch.bfloat16, device=dev)
    w_kn = torch.randn(E, H, D, dtype=torch.bfloat16, device=dev)  # [E, KD, ND]: dx's W1
    w_nk = torch.randn(E, D, H, dtype=torch.bfloat16, device=dev)  # [E, ND, KD]: GEMM2's W2
    seen = {}
    monkeypatch.setattr(ws, "launch", lambda kernel, grid, *args, **kw: seen.update(kernel=kernel, grid=grid, args=args,
                                                                                      kw=kw))
    monkeypatch.setattr(ws, "multiprocessors", lambda device: 3)
    for b_trans, w, want_b in ((False, w_kn, ([64, 256], [E * H, D])), (True, w_nk, ([256, 64], [E * D, H]))):
        pair2 = dict(a2=a, b2=w) if two_pairs else {}
        out = bf16_row_gemm_ws(a, w, plan, D, b_trans, **pair2)
        assert out.shape == (T * K, D) and out.dtype == torch.bfloat16 and seen["kernel"] is _bf16_rows_ws_kernel
        items = plan.layout.num_tiles * 1  # D = 256: one 256-column block
        assert seen["grid"] == (min(items, 3),) and seen["args"][-1] == items
        descs = seen["args"][:4]
        assert [list(d.block_shape) for d in descs] == [[64, 64], want_b[0]] * 2
        assert list(descs[1].shape) == want_b[1]  # the weight as stored, viewed as a matrix
        KD, ND, total = seen["args"][-4:-1]
        assert (KD, ND) == (H, D) and total == (2 if two_pairs else 1) * H // 64
        assert seen["kw"]["B_TRANS"] is b_trans and seen["kw"]["BLOCK_N"] == 256 and seen["kw"]["maxnreg"] == 168
    with pytest.raises(AssertionError):  # a weight of the other layout
        bf16_row_gemm_ws(a, w_nk, plan, D, False)


@pytest.mark.parametrize("kernel", ["gemm2", "dgrad_swiglu", "dx"])
def test_bf16_gluon_configs_accepted_and_checked(tmp_path, kernel):
    """A bf16 table entry may ask for the Gluon row GEMM with its own shapes (K blocks of 64, two consumer
    warpgroups of 64 rows, 128 or 256 columns); other shapes, and the Gluon GEMM1 or weight gradients in bf16,
    are errors at load that name the fix."""
    import json

    from titan_megamoe.kernels.configs import TileConfig, override_tile_config, use_tile_table

    cfg = TileConfig(128, 256, 64, 8, 4, tma=True, split=kernel == "dgrad_swiglu", warp_specialize=True, gluon=True,
                     group_m=8)
    with override_tile_config(kernel, cfg):
        pass
    path = tmp_path / "table.json"
    try:
        path.write_text(json.dumps({"configs": {"bf16": {"2048x768": {kernel: cfg.to_record()}}}}))
        assert use_tile_table(path)
        bad = {"block_k 64": TileConfig(128, 256, 128, 8, 4, tma=True, split=kernel == "dgrad_swiglu",
                                        warp_specialize=True, gluon=True),
               "warp_specialize=True": TileConfig(128, 256, 64, 8, 4, tma=True, split=kernel == "dgrad_swiglu",
                                                  gluon=True),
               "block_m 128 and num_warps 8": TileConfig(64, 256, 64, 4, 4, tma=True, split=kernel == "dgrad_swiglu",
                                                         warp_specialize=True, gluon=True)}
        for message, wrong in bad.items():
            path.write_text(json.dumps({"configs": {"bf16": {"2048x768": {kernel: wrong.to_record()}}}}))
            with pytest.raises(ValueError, match=f"bf16 gluon kernel needs.*{message}"):
                use_tile_table(path)
        gemm1 = TileConfig(128, 128, 64, 8, 4, tma=True, warp_specialize=True, gluon=True).to_record()
        path.write_text(json.dumps({"configs": {"bf16": {"2048x768": {"gemm1_swiglu": gemm1}}}}))
        with pytest.raises(ValueError, match="one of gemm2, dgrad_swiglu, dx"):
            use_tile_table(path)
    finally:
        use_tile_table(None)
