"""TileConfig.pairs_in_one_loop: dx = dg W1 + du W3 with both operand pairs in one K loop
(mainloop.pair_mainloop), so that a persistent dx's tile loop flattens with it. Its sums run in another order
than the two-pass loop's, so it is held to a float64 reference of the same (dequantized) operands: its error
at most 1.5x the two-pass kernel's, bf16 and block FP8. Made persistent it must be bitwise itself with one
program per tile (same tiles, same per-tile math). The CPU runs the kernels in Triton's interpreter at small
shapes; a GPU runs the compiled kernels at the Qwen3 shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_cases import make_ids
from titan_megamoe.kernels import configs
from titan_megamoe.kernels.configs import TileConfig, override_tile_config
from titan_megamoe.kernels.grouped_gemm import expert_input_grad
from titan_megamoe.kernels.quantize import quantize_rows, quantize_weight_pair
from titan_megamoe.kernels.routing_meta import build_routing_plan
from titan_megamoe.quant import dequantize

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def _dx_case(precision: str, T: int, D: int, H: int, E: int, K: int, routing: str, seed: int):
    """(run: () -> dx [N, D], the float64 reference of the operands the kernel reads)."""
    gen = torch.Generator().manual_seed(seed)
    plan = build_routing_plan(make_ids(T, E, K, routing, gen).to(DEVICE), E, 128)
    N = T * K

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, torch.bfloat16)

    dg, du = rand(N, H), rand(N, H)
    w1, w3 = rand(E, H, D, scale=0.05), rand(E, H, D, scale=0.05)
    if precision == "fp8":
        dg, du = quantize_rows(dg), quantize_rows(du)
        (_, w1t), (_, w3t) = quantize_weight_pair(w1), quantize_weight_pair(w3)
        # what the kernel multiplies: the dequantized rows and W^T's blocks, transposed back
        # (the weights stay fp32 and become float64 one expert at a time: at 235B-A22B a float64 copy of both is
        # 12 GiB, which ran a GPU shared by three test processes out of memory)
        g64, u64 = dequantize(dg).double(), dequantize(du).double()
        w1_ref, w3_ref = (dequantize(w).transpose(1, 2) for w in (w1t, w3t))

        def run():
            return expert_input_grad(dg, du, w1t, w3t, plan, torch.bfloat16, "fp8")
    else:
        g64, u64, w1_ref, w3_ref = dg.double(), du.double(), w1, w3

        def run():
            return expert_input_grad(dg, du, w1, w3, plan, torch.bfloat16, "bf16")
    ref = torch.zeros(N, D, dtype=torch.float64, device=DEVICE)
    offsets, order = plan.offsets_E1.tolist(), plan.order_N.long()
    for e in range(E):
        p = slice(offsets[e], offsets[e + 1])
        ref[order[p]] = g64[p] @ w1_ref[e].double() + u64[p] @ w3_ref[e].double()
    return run, ref


def _rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(precision, shape, routing, persistent, block_m=None):
    T, D, H, E, K = shape
    run, ref = _dx_case(precision, T, D, H, E, K, routing, seed=T + E + 7)
    shipped = configs.tile_config("dx", D, H, precision)
    # the Triton kernel of the shipped tile, at most 3 stages: the table's block-FP8 dx is the Gluon kernel's
    # (4 stages at 30B-A3B), and the Triton kernel's 128x128x128 tiles of both pairs take 64 KB a stage
    # (4 stages: 262 KB of shared memory, beyond sm_90's 227 KB; an H100 on 2026-12-06)
    base = dataclasses.replace(shipped, tma=True, persistent=0, warp_specialize=False, gluon=False,
                               block_n=min(shipped.block_n, 128), num_stages=min(shipped.num_stages, 3))
    if block_m is not None:
        base = dataclasses.replace(base, block_m=block_m)
    with override_tile_config("dx", base):
        two_pass = run()
    with override_tile_config("dx", dataclasses.replace(base, pairs_in_one_loop=True)):
        one_loop = run()
    with override_tile_config("dx", dataclasses.replace(base, pairs_in_one_loop=True, persistent=persistent)):
        one_loop_persistent = run()
    assert torch.isfinite(one_loop).all()
    e_two, e_one = _rel_err(two_pass, ref), _rel_err(one_loop, ref)
    assert e_one <= 1.5 * e_two + 1e-6, f"{precision} {shape}: one loop {e_one:.3e} vs two passes {e_two:.3e}"
    assert torch.equal(one_loop, one_loop_persistent), f"{precision} {shape}: persistent differs from one per tile"


@pytest.mark.skipif(GPU, reason="the interpreter's shapes; the GPU test below runs the real ones")
@pytest.mark.parametrize("precision,shape,routing,block_m", [
    ("bf16", (45, 64, 96, 6, 2), "one_expert", None),  # 16-row tiles (the interpreter's), 5 empty experts
    ("bf16", (40, 96, 64, 5, 2), "skewed", None),
    ("fp8", (40, 256, 256, 5, 2), "skewed", 64),  # 64-row parts: second halves empty where experts are small
])
def test_dx_pairs_in_one_loop_interpreter(precision, shape, routing, block_m):
    _check(precision, shape, routing, persistent=1, block_m=block_m)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the interpreter's version is above)")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("shape,routing", [
    pytest.param((4096, 2048, 768, 128, 8), "random", id="30b-a3b"),
    pytest.param((2048, 4096, 1536, 128, 8), "skewed", id="235b-a22b-skewed"),
    pytest.param((777, 512, 384, 40, 5), "empty_experts", id="odd-empty-experts"),
    pytest.param((300, 256, 384, 8, 2), "one_expert", id="one-hot-expert"),
])
def test_dx_pairs_in_one_loop_gpu(precision, shape, routing):
    _check(precision, shape, routing, persistent=2)


@pytest.mark.parametrize("kernel,cfg", [
    ("gemm2", TileConfig(128, 128, 64, 8, 3, tma=True, pairs_in_one_loop=True)),  # one pair: nothing to join
    ("dx", TileConfig(128, 128, 64, 8, 3, pairs_in_one_loop=True)),  # pointer loads: two passes only
    ("dx", TileConfig(128, 256, 64, 8, 3, tma=True, pairs_in_one_loop=True)),  # bf16's two accumulators: <= 128
    ("dx", TileConfig(128, 128, 64, 8, 3, tma=True, warp_specialize=True, pairs_in_one_loop=True)),
])
def test_pairs_in_one_loop_config_errors_name_the_rule(kernel, cfg):
    with pytest.raises(ValueError, match="pairs_in_one_loop applies to dx with tma only"):
        with override_tile_config(kernel, cfg):
            pass
