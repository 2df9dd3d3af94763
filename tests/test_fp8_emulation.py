"""Block FP8 on CPU: the quantizer (quant.py), the MoE emulation (oracle.moe_fp8_emulation) against the
float64 oracle, and the public API for precision='fp8' / 'fp8_bwd'."""

import dataclasses
import math
import re
from types import SimpleNamespace

import pytest
import torch

import titan_megamoe
from moe_cases import forward_backward, make_case, reference_results
from titan_megamoe import quant
from titan_megamoe.oracle import moe_fp8_emulation

U_E4M3 = 2.0**-4  # unit roundoff of e4m3 (3 mantissa bits): half an ulp relative to its binade
SUBNORMAL_HALF_SPACING = 2.0**-10  # e4m3 subnormals are multiples of 2^-9 (in scaled units)


def _wide_range(shape, seed=0):
    """Normal values times a random power of two per row: blocks with very different amax."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    return x * torch.exp2(torch.randint(-20, 20, (*shape[:-1], 1), generator=gen).float())


def _expanded_scale(q):
    """Each element's scale, shaped like q.data."""
    r, c = q.block
    s = q.scale.repeat_interleave(r, dim=-2).repeat_interleave(c, dim=-1)
    return s[..., : q.data.shape[-2], :]


def _expanded_block_amax(x, block):
    """Each element's block amax, computed independently of quant.py (zero rows pad a partial block)."""
    r, c = block
    padded = torch.nn.functional.pad(x.abs(), (0, 0, 0, (-x.shape[-2]) % r))
    amax = padded.unflatten(-1, (-1, c)).unflatten(-3, (-1, r)).amax(dim=(-3, -1))
    return _expanded_scale(quant.BlockScaled(x, amax, block))


# ------------------------------------------------------------------------------------------------ quantizer


@pytest.mark.parametrize("quantizer,shape", [
    (quant.quantize_activation, (7, 384)),
    (quant.quantize_weight, (256, 384)),
    (quant.quantize_weight, (3, 128, 256)),
    (quant.quantize_token_blocks, (300, 64)),  # partial last token block (300 = 2 * 128 + 44)
])
def test_round_trip_error_is_half_an_e4m3_ulp(quantizer, shape):
    x = _wide_range(shape)
    q = quantizer(x)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32 and q.data.shape == x.shape
    err = (quant.dequantize(q) - x).abs()
    s = _expanded_scale(q)
    # per element: half an ulp of a 3-bit mantissa for scaled normals, half the subnormal spacing below
    assert bool((err <= torch.maximum(U_E4M3 * x.abs(), SUBNORMAL_HALF_SPACING * s)).all())
    # and so at most 2^-4 of the block's amax (|x| <= amax; 2^-10 s < 2^-4 amax as amax > 224 s)
    amax = _expanded_block_amax(x, q.block)
    assert bool((err <= U_E4M3 * amax).all()) and bool((amax > 224 * s).all())
    # the bound is attained: it is e4m3, not a finer format
    normal = (x.abs() / s) >= quant.E4M3_MIN_NORMAL
    rel = err[normal] / x.abs()[normal]
    assert rel.max() <= U_E4M3 and rel.max() > 0.9 * U_E4M3, rel.max()


def test_scales_are_the_smallest_powers_of_two_that_fit():
    x = _wide_range((16, 512), seed=1)
    # amax right at and just past 448 * 2^k: where amax / 448 rounds, the exact test must still hold
    for i, k in enumerate(range(-8, 8)):
        x[i, :128] = 0
        x[i, 0] = torch.nextafter(torch.tensor(448.0 * 2.0**k), torch.tensor(math.inf)) if i % 2 else 448.0 * 2.0**k
    q = quant.quantize_activation(x)
    exponent = torch.log2(q.scale)
    assert torch.equal(exponent, exponent.round()), "scales must be exact powers of two"
    amax = x.abs().unflatten(-1, (4, 128)).amax(-1)
    assert bool((amax / q.scale <= quant.E4M3_MAX).all()), "every block fits e4m3's range"
    assert bool((amax / (q.scale / 2) > quant.E4M3_MAX).all()), "and no smaller power of two would"
    assert torch.equal(q.scale[0::2, 0], torch.exp2(torch.arange(-8, 8, 2).float()))  # amax = 448 * 2^k: scale 2^k


