"""Block FP8 (`fp8`, `fp8_bwd`) on the Triton kernels, held to the PyTorch emulation of the same block
quantization (`oracle.moe_fp8_emulation`, the reference backend).

The rule (FlashAttention's, for FP8): every output and gradient's max error against a float64 oracle at
most 2x the emulation's. On CPU the kernels run in Triton's interpreter at small shapes; on a GPU the
same tests compile them, and the GPU-only cases below run real Qwen3 shapes.
"""

import functools

import pytest
import torch
import triton

from moe_cases import assert_flash_rule, forward_backward, make_case

import titan_megamoe
from titan_megamoe.oracle import moe_reference

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="real shapes need a CUDA GPU (the interpreter would take hours)")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")


def _fused(precision):
    return lambda *a: titan_megamoe.moe(*a, precision=precision, backend="triton")


def _emulated(precision):
    return lambda *a: titan_megamoe.moe(*a, precision=precision, backend="reference")


def _runs(case, dout, precision):
    """(float64 oracle, emulation, fused kernels) forward+backward of one case."""
    ref64 = forward_backward(lambda *a: moe_reference(*a, compute_dtype=torch.float64), case, dout, torch.float64)
    return ref64, forward_backward(_emulated(precision), case, dout), forward_backward(_fused(precision), case, dout)


def _check(case, precision, T, D, factor=2.0):
    dout = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    ref64, emulated, got = _runs(case, dout, precision)
    report = assert_flash_rule(got, ref64, emulated, factor)
    return got, emulated, ref64, report


CPU_CASES = [
    # T, D, H, E, K, routing
    pytest.param(40, 128, 128, 4, 2, "random", id="small"),
    pytest.param(70, 256, 128, 5, 3, "skewed", id="odd-E-skewed"),
    pytest.param(60, 128, 256, 6, 2, "empty_experts", id="empty-experts"),
    pytest.param(50, 128, 128, 4, 2, "one_expert", id="one-hot-expert"),
    pytest.param(1, 128, 128, 4, 1, "random", id="T1-K1"),
    pytest.param(140, 128, 128, 2, 1, "one_expert", id="129-rows-per-expert"),
]


@functools.lru_cache(maxsize=None)
def _case_results(T, D, H, E, K, routing, precision):
    """(case, dout, float64 oracle, emulation, fused kernels) of a CPU case: computed once, so that
    test_fp8_is_measurably_fp8 reads the `small` case's fused FP8 runs instead of repeating them."""
    torch.manual_seed(T + E)
    case = make_case(T, D, H, E, K, routing, device=DEVICE, seed=T + E)
    dout = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    return (case, dout, *_runs(case, dout, precision))


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("T,D,H,E,K,routing", CPU_CASES)
def test_fp8_matches_emulation(precision, T, D, H, E, K, routing):
    _, _, ref64, emulated, got = _case_results(T, D, H, E, K, routing, precision)
    assert_flash_rule(got, ref64, emulated, 2.0)


def test_fp8_specific_values():
    """Outliers 1e4x the median, all-zero blocks, values below e4m3's smallest normal (after scaling)."""
    T, D, H, E, K = 48, 256, 128, 4, 2
    case = make_case(T, D, H, E, K, "random", device=DEVICE, seed=5)
    x = case.x.float()
    x[3, 7] = 1e4 * x.abs().median()  # one outlier: its block's other values go subnormal or zero
    x[5, :128] = 0  # an all-zero block
    x[9, 128:] *= 1e-6  # a block far below the others
    case.x = x.to(torch.bfloat16)
    case.w1[0, :, :128] = 0  # an all-zero weight block
    for precision in ("fp8", "fp8_bwd"):
        _check(case, precision, T, D)


def test_fp8_is_measurably_fp8():
    """A silent bf16 fallback would fail here: FP8's error is several times bf16's (on the `small` case,
    T=40 D=H=128 E=4 K=2: the FP8 runs are test_fp8_matches_emulation's, measured 9.5-23x bf16's)."""
    case, dout, ref64, _, fp8 = _case_results(40, 128, 128, 4, 2, "random", "fp8")
    fp8_bwd = _case_results(40, 128, 128, 4, 2, "random", "fp8_bwd")[-1]
    bf16 = forward_backward(_fused("bf16"), case, dout)

    def err(r, name):
        return (r[name].double() - ref64[name]).norm().item() / ref64[name].norm().item()

    for name in ("out", "dx", "dw1", "dw2", "dw3"):
        assert err(fp8, name) > 4 * err(bf16, name), name
    assert err(fp8_bwd, "out") < 2 * err(bf16, "out")  # bf16 forward
    for name in ("dx", "dw1", "dw2", "dw3"):
        assert err(fp8_bwd, name) > 4 * err(bf16, name), name


