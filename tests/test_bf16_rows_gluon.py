"""The bf16 GEMM2 in Gluon (`kernels.bf16_rows_ws_gluon`: persistent, warp-specialised, opt-in through a
gemm2 tile config with gluon) against the Triton kernel and an fp32 product, and its config rules.

Gluon does not run in Triton's CPU interpreter: on CPU the kernel is compiled for sm_90 (no spill, one
wgmma group in flight in the K loop, the ring within shared memory), the host path runs with the launch
stubbed and the config checks run; on a GPU its outputs are compared with the Triton kernel's and with an
fp32 product, outputs NaN-poisoned first.
"""

import re

import pytest
import torch

from moe_cases import make_ids, sm90_compile_results

from titan_megamoe.kernels.configs import TileConfig, override_tile_config
from titan_megamoe.validation import check_tile_config

GPU = torch.cuda.is_available()


def _ws(block_n=256, stages=4, **kw):
    """A bf16 gemm2 config that selects the Gluon kernel."""
    return TileConfig(128, block_n, 64, 8, stages, tma=True, warp_specialize=True, gluon=True, **kw)


_SM90 = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import gluon_bf16_rows_ws
from titan_megamoe.kernels.bf16_rows_ws_gluon import SMEM_BYTES
jobs = {f"{n} columns {s} stages": gluon_bf16_rows_ws(n, s) for n, s in ((128, 3), (128, 6), (256, 3), (256, 4))}
print(json.dumps({k: {**{f: r[f] for f in ("hgmma", "usage", "wgmma_waits", "smem")}, "limit": SMEM_BYTES}
                  for k, r in jobs.items()}))
"""


def test_compiles_with_one_wgmma_group_in_flight():
    """Compiled for sm_90 on the CPU: bf16 wgmma (a 64-element K block is four k16 MMAs per consumer), no
    spill, each consumer's K loop waiting with one group in flight and its item's end for none, and the
    deepest ring `max_stages` allows within an sm_90 program's shared memory."""
    for name, r in sm90_compile_results(_SM90, timeout=300).items():
        assert r["hgmma"] == 8, f"{name}: {r['hgmma']} HGMMA in the SASS, want 4 per consumer"
        stack = re.search(r"STACK:(\d+)", r["usage"])
        assert stack is not None and int(stack.group(1)) == 0, f"{name}: register spills: {r['usage']}"
        assert sorted(r["wgmma_waits"]) == ["0", "0", "1", "1"], f"{name}: wgmma waits {r['wgmma_waits']}"
        assert r["smem"] <= r["limit"], f"{name}: {r['smem']} bytes of shared memory"


def test_max_stages():
    from titan_megamoe.kernels.bf16_rows_ws_gluon import max_stages

    assert (max_stages(128), max_stages(256)) == (6, 4)


@pytest.mark.parametrize("cfg", [_ws(), _ws(128, 6), _ws(256, 2, group_m=8)], ids=["256x4", "128x6", "256x2-g8"])
def test_bf16_config_accepted(cfg, tmp_path):
    """gemm2's Gluon config for bf16: forced (no precision known) and as a bf16 table entry."""
    import json

    from titan_megamoe.kernels.configs import use_tile_table

    check_tile_config("gemm2", cfg, 128, "bf16")
    with override_tile_config("gemm2", cfg):
        pass
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"configs": {"bf16": {"2048x768": {"gemm2": cfg.to_record()}}}}))
    try:
        assert use_tile_table(path)
    finally:
        use_tile_table(None)