def test_all_zero_block_gives_zeros_and_scale_one():
    x = torch.randn(2, 256)
    x[1, 128:] = 0
    q = quant.quantize_activation(x)
    assert q.scale[1, 1] == 1.0 and not torch.isnan(q.scale).any()
    assert torch.equal(quant.dequantize(q)[1, 128:], torch.zeros(128))
    w = quant.quantize_weight(torch.zeros(128, 128))
    assert torch.equal(w.scale, torch.ones(1, 1)) and torch.equal(quant.dequantize(w), torch.zeros(128, 128))


def test_an_outlier_changes_only_its_own_block():
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    spiked = x.clone()
    spiked[2, 300] = 1e4 * x.abs().median()
    q, qs = quant.quantize_activation(x), quant.quantize_activation(spiked)
    changed = q.scale != qs.scale
    assert changed[2, 2] and changed.sum() == 1, changed
    same = torch.ones(4, 512, dtype=torch.bool)
    same[2, 256:384] = False
    assert torch.equal(q.data.float()[same], qs.data.float()[same])
    w = torch.randn(256, 256)
    ws = w.clone()
    ws[200, 10] = 1e4
    assert (quant.quantize_weight(w).scale != quant.quantize_weight(ws).scale).tolist() == [[False, False],
                                                                                            [True, False]]


def test_values_below_the_smallest_normal_become_subnormals_or_zero():
    s_target = 2.0**-3  # one element 448 * s pins the block's scale to s
    sub = torch.tensor([0.0, 2.0**-9, 3 * 2.0**-9, 7 * 2.0**-9, 2.0**-11, 0.7 * 2.0**-9, 5.4 * 2.0**-9])
    x = torch.zeros(1, 128)
    x[0, 0] = 448 * s_target
    x[0, 1 : 1 + sub.numel()] = sub * s_target
    q = quant.quantize_activation(x)
    assert q.scale.item() == s_target
    dq = quant.dequantize(q)[0, 1 : 1 + sub.numel()] / s_target
    # multiples of 2^-9 are exact; 2^-11 rounds to zero; the rest to the nearest subnormal (ties to even)
    assert dq.tolist() == [0.0, 2.0**-9, 3 * 2.0**-9, 7 * 2.0**-9, 0.0, 2.0**-9, 5 * 2.0**-9]


def test_huge_values_saturate_nothing_overflows():
    x = torch.randn(3, 256)
    x[0, 5] = 3.0e38  # near fp32's largest
    x[1, :] = torch.linspace(-1e30, 1e30, 256)
    x[2, 200] = -1e20
    q = quant.quantize_activation(x)
    dq = quant.dequantize(q)
    assert torch.isfinite(q.data.float()).all() and torch.isfinite(q.scale).all() and torch.isfinite(dq).all()
    assert q.data.float().abs().max() <= quant.E4M3_MAX
    assert ((dq - x).abs() <= U_E4M3 * _expanded_block_amax(x, q.block)).all()
    bf = quant.quantize_activation(x.bfloat16())  # bf16 input, the training case
    assert torch.isfinite(quant.dequantize(bf)).all()


def test_3d_weights_are_blocked_per_expert():
    w = _wide_range((3, 256, 384), seed=3)
    q = quant.quantize_weight(w)
    assert q.scale.shape == (3, 2, 3) and q.block == (128, 128)
    for e in range(3):
        qe = quant.quantize_weight(w[e])
        assert torch.equal(qe.scale, q.scale[e]) and torch.equal(qe.data.float(), q.data[e].float())


def test_a_transposed_weight_quantizes_to_the_same_values_transposed():
    w = _wide_range((256, 384), seed=4)
    q, qt = quant.quantize_weight(w), quant.quantize_weight(w.T.contiguous())
    assert torch.equal(qt.scale, q.scale.T)
    assert torch.equal(quant.dequantize(qt), quant.dequantize(q).T)
    # and a dequantized tensor quantizes to the same bits again
    again = quant.quantize_weight(quant.dequantize(q))
    assert torch.equal(again.scale, q.scale) and torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8))


def test_token_blocks_restart_and_end_partial():
    x = torch.randn(130, 4)
    x[129, 0] = 1000.0  # in the 2-row last block only
    q = quant.quantize_token_blocks(x)
    assert q.scale.shape == (2, 4) and q.block == (128, 1)
    assert torch.equal(q.scale[0], quant.power_of_two_scale(x[:128].abs().amax(0)))
    assert q.scale[1, 0] == quant.power_of_two_scale(torch.tensor(1000.0))


