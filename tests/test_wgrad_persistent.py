"""TileConfig.persistent for the bf16 weight gradients (kernels/wgrad.py `_expert_wgrad_persistent_kernel`):
resident programs walking their output tiles in one hand-flattened loop, the gathered operand (dout for dW2,
x for dW1/dW3) gathered by pointer, or (sorted_copy) read from a copy padded per expert
(`sorted_rows.padded_sorted_rows`).

Per output tile the same reduction blocks in the same order as one program per tile (gathered, or over a
sorted copy), so the results must be bitwise equal, with far fewer programs than tiles (the interpreter's 2
"multiprocessors"), empty experts (one step against the copy's zero block), one hot expert, duplicate
choices, ragged edges and reductions that are not a whole number of blocks. Outputs are poisoned (NaN) first,
so a tile left unwritten fails, and so does a padded-copy row the kernel reads but nobody wrote. The CPU runs
the kernels in Triton's interpreter at small shapes; a GPU runs the compiled kernels at Qwen3-30B-A3B's shape
with the tuning candidates' tiles."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from moe_cases import make_ids
# the weight-gradient tests' device, skip rule, interpreter fix and poisoned outputs (an autouse fixture)
from test_kernel_wgrad import DEVICE, _assert_close, poison, pytestmark  # noqa: F401
from titan_megamoe import oracle
from titan_megamoe.kernels import wgrad
from titan_megamoe.kernels.common import INTERPRET, multiprocessors
from titan_megamoe.kernels.configs import TileConfig, override_tile_config
from titan_megamoe.kernels.routing_meta import build_routing_plan
from titan_megamoe.kernels.sorted_rows import padded_rows_bound, padded_sorted_rows, sorted_rows
from titan_megamoe.validation import check_tile_config


# name: (T, D, H, E, K, routing)
SHAPES = {
    "random": (37, 48, 32, 5, 3, "random"),
    "skewed": (64, 32, 48, 6, 2, "skewed"),
    "empty_experts": (29, 32, 32, 7, 2, "empty_experts"),
    "one_expert": (21, 32, 32, 4, 2, "one_expert"),
    "duplicate_choices": (19, 48, 32, 3, 3, "duplicate_choices"),
    "t1": (1, 32, 32, 4, 2, "random"),
}
if not INTERPRET:
    SHAPES.update({"30b": (4096, 2048, 768, 128, 8, "random"), "30b_skewed": (4096, 2048, 768, 128, 8, "skewed"),
                   "odd_ragged": (777, 832, 320, 40, 5, "empty_experts")})
# the interpreter's tiles are tiny (fast), with ragged M/N edges at the shapes above; on the GPU the
# tuning candidates' tiles (tune/candidates.py)
W2_TILES = [TileConfig(16, 32, 16, 4, 1), TileConfig(32, 16, 32, 4, 2)] if INTERPRET else [
    TileConfig(128, 256, 32, 8, 3), TileConfig(128, 128, 64, 8, 4)]
W13_TILES = [TileConfig(16, 32, 16, 4, 1), TileConfig(16, 16, 32, 4, 2)] if INTERPRET else [
    TileConfig(64, 128, 32, 4, 4), TileConfig(128, 128, 32, 8, 4)]


def _problem(name: str, seed: int = 0):
    T, D, H, E, K, routing = SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    plan = build_routing_plan(make_ids(T, E, K, routing, gen).to(DEVICE), E, 128)
    N = T * K

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16)

    return dict(plan=plan, x=rand(T, D), dout=rand(T, D), hs=rand(N, H), dg=rand(N, H), du=rand(N, H))


def _run(p, w2_cfg, w13_cfg, out_dtype):
    with override_tile_config("wgrad_w2", w2_cfg), override_tile_config("wgrad_w13", w13_cfg):
        return (wgrad.expert_wgrad_w2(p["dout"], p["hs"], p["plan"], out_dtype),
                *wgrad.expert_wgrad_w13(p["dg"], p["du"], p["x"], p["plan"], out_dtype))


def _tma(cfg, copied, persistent=0):
    return dataclasses.replace(cfg, tma=True, sorted_copy=copied, persistent=persistent)


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("name", ["random", "empty_experts", "one_expert", "duplicate_choices", "t1"])
def test_padded_sorted_rows_layout(name, block):
    """A zero block, then each expert's sorted rows (sorted_rows' values) and zero rows up to whole blocks."""
    p = _problem(name)
    plan = p["plan"]
    out = padded_sorted_rows(p["x"], plan, block)
    assert out.shape == (padded_rows_bound(plan, block), p["x"].shape[1])
    ref = sorted_rows(p["x"], plan)
    offsets = plan.offsets_E1.tolist()
    assert (out[:block] == 0).all(), "the leading zero block"
    row = block
    for e in range(plan.layout.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        padded = -(-(hi - lo) // block) * block
        assert torch.equal(out[row:row + hi - lo], ref[lo:hi]), f"expert {e}: rows"
        assert (out[row + hi - lo:row + padded] == 0).all(), f"expert {e}: padding"
        row += padded


# every shape with fp32 gradients; bf16's rounding on two shapes in the interpreter (CI time), all on a GPU
BITWISE_CASES = [(name, dtype, copied) for name in SHAPES for dtype in (torch.float32, torch.bfloat16)
                 for copied in (True, False)
                 if dtype == torch.float32 or not INTERPRET or name in ("random", "empty_experts")]


@pytest.mark.parametrize("name, out_dtype, copied", BITWISE_CASES,
                         ids=[f"{n}-{str(d)[6:]}-{'padded_copy' if c else 'gathered'}" for n, d, c in BITWISE_CASES])
def test_persistent_is_bitwise_one_program_per_tile(name, out_dtype, copied):
    p = _problem(name, seed=1)
    launched = []
    real_launch = wgrad.launch

    def spy(kernel, grid, *args, **kw):
        launched.append((kernel.fn.__name__, grid[0]))
        return real_launch(kernel, grid, *args, **kw)

    for w2_cfg, w13_cfg in zip(W2_TILES, W13_TILES):
        one = _run(p, _tma(w2_cfg, copied), _tma(w13_cfg, copied), out_dtype)
        launched.clear()
        try:
            wgrad.launch = spy
            resident = _run(p, _tma(w2_cfg, copied, 1), _tma(w13_cfg, copied, 2), out_dtype)
        finally:
            wgrad.launch = real_launch
        kernels = [k for k, _ in launched if k.startswith("_expert_wgrad")]
        assert kernels == ["_expert_wgrad_persistent_kernel"] * 2, f"{name}: no resident kernel ran: {launched}"
        for out_name, a, b in zip(("dW2", "dW1", "dW3"), one, resident):
            assert not b.isnan().any(), f"{name}: NaN in the resident {out_name} (unwritten tile or padding read)"
            assert torch.equal(a, b), f"{name} {w2_cfg}: resident {out_name} differs from one program per tile"
    sms = multiprocessors(torch.device(DEVICE))
    grids = [g for k, g in launched if k == "_expert_wgrad_persistent_kernel"]
    assert grids[0] <= sms and grids[1] <= 2 * sms, launched


def test_persistent_meets_the_float64_oracle():
    """Not only equal to the other kernel: the FlashAttention rule against float64 (2x torch bf16's error)."""
    p = _problem("skewed", seed=2)
    dw2, dw1, dw3 = _run(p, _tma(W2_TILES[0], False, 1), _tma(W13_TILES[0], True, 1), torch.float32)
    plan = p["plan"]
    refs = [oracle.wgrad_w2_reference(p["dout"], p["hs"], plan, dt) for dt in (torch.float64, torch.bfloat16)]
    refs13 = [oracle.wgrad_w13_reference(p["dg"], p["du"], p["x"], plan, dt) for dt in (torch.float64, torch.bfloat16)]
    _assert_close("dW2", dw2, *refs)
    _assert_close("dW1", dw1, refs13[0][0], refs13[1][0])
    _assert_close("dW3", dw3, refs13[0][1], refs13[1][1])


def test_persistent_config_errors():
    """The resident kernels read the sorted operand(s) through TMA, without Triton's warp specialisation, and
    block FP8's reads token tiles (no sorted copy): a table entry says so at load, a forced config too."""
    resident = TileConfig(64, 128, 32, 4, 4, tma=True, persistent=2)
    for ok in (resident, dataclasses.replace(resident, sorted_copy=True)):
        check_tile_config("wgrad_w13", ok, 128, "bf16")
    for bad, precision in ((dataclasses.replace(resident, tma=False), "bf16"),
                           (dataclasses.replace(resident, tma=False), None),
                           (dataclasses.replace(resident, sorted_copy=True), "fp8"),
                           (dataclasses.replace(resident, sorted_copy=True, warp_specialize=True), "bf16")):
        with pytest.raises(ValueError, match="weight gradients with tma .block FP8 without sorted_copy."):
            check_tile_config("wgrad_w13", bad, 128, precision)
        if precision is None:
            with pytest.raises(ValueError, match="persistent"), override_tile_config("wgrad_w13", bad):
                pass


# Runs in a fresh process (under TRITON_INTERPRET nothing compiles): every resident bf16 weight-gradient candidate
# of the tuner, compiled for sm_90 on the CPU as it launches, with fp32 gradients (1-GPU TorchTitan's fp32 master
# weights: the largest output staging tile in shared memory)
_SM90_CANDIDATES = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import wgrad_bf16, wgrad_fp8
from titan_megamoe.tune.candidates import CANDIDATES, CANDIDATES_FP8

out = {}
for precision, table in (("bf16", CANDIDATES), ("fp8", CANDIDATES_FP8)):
    for kernel in ("wgrad_w2", "wgrad_w13"):
        for c in table[kernel]:
            if not c.persistent:
                continue
            shape = dict(persistent=True, block_m=c.block_m, block_n=c.block_n, num_warps=c.num_warps,
                         num_stages=c.num_stages, out="fp32")
            res = (wgrad_bf16(kernel == "wgrad_w13", block_k=c.block_k, copied=c.sorted_copy, **shape)
                   if precision == "bf16" else wgrad_fp8(kernel == "wgrad_w13", **shape))
            out[f"{precision} {kernel} {c.block_m}x{c.block_n}x{c.block_k} {c.num_warps}w {c.num_stages}s "
                f"copied={c.sorted_copy} persistent={c.persistent}"] = dict(res, warps=c.num_warps, per_sm=c.persistent)
print(json.dumps(out))
"""
SMEM_PER_BLOCK, SMEM_PER_SM, REGS_PER_SM = 232448, 233472, 65536  # sm_90: 227 KB a block, 228 KB a multiprocessor


@pytest.mark.skipif(not INTERPRET, reason="CPU compile check (the GPU runs the kernels instead)")
def test_resident_candidates_compile_and_fit_on_sm90():
    """Each candidate (bf16, and block FP8's) lowers to wgmma, spills nothing, and its `persistent` programs fit
    on a multiprocessor in registers and shared memory with fp32 gradients: a config that fits only with bf16
    gradients would fail to launch in a training step. bf16 keeps its MMAs in flight across steps (a wait_group
    above 0 in the loop); block FP8 waits for each token tile's product to scale it (the promotion)."""
    from moe_cases import sm90_compile_results

    results = sm90_compile_results(_SM90_CANDIDATES, timeout=600)
    assert sum(name.startswith("bf16") for name in results) >= 6 and any(n.startswith("fp8") for n in results)
    for name, r in results.items():
        regs = int(re.search(r"REG:(\d+)", r["usage"]).group(1))
        stack = int(re.search(r"STACK:(\d+)", r["usage"]).group(1))
        assert r["wgmma_ir"] and r["hgmma"] + r["qgmma"] > 0, f"{name}: no wgmma"
        if name.startswith("bf16"):
            assert max(int(w) for w in r["wgmma_waits"]) > 0, f"{name}: every MMA waited for ({r['wgmma_waits']})"
        assert stack == 0, f"{name}: {stack} bytes of spill"
        assert r["smem"] <= SMEM_PER_BLOCK, f"{name}: {r['smem']} bytes of shared memory"
        # (each program also holds the 1 KB the driver reserves per block)
        assert r["per_sm"] * (r["smem"] + 1024) <= SMEM_PER_SM, f"{name}: {r['per_sm']} programs do not fit in " \
                                                                 f"shared memory"
        assert r["per_sm"] * regs * 32 * r["warps"] <= REGS_PER_SM, f"{name}: {r['per_sm']} x {regs} registers"
