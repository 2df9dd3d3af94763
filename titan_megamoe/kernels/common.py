"""Small pieces every kernel shares: the MMA and cast helpers, TMA descriptors, output buffers.

INTERPRET is true when the kernels run in Triton's CPU interpreter: Triton decides that when a kernel
is defined (TRITON_INTERPRET=1 at import), so it is read once here from a jitted function, not from the
environment at call time (a test that sets the variable later cannot switch the tile configs under a
compiled kernel). As a constexpr it works around two numerics gaps of Triton 3.6's interpreter so that
CPU tests check the same math the GPU runs: it multiplies bf16 tiles as their uint16 bit patterns, and
it truncates fp32 -> bf16 instead of rounding to nearest even.
"""

import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def mma(a, b, acc, INTERPRET: tl.constexpr):
    """acc += a @ b (bf16 operands, fp32 accumulator)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype with round-to-nearest-even (what the GPU's cvt does)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


INTERPRET = isinstance(mma, InterpretedFunction)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can cover these tensors: row-major with 16-byte aligned rows and base
    (the kernels fall back to pointer loads otherwise, e.g. for a strided weight view)."""
    return all(t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in tensors)


def matrix_descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """TMA descriptor over t viewed as a matrix [prod(leading dims), last dim]: a per-expert weight
    [E, R, C] becomes [E*R, C], so expert e's rows start at e*R."""
    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), block_shape)


def new_output(shape, dtype, device):
    """Allocate a kernel output. TITAN_MEGAMOE_POISON=1 fills it with NaN first, so an element a kernel
    forgot to write shows up in the checks instead of silently holding stale memory (integer outputs get
    their dtype's most negative value)."""
    if os.environ.get("TITAN_MEGAMOE_POISON") == "1":
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