@pytest.mark.parametrize("quantizer,shape,words", [
    (quant.quantize_activation, (3, 192), "dimension 1 (columns) must be a multiple of 128, got 192"),
    (quant.quantize_weight, (100, 128), "dimension 0 (rows) must be a multiple of 128, got 100"),
    (quant.quantize_weight, (2, 128, 64), "dimension 2 (columns) must be a multiple of 128, got 64"),
    (quant.quantize_token_blocks, (130, 5), None),  # rows of a token block may end partial
    (quant.quantize_activation, (256,), "2-D operand or a 3-D weight"),
])
def test_bad_shapes_raise_with_the_fix(quantizer, shape, words):
    if words is None:
        quantizer(torch.randn(shape))
        return
    with pytest.raises(ValueError) as e:
        quantizer(torch.randn(shape))
    assert words in str(e.value), str(e.value)
    assert "2-D" in words or "pad them or use precision='bf16'" in str(e.value)


# ------------------------------------------------------------------------------------------------ emulation

D, H = 256, 128
# Bound on the relative L2 error of the output and of each gradient against float64: each quantized
# operand is off by at most 2^-4 relative per element (so 2^-4 RMS at most), a GEMM passes its operands'
# relative errors through, and errors of independent operands add in quadrature. The longest chain has
# 6 quantized operands with fp8 (x, W1|W3 forward; dout, W2, dg|du, W1|W3 or x backward), 4 with fp8_bwd.
FP8_BOUND = {"fp8": math.sqrt(6) * U_E4M3, "fp8_bwd": math.sqrt(4) * U_E4M3}
# "measurably FP8": e4m3's unit roundoff is 32x bf16's; at least 4x bf16's error proves quantization ran
MIN_RATIO_TO_BF16 = 4.0

CASES = [(64, 9, 2, "skewed"), (48, 8, 2, "empty_experts"), (32, 5, 3, "one_expert"), (1, 3, 1, "random"),
         (1, 4, 2, "random"), (40, 7, 1, "random"), (33, 2, 2, "duplicate_choices")]


def _rel_l2(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def _emulated(case, dout, precision):
    fp8_forward = precision == "fp8"
    return forward_backward(lambda *a: moe_fp8_emulation(*a, fp8_forward=fp8_forward, fp8_backward=True),
                            case, dout)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "T{}-E{}-K{}-{}".format(*c))
def case_results(request):
    T, E, K, routing = request.param
    case = make_case(T, D, H, E, K, routing, seed=T + E)
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref64, torch_bf16 = reference_results(case, dout)
    return case, dout, ref64, torch_bf16


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_emulation_error_is_fp8_sized_and_bounded(case_results, precision):
    case, dout, ref64, torch_bf16 = case_results
    got = _emulated(case, dout, precision)
    quantized = [n for n in ref64 if n != "out" or precision == "fp8"]
    for name in ref64:
        assert got[name].dtype == torch_bf16[name].dtype and torch.isfinite(got[name]).all(), name
        err, base = _rel_l2(got[name], ref64[name]), _rel_l2(torch_bf16[name], ref64[name])
        if name in quantized:
            assert err <= FP8_BOUND[precision], f"{name}: FP8 error {err:.3e} > bound {FP8_BOUND[precision]:.3e}"
            assert err >= MIN_RATIO_TO_BF16 * base, f"{name}: error {err:.3e} is not FP8-sized (bf16: {base:.3e})"
    if precision == "fp8_bwd":  # the bf16 forward, op for op
        assert torch.equal(got["out"], torch_bf16["out"])
    else:
        assert not torch.equal(got["out"], torch_bf16["out"])


def test_emulation_without_fp8_is_a_bf16_backward(case_results):
    """With quantization off on both sides the emulation's backward is the kernels' bf16 math: within 2x of
    PyTorch-bf16's error (the kernel tests' rule), so the FP8 error above is quantization, not a wrong
    derivative."""
    from moe_cases import assert_flash_rule

    case, dout, ref64, torch_bf16 = case_results
    got = forward_backward(lambda *a: moe_fp8_emulation(*a, fp8_forward=False, fp8_backward=False), case, dout)
    assert_flash_rule(got, ref64, torch_bf16)


def _fake(t, quantizer):
    return quant.dequantize(quantizer(t)).to(t.dtype)


