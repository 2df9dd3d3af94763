"""TileConfig.persistent: GEMM2, dx and dgrad's GEMM as resident programs that walk the tile schedule
(kernels/grouped_gemm.py; with one operand pair the loop is flattened with the K loop). Same tiles, same per-tile math: the
outputs must be bitwise those of one program per tile, bf16 and block FP8, with a grid far smaller than
the tile count (the interpreter's: 2 "multiprocessors"), grouped row order, 64-row parts whose second half
of an expert's last tile is empty, empty experts and one hot expert. The CPU runs the kernels in Triton's
interpreter at small shapes; a GPU runs the compiled kernels at the Qwen3 shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_cases import make_ids
from titan_megamoe.kernels import configs, grouped_gemm
from titan_megamoe.kernels.configs import TileConfig, override_tile_config
from titan_megamoe.kernels.grouped_gemm import expert_down_proj, expert_h_grad, expert_input_grad
from titan_megamoe.kernels.quantize import quantize_rows, quantize_weight_pair
from titan_megamoe.kernels.routing_meta import build_routing_plan

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
KERNELS = ("gemm2", "dgrad_swiglu", "dx")


def _three_gemms(precision: str, T: int, D: int, H: int, E: int, K: int, routing: str, seed: int):
    """A closure running GEMM2, dgrad's GEMM and dx on fresh random operands (poisoned outputs are the
    launcher's business: `new_output`), returning their three outputs."""
    gen = torch.Generator().manual_seed(seed)
    ids = make_ids(T, E, K, routing, gen).to(DEVICE)
    plan = build_routing_plan(ids, E, 128)
    N = T * K

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, torch.bfloat16)

    h, dg, du, dout = rand(N, H), rand(N, H), rand(N, H), rand(N, D)
    w1, w3, w2 = rand(E, H, D, scale=0.05), rand(E, H, D, scale=0.05), rand(E, D, H, scale=0.05)
    bf16 = torch.bfloat16
    if precision == "fp8":
        h, dg, du, dout = (quantize_rows(t) for t in (h, dg, du, dout))
        (w2q, w2t), (_, w1t), (_, w3t) = (quantize_weight_pair(w) for w in (w2, w1, w3))
        return lambda: (expert_down_proj(h, w2q, plan, bf16, "fp8"), expert_h_grad(dout, w2t, plan, bf16, "fp8"),
                        expert_input_grad(dg, du, w1t, w3t, plan, bf16, "fp8"))
    return lambda: (expert_down_proj(h, w2, plan, bf16, "bf16"), expert_h_grad(dout, w2, plan, bf16, "bf16"),
                    expert_input_grad(dg, du, w1, w3, plan, bf16, "bf16"))


def _check_bitwise(precision, shape, routing, persistent, block_m=None, group_ms=(1, 3)):
    T, D, H, E, K = shape
    run = _three_gemms(precision, T, D, H, E, K, routing, seed=T + E)
    # operands through TMA and dgrad split, so all three run in the grouped GEMM in both precisions; one
    # program per tile whatever the table ships (its configs may be persistent already, or Gluon kernels)
    base = {k: dataclasses.replace(configs.tile_config(k, D, H, precision), split=k == "dgrad_swiglu", tma=True,
                                   persistent=0, gluon=False, warp_specialize=False) for k in KERNELS}
    if block_m is not None:
        base = {k: dataclasses.replace(c, block_m=block_m) for k, c in base.items()}
    launched = []
    real_launch = grouped_gemm.launch

    def spy(kernel, grid, *args, **kw):
        launched.append((grid[0], kw["PERSISTENT"]))
        return real_launch(kernel, grid, *args, **kw)

    try:
        grouped_gemm.launch = spy
        for group_m in group_ms:
            configs._overrides.update({k: dataclasses.replace(c, group_m=group_m) for k, c in base.items()})
            plain = run()
            configs._overrides.update({k: dataclasses.replace(c, group_m=group_m, persistent=persistent,
                                                              warp_specialize=False) for k, c in base.items()})
            got = run()
            for name, p, g in zip(KERNELS, plain, got):
                assert torch.equal(p, g), f"{precision} {shape} group_m {group_m}: {name} differs"
    finally:
        grouped_gemm.launch = real_launch
        configs._overrides.clear()
    # each persistent launch: persistent x multiprocessors programs, or one per tile where the schedule has fewer
    sms = grouped_gemm.multiprocessors(torch.device(DEVICE))
    plain_grids = [grid for grid, on in launched if not on]
    persistent_grids = [grid for grid, on in launched if on]
    assert len(plain_grids) == len(persistent_grids) == 3 * len(group_ms), launched
    assert persistent_grids == [min(g, persistent * sms) for g in plain_grids], (launched, sms)