@pytest.mark.skipif(GPU, reason="records the interpreter's launches (the GPU path's weight copies are Gluon kernels)")
def test_fp8_forward_launches_the_weight_copies_before_the_routing_plan(monkeypatch):
    """The weight copies need no routing: launched first, the GPU runs them while the host builds the plan
    (`pipeline.fused_moe_up`). bf16 launches none."""
    import triton.runtime.interpreter as interpreter

    launched = []
    real = interpreter.InterpretedFunction.__getitem__
    monkeypatch.setattr(interpreter.InterpretedFunction, "__getitem__",
                        lambda self, grid: (launched.append(self.fn.__name__), real(self, grid))[1])
    case = make_case(40, 128, 128, 4, 2, "random", device=DEVICE, seed=3)
    for precision in ("fp8", "bf16"):
        launched.clear()
        with torch.no_grad():
            _fused(precision)(*case.inputs())
        weights = [i for i, name in enumerate(launched) if name == "_quantize_weight_pair_kernel"]
        plan = launched.index("_chunk_histogram_kernel")
        if precision == "fp8":
            assert len(weights) == 3 and max(weights) < plan, launched
        else:
            assert not weights, launched


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fused_adamw_updates_reach_the_fp8_weights(precision):
    """Training steps with torch's fused AdamW (TorchTitan's default optimizer) under activation
    checkpointing: every forward and backward computes with the weights as they are at that step.

    The fused AdamW updates the parameters in place without bumping their version counters (asserted
    below: the premise of this test); a weight cache keyed on version counters served every forward after
    the first the initial weights, and training stalled (H200, 2026-12-04)."""
    from torch.utils.checkpoint import checkpoint

    T, D, H, E, K = 32, 128, 128, 2, 2
    case = make_case(T, D, H, E, K, "random", device=DEVICE, seed=9)
    params = [torch.nn.Parameter(w.float()) for w in (case.w1, case.w2, case.w3)]  # fp32 masters, as 1-GPU TorchTitan
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    layer = lambda x, *w: titan_megamoe.moe(x, case.ids, case.scores, *w, precision=precision, backend="triton")  # noqa: E731
    dout = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    outs = []
    for step in range(2):  # the stale cache served step 1 (the first after an update) the old weights
        versions = [p._version for p in params]
        fresh = [p.detach().clone().requires_grad_(True) for p in params]  # tensors no call has seen
        want = layer(case.x, *fresh)
        want.backward(dout)
        out = checkpoint(layer, case.x, *params, use_reentrant=False)
        out.backward(dout)
        assert torch.equal(out.detach(), want.detach()), f"step {step}: the forward used other weights"
        for i, (p, f) in enumerate(zip(params, fresh)):
            assert torch.equal(p.grad, f.grad), f"step {step}: dW{i + 1} from other weights"
        outs.append(out.detach())
        opt.step()
        opt.zero_grad()
        assert [p._version for p in params] == versions, "fused AdamW bumped the versions: the premise changed"
    assert not torch.equal(outs[0], outs[1])  # the step changed the weights, and the output followed


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_rejects_shapes_off_the_block(precision):
    case = make_case(8, 192, 128, 2, 1, "random", device=DEVICE, seed=1)
    with pytest.raises(ValueError, match="multiples of 128"):
        titan_megamoe.moe(*case.inputs(), precision=precision, backend="triton")


GPU_CASES = [
    pytest.param(4096, 2048, 768, 128, 8, "random", id="30b-a3b"),
    pytest.param(2048, 4096, 1536, 128, 8, "random", id="235b-a22b"),
    pytest.param(2048, 2048, 768, 128, 8, "skewed", id="skewed"),
    pytest.param(1000, 1024, 512, 64, 4, "empty_experts", id="empty-experts"),
    pytest.param(1000, 1024, 512, 64, 4, "one_expert", id="one-hot-expert"),
    pytest.param(1, 1024, 512, 60, 4, "random", id="T1"),
    pytest.param(1500, 2048, 768, 128, 1, "random", id="K1"),
    pytest.param(777, 1152, 384, 40, 5, "random", id="odd-T-E40"),
]


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("T,D,H,E,K,routing", GPU_CASES)
def test_fp8_real_shapes(precision, T, D, H, E, K, routing):
    case = make_case(T, D, H, E, K, routing, device="cuda", seed=T + E)
    *_, report = _check(case, precision, T, D)
    print(precision, report)


@gpu_only
@pytest.mark.gpu
def test_fp8_forward_bitwise_reproducible():
    case = make_case(8192, 2048, 768, 128, 8, "skewed", device="cuda", seed=11)
    with torch.no_grad():
        a = titan_megamoe.moe(*case.inputs(), precision="fp8", backend="triton")
        b = titan_megamoe.moe(*case.inputs(), precision="fp8", backend="triton")
    assert torch.equal(a, b)