def test_the_gemms_see_their_operands_only_through_their_blocks():
    """Replacing an operand by its own quantize->dequantize copy changes nothing the GEMMs that quantize it
    that way compute (quantization is idempotent): with fp8, weights -> their 128x128 copies leaves the
    output and every gradient bitwise equal; x -> its 1x128 copy leaves out, dx, ds; dout -> its 1x128
    copy leaves dx, ds, dW1, dW3. (The token-blocked wgrad operands mostly do not change either: an e4m3
    value times a power of two stays exact under another power-of-two scale unless it turns subnormal.)
    With fp8_bwd the forward is bf16, so the quantized weight copies do change the output."""
    case = make_case(40, D, H, 5, 2, "skewed", seed=7)
    dout = torch.randn(40, D, generator=torch.Generator().manual_seed(8)).bfloat16()
    fp8 = lambda *a: moe_fp8_emulation(*a, fp8_forward=True, fp8_backward=True)  # noqa: E731
    base = forward_backward(fp8, case, dout)

    def rerun(fn=fp8, d=dout, **replace):
        return forward_backward(fn, dataclasses.replace(case, **replace), d)

    def same(got, names):
        return {n: torch.equal(got[n], base[n]) for n in names}

    weights = {n: _fake(getattr(case, n), quant.quantize_weight) for n in ("w1", "w2", "w3")}
    assert all(same(rerun(**weights), base).values())
    assert all(same(rerun(x=_fake(case.x, quant.quantize_activation)), ["out", "dx", "dscores"]).values())
    assert all(same(rerun(d=_fake(dout, quant.quantize_activation)), ["dx", "dscores", "dw1", "dw3"]).values())
    fp8_bwd = lambda *a: moe_fp8_emulation(*a, fp8_forward=False, fp8_backward=True)  # noqa: E731
    assert not torch.equal(forward_backward(fp8_bwd, case, dout)["out"], rerun(fp8_bwd, **weights)["out"])


def test_forward_is_the_recipe_written_out():
    """One expert, K=1, score 1 (the combine is the identity): out = bf16(Q(h) W2q^T) with
    h = bf16(silu(g) u) from the fp32 GEMM1 of Q(x) and the 128x128 copies of W1, W3."""
    case = make_case(37, D, H, 1, 1, seed=9)
    case.scores = torch.ones_like(case.scores)
    w1q, w2q, w3q = (quant.dequantize(quant.quantize_weight(w[0])) for w in (case.w1, case.w2, case.w3))
    xq = quant.dequantize(quant.quantize_activation(case.x))
    g, u = xq @ w1q.T, xq @ w3q.T
    h = (g * torch.sigmoid(g) * u).bfloat16()
    y = quant.dequantize(quant.quantize_activation(h)) @ w2q.T
    assert torch.equal(moe_fp8_emulation(*case.inputs()), y.bfloat16())