@pytest.mark.parametrize("kernel,cfg,message", [
    ("dx", _ws(), "gluon applies to bf16 gemm2 only"),
    ("dgrad_swiglu", _ws(split=True), "gluon applies to bf16 gemm2 only"),
    ("gemm1_swiglu", _ws(128), "gluon applies to bf16 gemm2 only"),
    ("wgrad_w2", _ws(128), "gluon applies to bf16 gemm2 only"),
    ("gemm2", _ws(64), "block_n 128 or 256"),
    ("gemm2", _ws(256, 5), "num_stages 2 to 4 with block_n 256"),
    ("gemm2", _ws(128, 1), "num_stages 2 to 6 with block_n 128"),
    ("gemm2", TileConfig(128, 256, 128, 8, 4, tma=True, warp_specialize=True, gluon=True), "block_k 64"),
    ("gemm2", TileConfig(128, 256, 64, 8, 4, tma=True, gluon=True), "warp_specialize=True"),
    ("gemm2", TileConfig(64, 128, 64, 4, 4, tma=True, warp_specialize=True, gluon=True), "block_m 128 and num_warps 8"),
    ("gemm2", TileConfig(128, 256, 64, 8, 4, warp_specialize=True, gluon=True), "tma=True"),
])
def test_bf16_config_rejected(kernel, cfg, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tile_config(kernel, cfg, 128, "bf16")


def test_forced_config_names_both_kernels_rules():
    """Forced without a precision, a gemm2 gluon config that fits neither kernel says what each needs."""
    with pytest.raises(ValueError, match=r"block_k 128 .*bf16's gemm2 kernel: .*block_n 128 or 256"):
        with override_tile_config("gemm2", TileConfig(128, 64, 64, 8, 4, tma=True, warp_specialize=True, gluon=True)):
            pass


def _operands(T, D, H, E, K, routing, device):
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    gen = torch.Generator().manual_seed(T)
    plan = build_routing_plan(make_ids(T, E, K, routing, gen).to(device), E, 128)
    h = torch.randn(T * K, H, generator=gen).to(device, torch.bfloat16)
    w2 = (torch.randn(E, D, H, generator=gen) / H**0.5).to(device, torch.bfloat16)
    return plan, h, w2


def test_host_path(monkeypatch):
    """Everything `bf16_row_gemm_ws` does on the host, on CPU with the launch stubbed: descriptors over h in
    64 x 64 halves and W2 as an [E*D, H] matrix in block_n x 64 tiles (128-byte swizzle: the K block's
    width), one program per multiprocessor over (plan tiles x column blocks) items, the constexprs."""
    from triton.experimental.gluon import language as gl

    from titan_megamoe.kernels import bf16_rows_ws_gluon as bf
    from titan_megamoe.kernels import fp8_rows_ws_gluon as ws

    T, K, E, D, H = 40, 2, 4, 1152, 384
    plan, h, w2 = _operands(T, D, H, E, K, "skewed", "cuda" if GPU else "cpu")
    seen = {}
    monkeypatch.setattr(ws, "launch", lambda kernel, grid, *args, **kw: seen.update(kernel=kernel, grid=grid, args=args,
                                                                                      kw=kw))
    monkeypatch.setattr(ws, "multiprocessors", lambda device: 3)
    for block_n, stages in ((256, 4), (128, 3)):
        out = bf.bf16_row_gemm_ws(h, w2, plan, D, torch.bfloat16, block_n=block_n, stages=stages)
        assert out.shape == (T * K, D) and out.dtype == torch.bfloat16 and seen["kernel"] is bf._bf16_rows_ws_kernel
        a_desc, b_desc = seen["args"][:2]
        assert [list(a_desc.block_shape), list(b_desc.block_shape)] == [[64, 64], [block_n, 64]]
        assert list(b_desc.shape) == [E * D, H] and a_desc.layout.swizzle_byte_width == 128
        assert b_desc.layout == gl.NVMMASharedLayout.get_default_for([block_n, 64], gl.bfloat16)
        items = plan.layout.num_tiles * -(-D // block_n)  # D = 1152: the last 256-column block half past D
        assert seen["grid"] == (min(items, 3),) and seen["args"][-4:] == (T * K, H, D, items)
        assert seen["kw"]["BLOCK_N"] == block_n and seen["kw"]["STAGES"] == stages
        assert seen["kw"]["CONSUMER_REGS"] == ws.consumer_regs(block_n) and seen["kw"]["maxnreg"] == 168
    with pytest.raises(AssertionError, match="stages 5"):
        bf.bf16_row_gemm_ws(h, w2, plan, D, torch.bfloat16, block_n=256, stages=5)
    with pytest.raises(AssertionError, match="multiple of 64"):
        bf.bf16_row_gemm_ws(h[:, :96], w2[:, :, :96].contiguous(), plan, D, torch.bfloat16)


def test_launch_selects_the_kernel_and_refuses_what_it_does_not_cover(monkeypatch):
    """Through `grouped_gemm`: a bf16 gemm2 launch whose config sets gluon goes to `bf16_row_gemm_ws` with the
    config's tiles; dx with gluon, the interpreter and expert parallelism's peer stores are errors that say
    so (not a quiet switch to the Triton kernel)."""
    from titan_megamoe.kernels import grouped_gemm as gg

    T, K, E, D, H = 40, 2, 4, 256, 128
    plan, h, w2 = _operands(T, D, H, E, K, "random", "cuda" if GPU else "cpu")
    seen = {}
    monkeypatch.setattr(gg, "bf16_row_gemm_ws", lambda *a, **kw: seen.update(args=a, kw=kw) or "out")
    monkeypatch.setattr(gg, "INTERPRET", False)  # the launch as on a GPU (the kernel itself is stubbed)
    with override_tile_config("gemm2", _ws(128, 3, group_m=4)):
        assert gg.expert_down_proj(h, w2, plan, torch.bfloat16, "bf16") == "out"
    assert seen["args"][:4] == (h, w2, plan, D)
    assert {k: seen["kw"][k] for k in ("block_n", "stages", "group_m", "sorted_out")} == dict(
        block_n=128, stages=3, group_m=4, sorted_out=False)
    with override_tile_config("gemm2", _ws()):
        with pytest.raises(ValueError, match="no expert parallelism"):
            gg.expert_down_proj(h, w2, plan, torch.bfloat16, "bf16", peers=gg.PeerRows(h.new_empty(T * K, D),
                                                                                      torch.zeros(T * K)))
        with pytest.raises(ValueError, match="operands TMA can cover"):
            gg.expert_down_proj(h, w2.transpose(1, 2).contiguous().transpose(1, 2), plan, torch.bfloat16, "bf16")
    monkeypatch.undo()
    if not GPU:
        with override_tile_config("gemm2", _ws()):
            with pytest.raises(ValueError, match="cannot run Gluon"):
                gg.expert_down_proj(h, w2, plan, torch.bfloat16, "bf16")


def test_bf16_dx_gluon_is_an_error():
    """bf16 dx (or dgrad) with a gluon config forced past the table checks: the launch refuses it."""
    from titan_megamoe.kernels import grouped_gemm as gg

    T, K, E, D, H = 40, 2, 4, 256, 128
    plan, dg, _ = _operands(T, D, H, E, K, "random", "cuda" if GPU else "cpu")
    w1 = torch.randn(E, H, D, dtype=torch.bfloat16, device=dg.device)
    cfg = TileConfig(128, 128, 128, 8, 3, tma=True, warp_specialize=True, gluon=True)  # valid for FP8's dx
    with override_tile_config("dx", cfg):
        with pytest.raises(ValueError, match="gluon runs bf16 only as the warp-specialised gemm2"):
            gg.expert_input_grad(dg, dg, w1, w1, plan, torch.bfloat16, "bf16")


def _reference(h, w2, plan):
    """y [N, D] in fp32: each expert's sorted rows times its weight, scattered to routed-row order."""
    off = plan.offsets_E1.tolist()
    order = plan.order_N.long()
    y = torch.zeros(h.shape[0], w2.shape[1], dtype=torch.float32, device=h.device)
    for e in range(w2.shape[0]):
        if off[e + 1] > off[e]:
            y[order[off[e]:off[e + 1]]] = h[off[e]:off[e + 1]].float() @ w2[e].float().T
    return y


GPU_CASES = [  # T, D, H, E, K, routing
    pytest.param(4096, 2048, 768, 128, 8, "random", id="30b-a3b"),
    pytest.param(777, 1152, 384, 40, 5, "empty_experts", id="odd-empty-experts"),  # D = 4.5 x 256
    pytest.param(300, 1024, 512, 8, 2, "one_expert", id="one-hot-expert"),
    pytest.param(2048, 4096, 1536, 128, 8, "skewed", id="235b-a22b-skewed"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="Gluon kernels need a CUDA GPU (Triton's interpreter cannot run them)")
@pytest.mark.parametrize("variant", [(256, 4, 1), (256, 3, 1), (128, 4, 1), (128, 3, 8)],
                         ids=lambda v: "n{}-s{}-g{}".format(*v))
@pytest.mark.parametrize("T,D,H,E,K,routing", GPU_CASES)
def test_matches_fp32_and_the_triton_kernel(monkeypatch, T, D, H, E, K, routing, variant):
    """GEMM2 through the Gluon kernel: every row written (outputs NaN-poisoned first), each element within
    one bf16 rounding of the fp32 product (plus fp32 summation-order slack), no further off it than the
    Triton kernel at its shipped config; the bitwise-equal fraction against the Triton kernel printed."""
    from titan_megamoe.kernels import grouped_gemm as gg

    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")
    block_n, stages, group_m = variant
    plan, h, w2 = _operands(T, D, H, E, K, routing, "cuda")
    ref = _reference(h, w2, plan)
    want = gg.expert_down_proj(h, w2, plan, torch.bfloat16, "bf16")  # the Triton kernel, shipped config
    with override_tile_config("gemm2", _ws(block_n, stages, group_m=group_m)):
        got = gg.expert_down_proj(h, w2, plan, torch.bfloat16, "bf16")
    assert not got.isnan().any(), "rows left unwritten (NaN poison)"
    err = (got.float() - ref).abs()
    bound = 2**-8 * ref.abs() + 1e-5 * ref.abs().max()
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements beyond bf16 rounding; max err {err.max():.3e}"
    triton_err = (want.float() - ref).abs().max()
    assert err.max() <= 2 * triton_err + 1e-6, f"max error {err.max():.3e} against the Triton kernel's {triton_err:.3e}"
    same = float((got.view(torch.int16) == want.view(torch.int16)).float().mean())
    print(f"bitwise equal to the Triton kernel: {same:.6f}")


def test_bench_script_says_it_needs_a_gpu():
    """scripts/bench_bf16_gluon.py imports and parses its arguments on CPU, then stops with a clear message."""
    import os
    import subprocess
    import sys

    if GPU:
        pytest.skip("on a GPU the script runs for real (docs/results/bench_bf16_gluon_*.json)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "scripts/bench_bf16_gluon.py", "--shapes", "30b", "mixtral", "--variants",
                           "0", "3", "--group-m", "4"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