@pytest.mark.parametrize("T,D,H,E,K,routing", [
    # on CPU (no Gluon kernel) tests/test_fp8_dswiglu_split.py runs this check on its skewed-H256 and
    # empty-experts-H384 cases through both Triton paths (the CPU default among them); here one token
    pytest.param(1, 128, 128, 4, 1, "random", id="T1-K1"),
    pytest.param(4096, 2048, 768, 128, 8, "random", id="30b-a3b", marks=[gpu_only, pytest.mark.gpu]),
])
def test_fp8_dswiglu_bitwise_quant_of_bf16_path(T, D, H, E, K, routing):
    """Block-FP8 dgrad's dSwiGLU kernel quantizes exactly the bf16 values the bf16 split path stores:
    its dg, du rows and dg, du, s*h token tiles are bitwise quant.py's quantization of
    `_dswiglu_rows_kernel`'s bf16 outputs for the same q, g, u, scores (this pins the e4m3 casts,
    `common.to_e4m3` and the transposed token-tile stores, on the GPU; scales included)."""
    from titan_megamoe import quant
    from titan_megamoe.kernels import dgrad_swiglu as dg_mod
    from titan_megamoe.kernels.quantize import quantize_sorted_rows, quantize_weight_pair
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    case = make_case(T, D, H, E, K, routing, device=DEVICE, seed=23)
    plan = build_routing_plan(case.ids, E, 128)
    gen = torch.Generator().manual_seed(24)
    g, u = (torch.randn(plan.num_rows, H, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    dout = quantize_sorted_rows(torch.randn(T, D, generator=gen).to(DEVICE, torch.bfloat16), plan)
    w2t = quantize_weight_pair(case.w2)[1]
    scores = case.scores.reshape(-1).float()
    dg, du, tiles, _ = dg_mod.dgrad_swiglu(dout, w2t, g, u, scores, plan, "fp8")

    q = dg_mod.expert_h_grad(dout, w2t, plan, torch.bfloat16, "fp8")
    N = plan.num_rows
    ref = [torch.empty_like(q) for _ in range(3)]  # dg, du, s*h in bf16
    block_n = 128 if GPU else 64
    ds_part = torch.empty(N, H // block_n, device=DEVICE)
    dg_mod._dswiglu_rows_kernel[(triton.cdiv(N, 64) * (H // block_n),)](
        q, g, u, scores, plan.order_N, *ref, ds_part, N, H, BLOCK_M=64, BLOCK_N=block_n,
        INTERPRET=dg_mod.INTERPRET, num_warps=8 if GPU else 4)

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    for got, r in zip((dg, du), ref[:2]):
        want = quant.quantize_activation(r)
        assert torch.equal(bits(got.data), bits(want.data)) and torch.equal(got.scale, want.scale)
    real = int(plan.tile_expert.ge(0).sum())  # tiles past the real count are never read (nor written)
    for got, r in zip(tiles, ref):
        want = quant.quantize_token_tiles(r, plan)
        assert torch.equal(bits(got.data[:, :real * 128]), bits(want.data[:, :real * 128]))
        assert torch.equal(got.scale[:, :real], want.scale[:, :real])


_SM90_FP8_ROWS = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import shipped_fp8_rows
print(json.dumps({f"{d}x{h}": {name: {k: r[k] for k in ("qgmma", "usage", "block_n")}
                                for name, r in shipped_fp8_rows(d, h).items()}
                  for d, h in ((2048, 768), (4096, 1536))}))
"""


@pytest.fixture(scope="module")
def shipped_fp8_compiles():
    from moe_cases import sm90_compile_results

    return sm90_compile_results(_SM90_FP8_ROWS, timeout=300)


@pytest.mark.parametrize("shape", ["2048x768", "4096x1536"])
def test_shipped_fp8_row_kernels_compile_to_fp8_wgmma_without_spills(shipped_fp8_compiles, shape):
    """GEMM1, GEMM2, dx and dgrad's q with the FP8 tile configs the table ships for Qwen3-30B-A3B and
    Qwen3-235B-A22B (D x H), compiled for sm_90 on the CPU (Triton's bundled ptxas; the GPU machine's Triton
    may allocate differently): each GEMM an FP8 wgmma (QGMMA in the SASS) and nothing spilled to the stack (the
    warp-specialised row GEMMs' 256-column items: at most a few 32-bit values outside the K loop, 16 bytes
    under Triton 3.9; GEMM1's one 64-bit value per item under Triton 3.6, `moe_cases.GEMM1_ONE_PASS_STACK`).
    Also keeps scripts/sm90_resources.py's signatures in step with the kernels'."""
    from moe_cases import GEMM1_ONE_PASS_STACK, stack_bytes

    got = shipped_fp8_compiles[shape]
    assert set(got) == {"gemm1", "gemm2", "dx", "dgrad q"}
    for name, r in got.items():
        assert r["qgmma"] > 0, f"{shape} {name}: no QGMMA (FP8 wgmma) in the SASS"
        allowed = 32 if r["block_n"] == 256 else GEMM1_ONE_PASS_STACK if name == "gemm1" else 0
        assert stack_bytes(r["usage"]) <= allowed, f"{shape} {name}: register spills: {r['usage']}"
