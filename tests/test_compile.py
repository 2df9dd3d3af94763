"""The fused op under torch.compile(fullgraph=True): traced through its fake implementation and
registered autograd, with results bitwise equal to eager (kernels in Triton's interpreter on CPU)."""

import pytest
import torch

import titan_megamoe
from moe_cases import forward_backward, make_case


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