def test_weight_gradient_blocks_restart_at_each_expert():
    """dW of an expert depends only on its own rows: an outlier in the last row of expert 0's segment
    (next to expert 1's first rows in the sorted buffer) changes dW1[0] but not dW1[1] or dW3[1]."""
    T = 200  # expert 0 gets 150 rows: its second token block is partial, and expert 1 starts mid-128
    case = make_case(T, D, H, 2, 1, seed=5)
    case.ids = torch.cat([torch.zeros(150, 1, dtype=torch.int64), torch.ones(50, 1, dtype=torch.int64)])
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(6)).bfloat16()
    fp8 = lambda *a: moe_fp8_emulation(*a, fp8_forward=True, fp8_backward=True)  # noqa: E731
    base = forward_backward(fp8, case, dout)
    case.x = case.x.clone()
    case.x[149] *= 64  # a power of two: only the scales of expert 0's blocks that hold token 149 change
    spiked = forward_backward(fp8, case, dout)
    assert not torch.equal(base["dw1"][0], spiked["dw1"][0])
    assert torch.equal(base["dw1"][1], spiked["dw1"][1]) and torch.equal(base["dw3"][1], spiked["dw3"][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_come_in_the_inputs_dtypes(dtype):
    case = make_case(9, D, H, 3, 2, dtype=dtype)
    got = forward_backward(moe_fp8_emulation, case, torch.randn(9, D))
    assert got["out"].dtype == got["dx"].dtype == got["dw1"].dtype == got["dw2"].dtype == dtype
    assert got["dscores"].dtype == torch.float32


def test_no_tokens():
    case = make_case(0, D, H, 3, 2)
    got = forward_backward(moe_fp8_emulation, case, torch.zeros(0, D))
    assert got["out"].shape == (0, D) and got["dx"].shape == (0, D)
    assert not got["dw1"].any() and not got["dw2"].any() and not got["dw3"].any()


# ------------------------------------------------------------------------------------------------ public API


def test_moe_fp8_on_the_reference_backend_is_the_emulation():
    case = make_case(12, D, H, 4, 2)
    dout = torch.randn(12, D).bfloat16()
    for precision, fp8_forward in (("fp8", True), ("fp8_bwd", False)):
        got = forward_backward(lambda *a: titan_megamoe.moe(*a, precision=precision, backend="reference"), case, dout)
        emu = forward_backward(lambda *a: moe_fp8_emulation(*a, fp8_forward=fp8_forward, fp8_backward=True),
                               case, dout)
        for name, g in got.items():
            assert g is not None and g.abs().sum() > 0 and torch.isfinite(g).all(), (precision, name)
            assert torch.equal(g, emu[name]), (precision, name)
    auto = titan_megamoe.moe(*case.inputs(), precision="fp8")  # 'auto' on CPU is the reference backend
    assert torch.equal(auto, moe_fp8_emulation(*case.inputs()))


@pytest.mark.parametrize("d,h,name", [(192, 128, "D (model dim)"), (256, 64, "H (expert hidden dim)")])
def test_fp8_needs_multiples_of_128(d, h, name):
    case = make_case(5, d, h, 4, 2)
    with pytest.raises(ValueError, match=rf"precision='fp8': {re.escape(name)} must be a multiple of 128.*pad"):
        titan_megamoe.moe(*case.inputs(), precision="fp8", backend="reference")


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("backend", ["reference", "triton", "auto"])
def test_job_check_allows_fp8_on_both_backends(precision, backend):
    pytest.importorskip("torchtitan")
    from titan_megamoe.integrations.torchtitan.converter import check_job

    job = SimpleNamespace(mega_moe=SimpleNamespace(precision=precision, backend=backend),
                          model=SimpleNamespace(converters=[]))
    assert check_job(job, None)[0] == precision


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_a_clear_error(monkeypatch):
    """Block FP8 on the Triton backend needs e4m3 MMAs (compute capability 8.9 and up): on an older GPU the op
    and the TorchTitan job check stop with the GPU named and the fix, before any kernel compiles; the
    reference backend's emulation and bf16 still run there."""
    pytest.importorskip("torchtitan")
    from titan_megamoe.integrations.torchtitan import converter
    from titan_megamoe.precision import check_backend_precision, recipe_for

    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(
        major=capability[0][0], minor=capability[0][1], name="NVIDIA A100-SXM4-80GB"))
    cuda = torch.device("cuda", 0)
    for precision in ("fp8", "fp8_bwd"):
        with pytest.raises(ValueError, match=r"needs a GPU with FP8 tensor cores .* A100-SXM4-80GB has 8\.0; "
                                             r"use precision='bf16'"):
            check_backend_precision(recipe_for(precision), "triton", cuda)
        check_backend_precision(recipe_for(precision), "reference", cuda)
        check_backend_precision(recipe_for(precision), "triton", torch.device("cpu"))  # the interpreter
    check_backend_precision(recipe_for("bf16"), "triton", cuda)
    monkeypatch.setattr(converter, "device_for_checks", lambda: cuda)
    job = SimpleNamespace(mega_moe=SimpleNamespace(precision="fp8", backend="auto"),
                          model=SimpleNamespace(converters=[]))
    with pytest.raises(ValueError, match=r"^\[mega_moe\] precision='fp8' needs a GPU with FP8 tensor cores"):
        converter.check_job(job, None)
    for capability[0] in ((8, 9), (9, 0), (10, 0)):
        check_backend_precision(recipe_for("fp8"), "triton", cuda)
        assert converter.check_job(job, None)[0] == "fp8"


def test_fp8_gpu_check_also_in_the_custom_op(monkeypatch):
    """Under torch.compile `moe` leaves the FP8 tensor-core check to the custom op's implementation (it runs
    eagerly), whose recipe lookup takes the inputs' device: it stops on such a GPU too."""
    from titan_megamoe import ops

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(major=7, minor=0, name="Tesla V100"))
    with pytest.raises(ValueError, match="Tesla V100 has 7.0"):
        ops._kernel_recipe("fp8_bwd", torch.device("cuda", 0))
    assert ops._kernel_recipe("fp8_bwd", torch.device("cpu")).precision.value == "fp8_bwd"
