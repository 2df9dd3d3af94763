"""`kernels.launch`: the fast launch path picks the compiled kernel Triton itself would pick and computes
the same result, for every kind of argument Triton specializes on."""

import pytest
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from titan_megamoe.kernels import launch as L
from titan_megamoe.kernels.common import INTERPRET


def test_summary_separates_what_triton_specializes_on():
    """Integers: 1, multiples of 16, others, and the i32 / i64 / u64 widths apart; floats and None by kind."""
    s = L._summary
    ints = [1, 16, 32, 17, 2**31 + 1, 2**33, 2**63]
    assert s(16) == s(32) and s(17) == s(33)
    assert len({s(v) for v in ints}) == len(ints) - 1  # only 16 and 32 share a summary
    assert s(2**31) != s(2**31 - 1) and s(-(2**31)) == s(16) and s(2**63) != s(2**63 - 16)
    assert s(1.5) == s(2.0) and s(None) != s(0) and s(True) != s(1)
    t = torch.zeros(8, dtype=torch.bfloat16)
    assert s(t) == s(torch.ones(8, dtype=torch.bfloat16)) and s(t) != s(t.float())
    assert s(t[1:]) != s(t)  # a 2-byte offset: no longer 16-byte aligned


def test_key_is_the_summary_of_every_runtime_argument():
    """`_FastLaunch._key` summarises plain tensors and ints inline: the key must be exactly the one built from
    `_summary` (which the GPU tests below check against Triton's own pick), for every kind of argument,
    tensor subclasses and misaligned views included."""
    # a JITFunction even under the interpreter (the key needs only its signature; nothing launches here)
    fast = L._FastLaunch(_axpy if hasattr(_axpy, "params") else triton.runtime.jit.JITFunction(_axpy.fn))
    t = torch.zeros(64, dtype=torch.bfloat16)
    desc = TensorDescriptor.from_tensor(torch.zeros(16, 16), [16, 16])
    values = [t, t[1:], t.float(), torch.nn.Parameter(t.clone()), 1, 16, 17, 0, -5, 2**40, 2.5, None, True, desc]
    # the integer width classes' edges, each side
    values += [2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1]
    for x in values:
        for n in values:
            args = (x, t, t, n, 0.5, 16)
            want = (0, tuple(L._summary(a) for a in args), (("BLOCK", 128),))
            assert fast._key(0, args, {"BLOCK": 128}) == want
    # a constexpr given by position is keyed by value
    assert fast._key(0, (t, t, t, 8, 0.5, 16, 64), {})[1][-1] == 64


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, scale, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs * stride, mask=ok, other=0.0)
    tl.store(out_ptr + offs, x * scale + tl.load(y_ptr + offs, mask=ok, other=0.0), mask=ok)


@triton.jit
def _tile_copy(src, out_ptr, stride_o, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R
    tile = src.load([r, 0])
    rows = r + tl.arange(0, BLOCK_R)
    tl.store(out_ptr + rows[:, None] * stride_o + tl.arange(0, BLOCK_C)[None, :], tile)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="the fast path runs compiled kernels only")
@pytest.mark.parametrize("offset,n,scale,stride", [(0, 1000, 3, 1), (1, 1000, 3, 1), (0, 1, 1, 1), (0, 16, 16, 16),
                                                   (8, 17, 2, 2), (0, 1000, 2**33, 1)])
def test_fast_launch_runs_the_kernel_triton_picks(offset, n, scale, stride):
    """Pointers aligned or not, n = 1, 16, 17, scale an i32 or an i64, stride 1 / 2 / 16: the second call
    (the fast path) writes what Triton's own launch writes, with the compiled kernel Triton returns."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(offset + n * stride, device="cuda", generator=gen)[offset:]
    y = torch.randn(n, device="cuda", generator=gen)
    grid = (triton.cdiv(n, 128),)
    outs = []
    for _ in range(2):  # the first call records the kernel, the second takes the fast path
        out = torch.full((n,), float("nan"), device="cuda")
        L.launch(_axpy, grid, x, y, out, n, scale, stride, BLOCK=128)
        outs.append(out)
    want = torch.full((n,), float("nan"), device="cuda")
    compiled = _axpy[grid](x, y, want, n, scale, stride, BLOCK=128)
    fast = L._launchers[_axpy]
    assert fast.compiled[fast._key(torch.cuda.current_device(), (x, y, want, n, scale, stride), {"BLOCK": 128})] \
        is compiled
    for out in outs:
        assert torch.equal(out, want)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="the fast path runs compiled kernels only")
def test_fast_launch_with_tma_descriptors():
    """A TMA descriptor argument (built anew per call, over different tensors) through the fast path."""
    for rows in (64, 192):
        src = torch.randn(rows, 64, device="cuda").to(torch.bfloat16)
        for _ in range(2):
            out = torch.zeros_like(src)
            L.launch(_tile_copy, (rows // 64,), TensorDescriptor.from_tensor(src, [64, 64]), out, out.stride(0),
                     BLOCK_R=64, BLOCK_C=64)
            assert torch.equal(out, src)
