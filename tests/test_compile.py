"""The fused op under torch.compile(fullgraph=True): traced through its fake implementation and
registered autograd, with results bitwise equal to eager (kernels in Triton's interpreter on CPU)."""

import functools

import pytest
import torch

import titan_megamoe
from moe_cases import forward_backward, make_case, swapped_tiny_moe_layer


def _moe(x, ids, s, w1, w2, w3):
    return titan_megamoe.moe(x, ids, s, w1, w2, w3, backend="triton")


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager(compile_backend):
    case = make_case(9, 32, 32, 4, 2, "random", seed=1, device="cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(_moe, fullgraph=True, backend=compile_backend)
    dout = torch.randn_like(case.x)
    got, want = forward_backward(compiled, case, dout), forward_backward(_moe, case, dout)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _fp8_case():
    """The FP8 compile tests' case and upstream gradient (the same for both precisions)."""
    case = make_case(9, 128, 128, 3, 2, "random", seed=2, device="cuda" if torch.cuda.is_available() else "cpu")
    dout = torch.randn(case.x.shape, generator=torch.Generator().manual_seed(3)).to(case.x)
    return case, dout


@functools.lru_cache(maxsize=1)
def _bf16_eager_of_the_fp8_case():
    """The eager bf16 op on that case: the same inputs for both precisions, so computed once (in the
    interpreter on CPU it costs as much as an FP8 call)."""
    return forward_backward(_moe, *_fp8_case())


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fullgraph_compile_block_fp8_matches_eager(precision):
    """The FP8 residuals (their shapes and dtypes come from the recipe in the fake implementation) trace,
    and the compiled op runs the same FP8 kernels as eager: bitwise equal results."""
    case, dout = _fp8_case()

    def fp8_moe(x, ids, s, w1, w2, w3):
        return titan_megamoe.moe(x, ids, s, w1, w2, w3, backend="triton", precision=precision)

    torch._dynamo.reset()
    compiled = torch.compile(fp8_moe, fullgraph=True, backend="aot_eager")
    got, want = forward_backward(compiled, case, dout), forward_backward(fp8_moe, case, dout)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    bf16 = _bf16_eager_of_the_fp8_case()
    assert not torch.equal(got["dw1"], bf16["dw1"]), "fp8 gradients equal bf16's"


def test_compiled_layer_uses_the_stock_router(monkeypatch):
    """Under torch.compile the swapped TorchTitan layer runs TorchTitan's router (plain aten ops the
    tracer understands), not the fused router's Triton launch, and matches the eager layer run the same way."""
    import copy

    from titan_megamoe.integrations.torchtitan import cpu, modules

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(torch, "histc", cpu.histc_int_cpu(torch.histc))
    fused_calls = []
    real = modules.topk_route
    monkeypatch.setattr(modules, "topk_route", lambda *a: fused_calls.append(1) or real(*a))
    layer, dim = swapped_tiny_moe_layer(dev)
    eager_stock_router = copy.deepcopy(layer)
    eager_stock_router.fused_router = False
    x = torch.randn(2, 16, dim, device=dev, dtype=torch.bfloat16)
    torch._dynamo.reset()
    got = torch.compile(layer, backend="aot_eager")(x)
    assert not fused_calls
    want = eager_stock_router(x)
    torch.testing.assert_close(got, want)
    layer(x)  # eager: the fused router
    assert len(fused_calls) == 1
