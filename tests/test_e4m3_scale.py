"""`common.e4m3_scale` (every FP8 kernel's block scale, built from amax's bits) against
`quant.power_of_two_scale` (the oracle's, built from frexp of amax / 448) at every fp32 exponent: the
mantissas at and around 1.75 (where the exponent steps: 448 = 1.75 * 2^8), the ends of each binade,
random ones, subnormals and zero; on the GPU when there is one, else in Triton's interpreter."""

import torch
import triton
import triton.language as tl

from titan_megamoe import quant
from titan_megamoe.kernels.common import e4m3_scale

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _scale_kernel(amax_ptr, scale_ptr, inv_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale, inv = e4m3_scale(tl.load(amax_ptr + offs, mask=offs < n, other=0.0))
    tl.store(scale_ptr + offs, scale, mask=offs < n)
    tl.store(inv_ptr + offs, inv, mask=offs < n)


def _amax_values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    mantissas = torch.cat([torch.tensor([0, 1, 2, 0x5FFFFE, 0x5FFFFF, 0x600000, 0x600001, 0x600002, 0x7FFFFE,
                                         0x7FFFFF]), torch.randint(0, 1 << 23, (54,), generator=gen)])
    exponents = torch.arange(0, 255)  # 0: subnormals (and zero)
    bits = (exponents[:, None] << 23) | mantissas[None, :]
    return bits.reshape(-1).to(torch.int32).view(torch.float32)


def test_scale_from_bits_is_the_oracles():
    amax = _amax_values()
    assert bool((amax == 0).any()) and bool((amax < 2.0**-126).any()) and bool((amax > 2.0**126).any())
    scale, inv = torch.empty_like(amax, device=DEVICE), torch.empty_like(amax, device=DEVICE)
    _scale_kernel[(triton.cdiv(amax.numel(), 1024),)](amax.to(DEVICE), scale, inv, amax.numel(), BLOCK=1024)
    want = quant.power_of_two_scale(amax)
    bad = scale.cpu().view(torch.int32) != want.view(torch.int32)
    assert not bool(bad.any()), f"{int(bad.sum())} scales differ, first amax {amax[bad][:4].tolist()}"
    assert torch.equal(inv.cpu(), 1.0 / want)  # powers of two: the reciprocal is exact
    # the exponent really steps at 1.75: amax = 1.75 * 2^k takes scale 2^(k-8), the next fp32 up 2^(k-7)
    at, above = torch.tensor([1.75 * 2.0**10]), torch.nextafter(torch.tensor([1.75 * 2.0**10]), torch.tensor([1e9]))
    assert quant.power_of_two_scale(at).item() == 4.0 and quant.power_of_two_scale(above).item() == 8.0
