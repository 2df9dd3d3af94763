"""The public `titan_megamoe.moe` API on CPU: argument errors, edge cases, the custom op's fake impl."""

import pytest
import torch

import titan_megamoe
from moe_cases import make_case
from titan_megamoe.oracle import moe_reference


def _inputs(T=5, D=16, H=8, E=4, K=2):
    return list(make_case(T, D, H, E, K, dtype=torch.float32).inputs())


@pytest.mark.parametrize(
    "index,bad,exc,words",
    [
        (0, torch.randn(5, 16, 1), ValueError, ["x_TD", "2-D"]),
        (0, torch.randn(5, 12), ValueError, ["w1_EFD", "D=12"]),
        (1, torch.zeros(5, 2), TypeError, ["topk_ids_TK", "float32"]),
        (1, torch.zeros(4, 2, dtype=torch.int64), ValueError, ["topk_ids_TK", "4 rows", "T=5"]),
        (2, torch.rand(5, 3), ValueError, ["topk_scores_TK", "(5, 3)"]),
        (3, torch.randn(4, 8, 16, dtype=torch.float64), TypeError, ["w1_EFD", "float64"]),
        (4, torch.randn(4, 8, 16), ValueError, ["w2_EDF", "(4, 16, 8)"]),
        (5, torch.randn(3, 8, 16), ValueError, ["w3_EFD", "(4, 8, 16)"]),
        (5, "not a tensor", TypeError, ["w3_EFD", "str"]),
    ],
)
def test_bad_arguments_name_the_argument(index, bad, exc, words):
    args = _inputs()
    args[index] = bad
    with pytest.raises(exc) as info:
        titan_megamoe.moe(*args)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_expert_ids_out_of_range():
    args = _inputs()
    args[1] = args[1].clone()
    args[1][2, 1] = 4
    with pytest.raises(ValueError, match=r"expert ids in \[0, 4\] but there are E=4"):
        titan_megamoe.moe(*args)
    args[1][2, 1] = -1
    with pytest.raises(ValueError, match="valid ids: 0..3"):
        titan_megamoe.moe(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_triton_backend_without_gpu_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA GPU.*backend='reference'"):
        titan_megamoe.moe(*_inputs(), backend="triton")


@pytest.mark.parametrize("precision,backend,exc,words", [
    ("fp16", "auto", ValueError, "expected one of 'bf16', 'fp8', 'fp8_bwd', 'mxfp8'"),
    ("mxfp8", "auto", ValueError, "Blackwell"),
])
def test_precision_errors(precision, backend, exc, words):
    with pytest.raises(exc, match=words):
        titan_megamoe.moe(*_inputs(), precision=precision, backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend: unknown value 'cuda'"):
        titan_megamoe.moe(*_inputs(), backend="cuda")


def test_mismatched_devices_are_named():
    args = _inputs()
    args[3] = args[3].to("meta")
    with pytest.raises(ValueError, match="w1_EFD is on meta but x_TD is on cpu"):
        titan_megamoe.moe(*args)


def test_meta_inputs_are_named_not_a_torch_item_error():
    args = [t.to("meta") for t in _inputs()]
    with pytest.raises(ValueError, match="on the meta device, which holds no values.*materialize"):
        titan_megamoe.moe(*args, backend="reference")


@pytest.mark.parametrize("T,K,routing", [(1, 1, "random"), (1, 3, "random"), (9, 1, "one_expert"),
                                         (12, 2, "empty_experts"), (0, 2, "random")])
def test_edge_cases_match_float64(T, K, routing):
    case = make_case(T, 16, 8, 6, K, routing, dtype=torch.float32)
    out = titan_megamoe.moe(*case.inputs(), backend="reference")
    assert out.shape == (T, 16) and out.dtype == torch.float32
    if T:
        ref = moe_reference(*[t.double() if t.is_floating_point() else t for t in case.inputs()])
        # the bf16 precision computes the expert GEMMs in bf16, as stock TorchTitan does
        assert torch.allclose(out.double(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def test_gradients_flow_to_every_input():
    case = make_case(7, 16, 8, 4, 2, dtype=torch.float32)
    leaves = [t.detach().requires_grad_(True) if t.is_floating_point() else t for t in case.inputs()]
    titan_megamoe.moe(*leaves).square().sum().backward()
    for i in (0, 2, 3, 4, 5):
        assert leaves[i].grad is not None and leaves[i].grad.abs().sum() > 0, i


def test_fake_impl_gives_shapes_for_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(6, 32, 16, 4, 2)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in case.inputs()]
        link, h, g, u, meta = torch.ops.titan_megamoe.moe_up(*fake, "bf16", "triton")
        out = torch.ops.titan_megamoe.moe_down(link, fake[2], fake[4], [h], meta, "bf16", "triton")
    from titan_megamoe.kernels.configs import row_block_m
    from titan_megamoe.plan import max_tiles

    # order + inverse (N each), offsets (E+1), tile expert + tile row (n_tiles each), the ids-in-range flag
    n_tiles = max_tiles(12, 4, row_block_m())
    assert link.shape == out.shape == (6, 32) and link.stride() == (0, 0) and out.is_contiguous()
    assert h.shape == g.shape == u.shape == (12, 16) and meta.shape == (2 * 12 + 5 + 2 * n_tiles + 1,)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_bwd"])
def test_fake_impl_matches_the_real_outputs(precision):
    """The fake implementation (what torch.compile traces) gives every output's real shape and dtype:
    under fp8 the residuals include the FP8 W^T copies."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(9, 256, 128, 3, 2, dtype=torch.bfloat16, device=dev)
    with FakeTensorMode() as mode:
        fake = torch.ops.titan_megamoe.moe_up(*[mode.from_tensor(t) for t in case.inputs()], precision, "triton")
    real = torch.ops.titan_megamoe.moe_up(*case.inputs(), precision, "triton")
    # the link, GEMM2's operands (h; under fp8 h and W2 in e4m3 with their scales), g, u, (fp8: W1^T, W2^T,
    # W3^T with their scales), the packed plan
    assert len(fake) == len(real) == (14 if precision == "fp8" else 5)
    def meta(tensors):
        return [(tuple(t.shape), t.stride(), t.dtype) for t in tensors]

    assert meta(fake) == meta(real)


def test_triton_backend_names_unaligned_dims_and_the_fix():
    case = make_case(5, 32, 24, 4, 2, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"H \(expert hidden dim\) must be a multiple of 16, got 24; use backend='reference'"):
        titan_megamoe.moe(*case.inputs(), backend="triton")
