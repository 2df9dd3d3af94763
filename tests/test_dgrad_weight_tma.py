"""TileConfig.weight_tma: dgrad's own kernel reads W2 through two TMA descriptors (the second one BLOCK_N
columns in) while dout stays gathered by pointer. Same operands, same K order: dg, du, s*h and ds must be
bitwise those of the pointer loads, split (q stored, then the elementwise dSwiGLU) and fused epilogue alike,
with a second column block that runs past H (zero fill) and empty experts. The CPU runs the kernel in
Triton's interpreter at small shapes; a GPU runs it at the Qwen3 shapes and an odd one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_cases import make_ids
from titan_megamoe.kernels import configs, dgrad_swiglu as dgrad_module
from titan_megamoe.kernels.configs import TileConfig, override_tile_config
from titan_megamoe.kernels.routing_meta import build_routing_plan

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def _check(T, D, H, E, K, routing, split_modes):
    gen = torch.Generator().manual_seed(T + H)
    ids = make_ids(T, E, K, routing, gen).to(DEVICE)
    plan = build_routing_plan(ids, E, configs.row_block_m())
    N = T * K

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, torch.bfloat16)

    dout, w2, g, u = rand(T, D), rand(E, D, H, scale=0.05), rand(N, H), rand(N, H)
    scores = torch.rand(N, generator=gen).to(DEVICE)
    base = configs.tile_config("dgrad_swiglu", D, H, "bf16")
    launched = []
    real_launch = dgrad_module.launch

    def spy(kernel, grid, *args, **kw):
        launched.append(kw.get("W_TMA"))
        return real_launch(kernel, grid, *args, **kw)

    dgrad_module.launch = spy
    try:
        for split in split_modes:
            cfg = dataclasses.replace(base, split=split, tma=False, persistent=0, weight_tma=False)
            with override_tile_config("dgrad_swiglu", cfg):
                want = dgrad_module.dgrad_swiglu(dout, w2, g, u, scores, plan, "bf16")
            with override_tile_config("dgrad_swiglu", dataclasses.replace(cfg, weight_tma=True)):
                got = dgrad_module.dgrad_swiglu(dout, w2, g, u, scores, plan, "bf16")
            for name, w, o in zip(("dg", "du", "s*h", "ds"), want, got):
                assert torch.equal(w, o), f"split={split} {name} differs with W2 through TMA"
    finally:
        dgrad_module.launch = real_launch
    # the GEMM kernel ran once per config with pointer loads, once with TMA (the split mode's elementwise
    # kernel takes no W_TMA)
    gemm = [w for w in launched if w is not None]
    assert gemm == [False, True] * len(split_modes), launched


@pytest.mark.skipif(GPU, reason="the interpreter's shapes; the GPU test below runs the real ones")
def test_weight_tma_is_bitwise_pointer_loads_interpreter():
    # the interpreter's tiles: BLOCK_N 32, BLOCK_K 32; H = 96 leaves the last program's second block past H
    _check(45, 64, 96, 6, 2, "empty_experts", split_modes=(True, False))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the interpreter's version is above)")
@pytest.mark.parametrize("T,D,H,E,K,routing", [
    pytest.param(4096, 2048, 768, 128, 8, "random", id="30b-a3b"),
    pytest.param(2048, 4096, 1536, 128, 8, "skewed", id="235b-a22b-skewed"),
    pytest.param(777, 512, 320, 40, 5, "empty_experts", id="odd-H320-empty-experts"),
])
def test_weight_tma_is_bitwise_pointer_loads_gpu(T, D, H, E, K, routing):
    _check(T, D, H, E, K, routing, split_modes=(True,))


@pytest.mark.parametrize("kernel,cfg", [
    ("gemm1_swiglu", TileConfig(128, 128, 64, 8, 3, weight_tma=True)),
    # with tma dgrad copies dout into sorted order and runs the grouped GEMM: all its operands are TMA already
    ("dgrad_swiglu", TileConfig(128, 128, 64, 8, 3, split=True, tma=True, weight_tma=True)),
])
def test_weight_tma_config_errors_name_the_rule(kernel, cfg):
    with pytest.raises(ValueError, match="weight_tma applies to dgrad_swiglu without tma only"):
        with override_tile_config(kernel, cfg):
            pass