@pytest.mark.skipif(GPU, reason="the interpreter's shapes; the GPU test below runs the real ones")
@pytest.mark.parametrize("precision,shape,routing,block_m,group_ms", [
    # 16-row tiles (the interpreter's config), 5 empty experts; plain and grouped row order
    ("bf16", (45, 64, 96, 6, 2), "one_expert", None, (1, 3)),
    # 64-row parts: experts of < 64 rows leave second halves empty; grouped order (a partial last group)
    ("fp8", (40, 256, 256, 5, 2), "skewed", 64, (3,)),
])
def test_persistent_is_bitwise_one_program_per_tile_interpreter(precision, shape, routing, block_m, group_ms):
    _check_bitwise(precision, shape, routing, persistent=1, block_m=block_m, group_ms=group_ms)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the interpreter's version is above)")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("shape,routing,group_ms", [  # grouped order once: every config compiles twice per group_m
    pytest.param((4096, 2048, 768, 128, 8), "random", (1,), id="30b-a3b"),
    pytest.param((2048, 4096, 1536, 128, 8), "skewed", (1,), id="235b-a22b-skewed"),
    pytest.param((777, 512, 256, 40, 5), "empty_experts", (1, 3), id="odd-empty-experts"),
    pytest.param((300, 256, 384, 8, 2), "one_expert", (1,), id="one-hot-expert"),
])
def test_persistent_is_bitwise_one_program_per_tile_gpu(precision, shape, routing, group_ms):
    _check_bitwise(precision, shape, routing, persistent=2, group_ms=group_ms)


@pytest.mark.parametrize("kernel,cfg,message", [
    ("gemm1_swiglu", TileConfig(128, 128, 64, 8, 3, persistent=1), "only for gemm2, dx, dgrad_swiglu"),
    ("wgrad_w2", TileConfig(128, 128, 64, 8, 3, persistent=1), "only for gemm2, dx, dgrad_swiglu"),
    # the weight gradients' resident kernels lost on the GPU and were removed (docs/kernels.md): refused, not ignored
    ("wgrad_w13", TileConfig(64, 128, 32, 4, 4, tma=True, sorted_copy=True, persistent=2), "only for gemm2, dx"),
    # dgrad's own kernel (no split, or split without tma) is never persistent: a silent no-op otherwise
    ("dgrad_swiglu", TileConfig(128, 128, 64, 8, 3, split=True, persistent=1), "with split and tma"),
    ("dgrad_swiglu", TileConfig(128, 128, 64, 8, 3, tma=True, persistent=1), "with split and tma"),
    ("gemm2", TileConfig(128, 256, 64, 8, 3, tma=True, warp_specialize=True, persistent=1), "without warp_specialize"),
    ("gemm2", TileConfig(128, 256, 64, 8, 3, tma=True, persistent=-1), "integer >= 0"),
    ("gemm2", TileConfig(128, 256, 64, 8, 3, tma=True, persistent=True), "integer >= 0"),
])
def test_persistent_config_errors_name_the_rule(kernel, cfg, message):
    with pytest.raises(ValueError, match=message):
        with override_tile_config(kernel, cfg):
            pass
