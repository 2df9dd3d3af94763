"""The fused op under torch.compile(fullgraph=True): traced through its fake implementation and
registered autograd, with results bitwise equal to eager (kernels in Triton's interpreter on CPU)."""

import pytest
import torch

import titan_megamoe
from moe_cases import make_case


def _moe(x, ids, s, w1, w2, w3):
    return titan_megamoe.moe(x, ids, s, w1, w2, w3, backend="triton")


def _forward_backward(fn, case):
    leaves = [t.detach().requires_grad_(True) if t.is_floating_point() else t for t in case.inputs()]
    out = fn(*leaves)
    out.float().square().sum().backward()
    return out.detach(), [t.grad for t in leaves if t.is_floating_point()]


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager(compile_backend):
    case = make_case(9, 32, 32, 4, 2, "random", seed=1, device="cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(_moe, fullgraph=True, backend=compile_backend)
    out_c, grads_c = _forward_backward(compiled, case)
    out_e, grads_e = _forward_backward(_moe, case)
    assert torch.equal(out_c, out_e)
    assert all(torch.equal(a, b) for a, b in zip(grads_c, grads_e))
